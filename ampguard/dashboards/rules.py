"""The Prometheus rules document: recording rules and alerts, their options (burst threshold, skip-rate
thresholds per precision, gradient-growth factor and window, job selector) and the defaults."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from .. import metrics as M
from ..errors import BackendUnavailableError
from .selectors import _sel, parse_selector

DEFAULT_BURST_THRESHOLD = 10
#: AmpguardNonFiniteBurst fires when a run saw *more* non-finite steps in 5 minutes than its
#: threshold: at 0 every single one (each routine fp16 overflow) would page, which is no burst.
MIN_BURST_THRESHOLD = 1
#: AmpguardSkipRate fires when a run's skipped fraction of steps (5-minute rate) stays above the
#: threshold of its precision. fp16 skips by design: dynamic loss scaling probes a larger scale
#: every growth_interval (2000) clean steps and skips the step that overflows, about 0.05% of
#: steps, more while the scale settles; 1% sustained is 20 times that. bf16 and fp32 have no loss
#: scale to probe: every skip is a NaN/inf (or a spike skip), so any sustained skipping is abnormal.
DEFAULT_SKIP_RATE_THRESHOLDS: dict[str, float] = {"fp16": 0.01, "bf16": 0.0, "fp32": 0.0}
#: AmpguardModuleGradNormGrowth: one module's gradient norm (median over the window) more than
#: this factor above its median over the window before.
DEFAULT_GRAD_GROWTH_FACTOR = 10.0
DEFAULT_GRAD_GROWTH_WINDOW = "30m"
#: AmpguardFp8UnderflowRising: a module and role's underflow ratio (10-minute average) above this
#: fraction, and above twice its level 30 minutes before. The dashboard's fp8 row draws it.
FP8_UNDERFLOW_THRESHOLD = 0.01
RULES_FILE = "ampguard.rules.yml"

#: Alert names, in the order the rules file lists them.
ALERTS = (
    "AmpguardNonFiniteBurst",
    "AmpguardLossScaleCollapse",
    "AmpguardRankLossScaleMismatch",
    "AmpguardHighSkipRatio",
    "AmpguardTrainingStalled",
    "AmpguardRankDivergence",
    "AmpguardExporterDown",
    "AmpguardSkipRate",
    "AmpguardLossScaleAtFloor",
    "AmpguardModuleGradNormGrowth",
    "AmpguardNonFiniteParams",
    "AmpguardFp8NonFiniteAmax",
    "AmpguardFp8UnderflowRising",
)

# Recording rule names (level:metric:operations).
_REC_NONFINITE = "job:" + M.NONFINITE_STEPS.name.removesuffix("_total") + ":increase5m"
_REC_SKIP_RATIO = "job:" + M.SKIPPED_STEPS.name.removesuffix("_total") + ":ratio_rate5m"
_REC_SCALE_MIN = "job:" + M.LOSS_SCALE.name + ":min"
_REC_SCALE_MAX = "job:" + M.LOSS_SCALE.name + ":max"
_REC_STEPS_RATE = "job:" + M.STEPS.name.removesuffix("_total") + ":rate5m"
_REC_SKIP_RATE_PRECISION = "job_precision:" + M.SKIPPED_STEPS.name.removesuffix("_total") + ":ratio_rate5m"
#: The series of one rank's endpoint: what joins a rank's metrics with its run-info labels.
_RANK_SERIES = ("job", "instance", *M.RANK_LABELS)
_DURATION = re.compile(r"(\d+)([mhd])")
_MINUTES = {"m": 1, "h": 60, "d": 1440}


def _skip_rate_thresholds(given: Mapping[str, float] | None) -> dict[str, float]:
    """The per-precision thresholds of AmpguardSkipRate: the defaults, with ``given`` over them."""
    thresholds = {**DEFAULT_SKIP_RATE_THRESHOLDS, **(given or {})}
    unknown = sorted(set(thresholds) - set(DEFAULT_SKIP_RATE_THRESHOLDS))
    if unknown:
        raise ValueError(f"skip_rate_thresholds names unknown precisions {unknown}; known: "
                         f"{', '.join(DEFAULT_SKIP_RATE_THRESHOLDS)}")
    for precision, t in thresholds.items():
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < 1):
            raise ValueError(f"skip_rate_thresholds[{precision!r}]={t!r}; allowed: a fraction in [0, 1) (the alert "
                             "fires above it; 0: on any sustained skipping)")
    return {precision: float(t) for precision, t in thresholds.items()}


def _grad_growth(factor: float, window: str) -> int:
    """Check AmpguardModuleGradNormGrowth's factor and window; return the window in minutes."""
    if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and 1 < factor < math.inf):
        raise ValueError(f"grad_growth_factor={factor!r}; allowed: a number > 1")
    m = _DURATION.fullmatch(window) if isinstance(window, str) else None
    minutes = int(m.group(1)) * _MINUTES[m.group(2)] if m else 0
    if minutes < 10:
        raise ValueError(f"grad_growth_window={window!r}; allowed: a Prometheus duration in m, h or d of at least "
                         "10m, e.g. '30m' or '2h' (it must hold several samples of a norm sampled every N steps)")
    return minutes


# The build_* functions are long: each is the generated artefact written out as data (rules, rule
# tests, panels), read top to bottom against what Grafana/promtool get.
def build_rules(
    *,
    job_selector: str = "",
    burst_threshold: int = DEFAULT_BURST_THRESHOLD,
    fors: dict[str, str] | None = None,
    interval: str | None = None,
    skip_rate_thresholds: Mapping[str, float] | None = None,
    grad_growth_factor: float = DEFAULT_GRAD_GROWTH_FACTOR,
    grad_growth_window: str = DEFAULT_GRAD_GROWTH_WINDOW,
) -> dict[str, Any]:
    """The Prometheus rules document.

    - ``job_selector``: label matchers every rule's input series must match, e.g.
      ``'job=~"train-.*"'`` (empty: all ampguard series).
    - ``burst_threshold``: ``AmpguardNonFiniteBurst`` fires on more than this many non-finite
      steps in 5 minutes for a run; at least :data:`MIN_BURST_THRESHOLD` (1).
    - ``fors``: override the ``for:`` of given alerts (tests use short ones).
    - ``interval``: evaluation interval of the groups (None: Prometheus's global one).
    - ``skip_rate_thresholds``: ``AmpguardSkipRate``'s threshold per precision (a fraction of steps
      in [0, 1)), over :data:`DEFAULT_SKIP_RATE_THRESHOLDS`.
    - ``grad_growth_factor``, ``grad_growth_window``: ``AmpguardModuleGradNormGrowth`` fires when a
      module's median gradient norm over the window is more than the factor (> 1) times its median
      over the window before (a duration of at least 10m).
    """
    whole = isinstance(burst_threshold, int) and not isinstance(burst_threshold, bool)  # True would render "> True"
    if not (whole and burst_threshold >= MIN_BURST_THRESHOLD):
        raise ValueError(
            f"burst_threshold={burst_threshold!r}; allowed: an int >= {MIN_BURST_THRESHOLD} (the alert fires above it: "
            "0 would fire on every non-finite step, e.g. each fp16 overflow)"
        )
    thresholds = _skip_rate_thresholds(skip_rate_thresholds)
    _grad_growth(grad_growth_factor, grad_growth_window)
    parse_selector(job_selector)
    s = job_selector
    nonfinite = _sel(M.NONFINITE_STEPS.name, s)
    skipped = _sel(M.SKIPPED_STEPS.name, s)
    steps = _sel(M.STEPS.name, s)
    scale = _sel(M.LOSS_SCALE.name, s)
    last = _sel(M.LAST_STEP_TIMESTAMP.name, s)
    divergence = _sel(M.RANK_DIVERGENCE.name, s)
    poisoned = _sel(M.ANOMALIES.name, ", ".join(x for x in (s.strip().rstrip(","), 'kind="nonfinite_params"') if x))
    fp8_bad, fp8_under = _sel(M.FP8_NONFINITE.name, s), _sel(M.FP8_UNDERFLOW.name, s)
    under_now = f"max by (job, module, role) (avg_over_time({fp8_under}[10m]))"
    under_before = f"max by (job, module, role) (avg_over_time({fp8_under}[10m] offset 30m))"
    exporter_up = _sel(M.EXPORTER_UP.name, s)
    floor = _sel(M.LOSS_SCALE_FLOOR.name, s)
    module_norm = _sel(M.MODULE_GRAD_NORM.name, s)
    with_precision = f"* on ({', '.join(_RANK_SERIES)}) group_left (precision) {_sel(M.RUN_INFO.name, s)}"
    window, factor = grad_growth_window, grad_growth_factor
    recording = [
        {
            "record": _REC_NONFINITE,
            "expr": f"max by (job) (sum without (kind) (increase({nonfinite}[5m])))",
        },
        {
            "record": _REC_SKIP_RATIO,
            "expr": f"max by (job) (sum without (reason) (rate({skipped}[5m]))) / max by (job) (rate({steps}[5m]) > 0)",
        },
        {"record": _REC_STEPS_RATE, "expr": f"max by (job) (rate({steps}[5m]))"},
        {"record": _REC_SCALE_MIN, "expr": f"min by (job) ({scale})"},
        {"record": _REC_SCALE_MAX, "expr": f"max by (job) ({scale})"},
        {
            # every rank of a run reports the same global counts: max over ranks, as above; the
            # precision comes from each rank's run-info series
            "record": _REC_SKIP_RATE_PRECISION,
            "expr": f"max by (job, precision) (sum without (reason) (rate({skipped}[5m])) {with_precision})"
            f" / max by (job, precision) ((rate({steps}[5m]) > 0) {with_precision})",
        },
    ]
    fors = dict(fors or {})

    def alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
        rule: dict[str, Any] = {"alert": name, "expr": expr}
        rule["for"] = fors.pop(name, for_)
        rule["labels"] = {"severity": severity}
        rule["annotations"] = {"summary": summary, "description": description}
        return rule

    alerts = [
        alert(
            "AmpguardNonFiniteBurst",
            f"{_REC_NONFINITE} > {burst_threshold}",
            "0s",
            "critical",
            "NaN/inf burst in training job {{ $labels.job }}",
            f"{{{{ $value | printf \"%.0f\" }}}} steps saw non-finite loss or gradients in the last 5 minutes "
            f"(threshold {burst_threshold}). Open the ampguard event log (JsonlExporter) for the first anomaly.",
        ),
        alert(
            "AmpguardLossScaleCollapse",
            f"{scale} < 1",
            "5m",
            "warning",
            "Loss scale below 1 on {{ $labels.job }} rank {{ $labels.rank }}",
            "The fp16 loss scale has stayed below 1 ({{ $value }}) for 5 minutes: gradients overflow even "
            "unscaled. The model likely needs bf16/fp32 for some layers or a fix.",
        ),
        alert(
            "AmpguardRankLossScaleMismatch",
            f"{_REC_SCALE_MAX} - {_REC_SCALE_MIN} > 0",
            "5m",
            "critical",
            "Ranks of {{ $labels.job }} disagree on the loss scale",
            "max - min of the loss scale across ranks has been {{ $value }} for 5 minutes: ranks are no longer "
            "taking the same decisions (diverged state or a rank restarted alone).",
        ),
        alert(
            "AmpguardHighSkipRatio",
            f"{_REC_SKIP_RATIO} > 0.1",
            "10m",
            "warning",
            "{{ $labels.job }} skips more than 10% of its steps",
            "{{ $value | humanizePercentage }} of the steps of the last 5 minutes were skipped (non-finite values "
            "or spikes): the run is making little progress.",
        ),
        alert(
            "AmpguardTrainingStalled",
            f"time() - max by (job, rank) ({last} > 0) > 600",
            "5m",
            "warning",
            "{{ $labels.job }} rank {{ $labels.rank }} has not stepped for 10 minutes",
            "The last step was {{ $value | humanizeDuration }} ago while the endpoint is still scraped: a hang "
            "(collective deadlock, data loader, I/O).",
        ),
        alert(
            "AmpguardRankDivergence",
            f"max by (job) (increase({divergence}[10m])) > 0",
            "0s",
            "critical",
            "Ranks of {{ $labels.job }} diverged",
            "ampguard's consistency check found ranks disagreeing on step count, skip count, loss scale or "
            "parameters ({{ $value }} failed checks in 10 minutes).",
        ),
        alert(
            "AmpguardExporterDown",
            f"min by (job, rank, exporter) ({exporter_up}) == 0",
            "5m",
            "warning",
            "ampguard exporter {{ $labels.exporter }} down on {{ $labels.job }} rank {{ $labels.rank }}",
            "The exporter's calls have failed for 5 minutes (its errors counter tells how often). ampguard retries "
            "it with backoff and holds the last steps for it; meanwhile its records (e.g. the JSONL event log) are "
            "missing. Check disk space, permissions or the TensorBoard directory of that rank.",
        ),
        alert(
            "AmpguardSkipRate",
            " or ".join(f'{_REC_SKIP_RATE_PRECISION}{{precision="{p}"}} > {t!r}' for p, t in thresholds.items()),
            "10m",
            "warning",
            "{{ $labels.job }} ({{ $labels.precision }}) keeps skipping steps",
            "{{ $value | humanizePercentage }} of the steps of the last 5 minutes were skipped, above the "
            "{{ $labels.precision }} threshold (" + ", ".join(f"{p} {t * 100:g}%" for p, t in thresholds.items())
            + ") for 10 minutes. bf16 and fp32 have no loss scale to back off: each skip is a NaN/inf (or spike) "
            "ampguard kept out of the weights, and they keep coming. Open the ampguard event log for the first one.",
        ),
        alert(
            "AmpguardLossScaleAtFloor",
            f"max by (job) ({scale} <= {floor})",
            "10m",
            "warning",
            "fp16 loss scale of {{ $labels.job }} sits at its floor",
            "The loss scale has stayed at its floor GuardConfig.min_scale ({{ $value }}) for 10 minutes: overflows "
            "back it off as soon as it grows, and gradients get the least protection from fp16 underflow. The "
            "model likely needs bf16/fp32 for some layers, a lower learning rate or a fix.",
        ),
        alert(
            "AmpguardModuleGradNormGrowth",
            f"quantile_over_time(0.5, {module_norm}[{window}])"
            f" / (quantile_over_time(0.5, {module_norm}[{window}] offset {window}) > 0) > {factor!r}",
            "5m",
            "warning",
            "Gradient norm of module {{ $labels.module }} is growing on {{ $labels.job }} rank {{ $labels.rank }}",
            f"The median gradient norm of module {{{{ $labels.module }}}} on rank {{{{ $labels.rank }}}} over the "
            f"last {window} is {{{{ $value | printf \"%.1f\" }}}} times its median over the {window} before "
            f"(threshold {factor:g}x): a leading sign of divergence or of coming overflows. The per-module norms "
            "(sampled every GuardConfig.indicators_every steps) show where it started.",
        ),
        alert(
            "AmpguardNonFiniteParams",
            f"max by (job) (increase({poisoned}[10m])) > 0",
            "0s",
            "critical",
            "Non-finite weights in {{ $labels.job }}",
            "ampguard's parameter check (GuardConfig.param_check_every) found NaN/Inf weights after an update from "
            "finite gradients ({{ $value }} times in 10 minutes): the ladder rolled back, or training stopped. Do not "
            "resume from a checkpoint written after it; the anomaly names the parameters (docs/integrity.md).",
        ),
        alert(
            "AmpguardFp8NonFiniteAmax",
            f"max by (job, module, role) (increase({fp8_bad}[5m])) > 0",
            "0s",
            "critical",
            "Non-finite fp8 cast in {{ $labels.module }} ({{ $labels.role }}) on {{ $labels.job }}",
            "A torchao float8 cast of {{ $labels.module }}, role {{ $labels.role }}, had a NaN/Inf amax or a "
            "scale of 0/NaN ({{ $value }} times in 5 minutes): one bad element poisons the whole cast tensor "
            "(docs/fp8.md).",
        ),
        alert(
            "AmpguardFp8UnderflowRising",
            f"{under_now} > {FP8_UNDERFLOW_THRESHOLD!r} and {under_now} > 2 * {under_before}",
            "10m",
            "warning",
            "fp8 underflow rising in {{ $labels.module }} ({{ $labels.role }}) on {{ $labels.job }}",
            "The fraction of {{ $labels.module }}'s {{ $labels.role }} elements flushed to zero by its fp8 cast "
            "averaged {{ $value | humanizePercentage }} over 10 minutes, more than "
            f"{FP8_UNDERFLOW_THRESHOLD:.0%} and twice its level 30 minutes before: consider rowwise scaling, or "
            "keeping that layer in bf16 (docs/fp8.md).",
        ),
    ]
    if fors:
        raise ValueError(f"fors names unknown alerts {sorted(fors)}; known: {', '.join(ALERTS)}")
    groups = [
        {"name": "ampguard.recording", "rules": recording},
        {"name": "ampguard.alerts", "rules": alerts},
    ]
    if interval is not None:
        for g in groups:
            g["interval"] = interval
    return {"groups": groups}


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as exc:
        raise BackendUnavailableError(
            "rendering the Prometheus rules needs PyYAML: pip install 'ampguard[cli]' (or pyyaml)"
        ) from exc
    return yaml


def render_rules(**kwargs: Any) -> str:
    header = "# Generated by ampguard.dashboards (python -m ampguard.dashboards); do not edit.\n"
    return header + _yaml().safe_dump(build_rules(**kwargs), sort_keys=False, width=110)

