"""The dashboard's building blocks: targets and panels on the dashboard's datasource and variables, and
the rows below the run-level panels (skips by precision and loss-scale floor, fp16 numerics, leading
indicators, run integrity, fp8 casts), each placed below the last."""

from __future__ import annotations

from typing import Any

from .. import metrics as M
from .rules import _REC_SKIP_RATE_PRECISION, FP8_UNDERFLOW_THRESHOLD

_DS = {"type": "prometheus", "uid": "${datasource}"}
_SEL = 'job=~"$job", rank=~"$rank"'
_JOB = 'job=~"$job"'


def _q(metric: M.Metric, suffix: str = "", selector: str = _SEL) -> str:
    return f"{metric.series(suffix)}{{{selector}}}"


def _target(expr: str, legend: str = "", ref: str = "A", **extra: Any) -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": _DS, "expr": expr, "refId": ref, "legendFormat": legend or "__auto"}
    t.update(extra)
    return t


def _panel(
    pid: int,
    kind: str,
    title: str,
    description: str,
    unit: str,
    targets: list[dict[str, Any]],
    grid: tuple[int, int, int, int],
    **extra: Any,
) -> dict[str, Any]:
    x, y, w, h = grid
    panel: dict[str, Any] = {
        "id": pid,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": _DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
        "targets": targets,
    }
    for key, value in extra.items():
        if key == "defaults":
            panel["fieldConfig"]["defaults"].update(value)
        else:
            panel[key] = value
    return panel


def _precision_panels(pid: int, y: int) -> list[dict[str, Any]]:
    """The row of AmpguardSkipRate and AmpguardLossScaleAtFloor: skip rate by precision, scale vs floor
    (panel ids from ``pid``, the row at grid row ``y``)."""
    return [
        _panel(pid, "row", "Skips by precision, loss-scale floor", "What AmpguardSkipRate and "
               "AmpguardLossScaleAtFloor look at.", "none", [], (0, y, 24, 1), collapsed=False),
        _panel(
            pid + 1, "timeseries", "Skip rate by precision", "Fraction of steps skipped over 5 minutes per run and "
            "precision (the recording rule AmpguardSkipRate uses). bf16 and fp32 skips are NaN/inf or spikes, "
            "never a loss-scale probe: any lasting rate there is abnormal.", "percentunit",
            [_target(f"{_REC_SKIP_RATE_PRECISION}{{{_JOB}}}", "{{job}} {{precision}}")],
            (0, y + 1, 12, 8),
        ),
        _panel(
            pid + 2, "timeseries", "Loss scale vs floor", "fp16 loss scale of each rank and its floor (GuardConfig."
            "min_scale), log2 axis: a scale lying on its floor gets the least protection from underflow. bf16/fp32 "
            "runs have no floor.", "short",
            [
                _target(f"max by (rank) ({_q(M.LOSS_SCALE)})", "rank {{rank}} scale", "A"),
                _target(f"max by (rank) ({_q(M.LOSS_SCALE_FLOOR)})", "rank {{rank}} floor", "B"),
            ],
            (12, y + 1, 12, 8), defaults={"custom": {"scaleDistribution": {"type": "log", "log": 2}}},
        ),
    ]



def _numerics_panels(pid: int, y: int) -> list[dict[str, Any]]:
    """The fp16 numerics row: the sampled zero fraction and headroom, rank-local values
    (``GuardConfig.numerics_every``; the gauges hold the last sampled step's value, NaN before one)."""
    zero, headroom = M.GRAD_ZERO_FRACTION, M.LOSS_SCALE_HEADROOM
    by_group = _SEL + ', group=~"$group"'
    return [
        _panel(pid, "row", "fp16 numerics (sampled)", "GuardConfig.numerics_every: underflow and overflow headroom of "
               "each rank's own still-scaled gradients.", "none", [], (0, y, 24, 1), collapsed=False),
        _panel(
            pid + 1, "timeseries", "Gradient zero fraction",
            "Fraction of this rank's gradient elements that are exactly zero, per param group (group=all: every "
            "gradient). A rise at a falling loss scale is fp16 underflow: gradients lost below 2^-24.",
            "percentunit",
            [_target(f'max by (rank, group) ({_q(zero, selector=by_group)})',
                     "rank {{rank}} group {{group}}")],
            (0, y + 1, 12, 8), defaults={"min": 0, "max": 1},
        ),
        _panel(
            pid + 2, "timeseries", "Loss-scale headroom (log2)",
            "log2(65504 / max|scaled gradient|) per rank: doublings of the loss scale left before fp16 overflows. "
            "Near 0: the next growth overflows; large: the scale could be higher (less underflow).",
            "none",
            [_target(f"min by (rank) ({_q(headroom)})", "rank {{rank}}")],
            (12, y + 1, 12, 8), defaults=_red_below(0),
        ),
    ]


def _red_below(value: float) -> dict[str, Any]:
    return {"thresholds": {"mode": "absolute", "steps": [{"color": "red", "value": None},
                                                          {"color": "green", "value": value}]}}


def _below(panels: list[dict[str, Any]]) -> tuple[int, int]:
    """The next free panel id and the first grid row below every panel of ``panels``."""
    pid = max(p["id"] for p in panels) + 1
    y = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    return pid, y


def _indicator_panels(pid: int, y: int) -> list[dict[str, Any]]:
    """The leading indicators (:mod:`ampguard.indicators`): a row of their own (panel ids
    from ``pid``, at grid row ``y``), gradient norm and update ratio per top-level module (log axes).
    Every rank reports its own values (with DDP the gradients, hence the values, are the same on
    every rank): the max over the selected ranks; pick one rank with the rank variable."""
    log10 = {"custom": {"scaleDistribution": {"type": "log", "log": 10}}}
    what = {
        M.MODULE_GRAD_NORM: ("Gradient norm per module", "L2 norm of each top-level module's unscaled gradients "
                             "(before clipping) at the last sampled step, max over the selected ranks (0: the module "
                             "had no gradient; gaps: NaN/inf or not sampled yet). Read each line against its own "
                             "past: one module climbing while the others stay level points at that module."),
        M.MODULE_UPDATE_RATIO: ("Update ratio per module", "||delta w|| / ||w|| of each top-level module's update at "
                                "the last sampled step, max over the selected ranks (0: a skipped step or a frozen "
                                "module). Typical healthy values are around 1e-4 to 1e-2 and steady; a module's ratio "
                                "rising by orders of magnitude means its updates outgrow its weights (LR too high "
                                "for it)."),
    }
    row = _panel(pid, "row", "Leading indicators", "Per top-level module, sampled every GuardConfig.indicators_every "
                 "steps: a module whose gradient norm or update ratio climbs away from its own past leads a loss "
                 "spike (docs/indicators.md).", "none", [], (0, y, 24, 1), collapsed=False)
    return [row, *(
        _panel(pid + 1 + i, "timeseries", title, description, "short",
               [_target(f"max by (module) ({_q(metric)})", "{{module}}")], (12 * i, y + 1, 12, 8), defaults=log10)
        for i, (metric, (title, description)) in enumerate(what.items())
    )]



def _integrity_panels(pid: int, y: int) -> list[dict[str, Any]]:
    """Run integrity (docs/integrity.md): weights the parameter check found non-finite, and replicas
    the consistency check found holding other bits, per rank and interval."""
    rate = "$__rate_interval"
    poisoned = _q(M.ANOMALIES, selector=_SEL + ', kind="nonfinite_params"')
    return [
        _panel(pid, "row", "Run integrity", "GuardConfig.param_check_every (non-finite weights after an update) and "
               "consistency_every (replicas compared bit for bit); any non-zero bar is a run to stop resuming from "
               "(docs/integrity.md).", "none", [], (0, y, 24, 1), collapsed=False),
        _panel(
            pid + 1, "timeseries", "Non-finite weights found",
            "Checked steps whose updated weights held a NaN/Inf, per rank (the nonfinite_params anomaly: the ladder "
            "rolled back, or training stopped; the anomaly names the parameters). AmpguardNonFiniteParams fires on it.",
            "short", [_target(f"sum by (rank) (increase({poisoned}[{rate}]))", "rank {{rank}}")],
            (0, y + 1, 12, 8),
        ),
        _panel(
            pid + 2, "timeseries", "Replica mismatches",
            "Failed consistency checks per rank: step/skip counts, loss scale or the parameters' bits differ between "
            "replicas (a flipped bit shows; the anomaly names the parameters and ranks). AmpguardRankDivergence "
            "fires on it.",
            "short", [_target(f"sum by (rank) (increase({_q(M.RANK_DIVERGENCE)}[{rate}]))", "rank {{rank}}")],
            (12, y + 1, 12, 8),
        ),
    ]


def _fp8_panels(pid: int, y: int) -> list[dict[str, Any]]:
    """The fp8 row (docs/fp8.md): the torchao float8 casts per module, role and rank (the catalogue's
    labels; at most ``metrics.FP8_MODULES`` modules by name, the rest in ``module="_other"``): amax,
    scale (log2), the sampled underflow ratio against AmpguardFp8UnderflowRising's threshold, the
    sampled dynamic range, and non-finite casts per interval."""
    by = "by (module, role, rank)"
    threshold = {"min": 0, "custom": {"thresholdsStyle": {"mode": "line"}},
                 "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None},
                                                              {"color": "red", "value": FP8_UNDERFLOW_THRESHOLD}]}}
    # title, description, unit, query, (x, row below the row's header, width), field defaults
    what: list[tuple[str, str, str, str, tuple[int, int, int], dict[str, Any]]] = [
        ("fp8 amax per module and role",
         "max|x| of the high-precision tensor each cast scales, at the last step (log axis; gaps: NaN/inf, which the "
         "non-finite panel counts). An amax jumping by orders of magnitude on one module and role is where a bad "
         "value enters; a dynamic scale follows the amax, so amax alone never saturates.",
         "short", f"max {by} ({_q(M.FP8_AMAX)})", (0, 1, 12),
         {"custom": {"scaleDistribution": {"type": "log", "log": 10}}}),
        ("fp8 scale per module and role",
         "The scale each cast multiplied by, fp8 max / amax (log2 axis): it falls as the amax grows. 0 (an Inf amax: "
         "the cast zeroed the tensor) and NaN are gaps here and count as non-finite casts.",
         "short", f"min {by} ({_q(M.FP8_SCALE)})", (12, 1, 12),
         {"custom": {"scaleDistribution": {"type": "log", "log": 2}}}),
        ("fp8 underflow ratio",
         "Fraction of each cast's non-zero elements flushed to zero by the cast, at the last sampled step "
         "(GuardConfig.numerics_every). The red line is AmpguardFp8UnderflowRising's threshold "
         f"({FP8_UNDERFLOW_THRESHOLD:.0%}, over a 10-minute average that also doubled in 30 minutes). A rising "
         "grad_output ratio is gradients lost to fp8: consider rowwise scaling, or that layer in bf16.",
         "percentunit", f"max {by} ({_q(M.FP8_UNDERFLOW)})", (0, 9, 8), threshold),
        ("fp8 dynamic range (log2)",
         "log2(amax / smallest non-zero |x|) of each cast's tensor at the last sampled step: the binades it spans. "
         "Beyond what its fp8 format holds (about 18 for e4m3, 32 for e5m2) the smallest values underflow.",
         "none", f"max {by} ({_q(M.FP8_DYNAMIC_RANGE)})", (8, 9, 8), {}),
        ("fp8 non-finite casts",
         "Casts per interval whose amax or scale was NaN/Inf (or the scale 0): one bad element poisons the whole "
         "cast. AmpguardFp8NonFiniteAmax fires on any.",
         "short", f"sum {by} (increase({_q(M.FP8_NONFINITE)}[$__rate_interval]))", (16, 9, 8), {}),
    ]
    row = _panel(pid, "row", "fp8 casts (torchao float8)", "Every cast of each torchao Float8Linear, per module, role "
                 f"(input, weight, grad_output) and rank; at most {M.FP8_MODULES} modules by name, the others folded "
                 f"into module=\"{M.FP8_OTHER}\" (docs/fp8.md). Empty when fp8 monitoring is off.", "none", [],
                 (0, y, 24, 1), collapsed=False)
    return [row, *(
        _panel(pid + 1 + i, "timeseries", title, description, unit,
               [_target(query, "{{module}} {{role}} rank {{rank}}")], (x, y + dy, w, 8), defaults=defaults)
        for i, (title, description, unit, query, (x, dy, w), defaults) in enumerate(what)
    )]
