"""promtool unit tests of the rules: every alert fires when it should and stays silent on a healthy run."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from .. import metrics as M
from .rules import (
    _REC_SKIP_RATE_PRECISION,
    ALERTS,
    DEFAULT_BURST_THRESHOLD,
    DEFAULT_GRAD_GROWTH_FACTOR,
    DEFAULT_GRAD_GROWTH_WINDOW,
    RULES_FILE,
    _grad_growth,
    _skip_rate_thresholds,
    _yaml,
    build_rules,
)
from .selectors import _rank_labels, _test_job

RULES_TEST_FILE = "ampguard.rules.test.yml"


def _series(metric: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{metric}{{{inner}}}", "values": values}


def _render(text: str, labels: dict[str, str], value: str) -> str:
    """Render an annotation template the way Prometheus does, for the values a test knows."""
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)
    return re.sub(r"\{\{ \$value[^}]*\}\}", value, text)


def _expected(
    rules: dict[str, Any], alert: str, labels: dict[str, str], value: str
) -> dict[str, Any]:
    rule = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == alert)
    return {
        "exp_labels": {**rule["labels"], **labels},
        "exp_annotations": {k: _render(v, labels, value) for k, v in rule["annotations"].items()},
    }


def build_rule_tests(
    *,
    burst_threshold: int = DEFAULT_BURST_THRESHOLD,
    job_selector: str = "",
    test_job: str | None = None,
    rules_file: str = RULES_FILE,
    skip_rate_thresholds: Mapping[str, float] | None = None,
    grad_growth_factor: float = DEFAULT_GRAD_GROWTH_FACTOR,
    grad_growth_window: str = DEFAULT_GRAD_GROWTH_WINDOW,
) -> dict[str, Any]:
    """promtool unit tests: every alert fires when it should and stays silent on a healthy run.

    The synthetic series carry ``job=test_job`` (None: the selector's ``job="..."`` value, else
    "train"); a ``test_job`` the ``job_selector`` does not match raises ``ValueError``.
    The rule options are :func:`build_rules`'s: the tests are for the rules built with them."""
    rules = build_rules(burst_threshold=burst_threshold, job_selector=job_selector,
                        skip_rate_thresholds=skip_rate_thresholds, grad_growth_factor=grad_growth_factor,
                        grad_growth_window=grad_growth_window)
    thresholds = _skip_rate_thresholds(skip_rate_thresholds)
    window = _grad_growth(grad_growth_factor, grad_growth_window)
    job = _test_job(job_selector, test_job)
    r0, r1 = _rank_labels(job, 0), _rank_labels(job, 1)
    burst = burst_threshold + 5

    def healthy(labels: dict[str, str], minutes: int, precision: str = "fp16") -> list[dict[str, str]]:
        # 60 steps a minute, scrape every minute, nothing bad.
        n = minutes
        fp16 = precision == "fp16"
        out = [
            _series(M.STEPS.name, labels, f"0+60x{n}"),
            _series(M.LOSS_SCALE.name, labels, f"{65536 if fp16 else 1}x{n}"),
            _series(M.LOSS_SCALE_FLOOR.name, labels, f"1x{n}" if fp16 else " ".join(["NaN"] * (n + 1))),
            _series(M.RUN_INFO.name, {**labels, "run_id": "r1", "precision": precision}, f"1x{n}"),
            _series(M.LAST_STEP_TIMESTAMP.name, labels, f"60+60x{n}"),
            _series(M.RANK_DIVERGENCE.name, labels, f"0x{n}"),
        ]
        for exporter in ("JsonlExporter", "PrometheusExporter"):
            out.append(_series(M.EXPORTER_UP.name, {**labels, "exporter": exporter}, f"1x{n}"))
            out.append(_series(M.EXPORTER_ERRORS.name, {**labels, "exporter": exporter}, f"0x{n}"))
        for kind in M.NONFINITE_KINDS:
            out.append(_series(M.NONFINITE_STEPS.name, {**labels, "kind": kind}, f"0x{n}"))
        for reason in M.SKIPPED_STEPS.label_values[0]:
            out.append(_series(M.SKIPPED_STEPS.name, {**labels, "reason": reason}, f"0x{n}"))
        for module in ("encoder", "decoder"):
            out.append(_series(M.MODULE_GRAD_NORM.name, {**labels, "module": module}, f"0.5x{n}"))
        return out

    def silent(minutes: int) -> list[dict[str, Any]]:
        return [quiet(minutes, a) for a in ALERTS]

    def replace(series: list[dict[str, str]], metric: str, labels: dict[str, str], values: str) -> None:
        wanted = _series(metric, labels, "")["series"]
        for s in series:
            if s["series"] == wanted:
                s["values"] = values
                return
        series.append(_series(metric, labels, values))

    tests: list[dict[str, Any]] = []

    def case(series: list[dict[str, str]], *checks: dict[str, Any], exprs: tuple[dict[str, Any], ...] = ()) -> None:
        tests.append({"interval": "1m", "input_series": series, "alert_rule_test": list(checks)})
        if exprs:
            tests[-1]["promql_expr_test"] = list(exprs)

    def skips_per_600(minute: int, labels: dict[str, str], skips: int) -> dict[str, Any]:
        # the skip-rate recording rule, as skips per 600 steps (rounded: promtool compares exactly)
        return {"expr": f"round({_REC_SKIP_RATE_PRECISION} * 600)", "eval_time": f"{minute}m",
                "exp_samples": [{"labels": _series("", labels, "")["series"], "value": skips}]}

    def quiet(minute: int, alert: str) -> dict[str, Any]:
        return {"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": []}

    def fires(minute: int, alert: str, labels: dict[str, str], value: str) -> dict[str, Any]:
        return {"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": [_expected(rules, alert, labels, value)]}

    # 1. a healthy two-rank run: every alert silent
    case(healthy(r0, 30) + healthy(r1, 30), *silent(30),
         exprs=(skips_per_600(30, {"job": job, "precision": "fp16"}, 0),))

    # 2. a NaN burst on both ranks (every rank reports the global count)
    s = healthy(r0, 20) + healthy(r1, 20)
    for r in (r0, r1):
        replace(s, M.NONFINITE_STEPS.name, {**r, "kind": "loss"}, f"0x10 {burst}x10")
        replace(s, M.SKIPPED_STEPS.name, {**r, "reason": "nonfinite_loss"}, f"0x10 {burst}x10")
    case(s, quiet(9, "AmpguardNonFiniteBurst"), fires(12, "AmpguardNonFiniteBurst", {"job": job}, str(burst)),
         quiet(19, "AmpguardNonFiniteBurst"))
    # below the threshold: silent
    s = healthy(r0, 20)
    replace(s, M.NONFINITE_STEPS.name, {**r0, "kind": "grad"}, f"0x10 {burst_threshold // 2}x10")
    case(s, quiet(12, "AmpguardNonFiniteBurst"))

    # 3. the loss scale collapses below 1 on rank 1 (and so differs between ranks)
    s = healthy(r0, 30) + healthy(r1, 30)
    replace(s, M.LOSS_SCALE.name, r1, "65536x10 0.5x20")
    case(s, quiet(13, "AmpguardLossScaleCollapse"), fires(20, "AmpguardLossScaleCollapse", r1, "0.5"),
         quiet(13, "AmpguardRankLossScaleMismatch"),
         fires(20, "AmpguardRankLossScaleMismatch", {"job": job}, "65535.5"))

    # 4. half the steps skipped for 20 minutes
    s = healthy(r0, 40)
    replace(s, M.SKIPPED_STEPS.name, {**r0, "reason": "nonfinite_grad"}, "0x10 0+30x30")
    case(s, quiet(10, "AmpguardHighSkipRatio"), fires(30, "AmpguardHighSkipRatio", {"job": job}, "50%"))

    # 5. rank 0 stops stepping at minute 5 (its endpoint is still scraped)
    s = healthy(r0, 30)
    replace(s, M.STEPS.name, r0, "0+60x5 300x25")
    replace(s, M.LAST_STEP_TIMESTAMP.name, r0, "60+60x5 360x25")
    case(s, quiet(14, "AmpguardTrainingStalled"),
         fires(25, "AmpguardTrainingStalled", {"job": job, "rank": "0"}, "19m 0s"))
    # a run that has not stepped yet (timestamp 0) is not "stalled"
    s = healthy(r0, 30)
    replace(s, M.STEPS.name, r0, "0x30")
    replace(s, M.LAST_STEP_TIMESTAMP.name, r0, "0x30")
    case(s, quiet(30, "AmpguardTrainingStalled"))

    # 6. a failed consistency check
    s = healthy(r0, 20) + healthy(r1, 20)
    replace(s, M.RANK_DIVERGENCE.name, r1, "0x10 1x10")
    case(s, quiet(9, "AmpguardRankDivergence"), fires(12, "AmpguardRankDivergence", {"job": job}, "1"))

    # 6b. the parameter check found non-finite weights on rank 0 (an anomaly counted by kind)
    s = healthy(r0, 20)
    replace(s, M.ANOMALIES.name, {**r0, "kind": "nonfinite_params"}, "0x10 1x10")
    case(s, quiet(9, "AmpguardNonFiniteParams"), fires(12, "AmpguardNonFiniteParams", {"job": job}, "1"))

    # 6c. fp8: a non-finite cast in one module and role; then that role's underflow rising from 0.1% to 5%
    cast = {**r0, "module": "blocks.0.mlp.fc1", "role": "grad_output"}
    s = healthy(r0, 20)
    replace(s, M.FP8_NONFINITE.name, cast, "0x10 1x10")
    case(s, quiet(9, "AmpguardFp8NonFiniteAmax"),
         fires(12, "AmpguardFp8NonFiniteAmax", {"job": job, "module": cast["module"], "role": "grad_output"}, "1"))
    s = healthy(r0, 80)
    replace(s, M.FP8_UNDERFLOW.name, cast, "0.001x40 0.05x40")
    case(s, quiet(35, "AmpguardFp8UnderflowRising"),
         fires(70, "AmpguardFp8UnderflowRising", {"job": job, "module": cast["module"], "role": "grad_output"}, "5%"))

    # 7. rank 1's JSONL exporter fails from minute 5 (disk full) and works again at minute 20
    s = healthy(r0, 30) + healthy(r1, 30)
    down = {**r1, "exporter": "JsonlExporter"}
    replace(s, M.EXPORTER_UP.name, down, "1x5 0x15 1x10")
    replace(s, M.EXPORTER_ERRORS.name, down, "0x5 1+1x15 16x10")
    case(s, quiet(8, "AmpguardExporterDown"),
         fires(12, "AmpguardExporterDown", {"job": job, "rank": "1", "exporter": "JsonlExporter"}, "0"),
         quiet(25, "AmpguardExporterDown"))
    # a blip (one failed call, the retry works within the minute) is not "down"
    s = healthy(r0, 20)
    blip = {**r0, "exporter": "JsonlExporter"}
    replace(s, M.EXPORTER_UP.name, blip, "1x5 0 1x14")
    replace(s, M.EXPORTER_ERRORS.name, blip, "0x5 1x15")
    case(s, quiet(15, "AmpguardExporterDown"))

    # 8. skipping, per precision: 600 steps a minute, `per_minute` of them skipped from minute 10
    def skipping(precision: str, per_minute: int) -> list[dict[str, str]]:
        s = healthy(r0, 40, precision)
        replace(s, M.STEPS.name, r0, "0+600x40")
        replace(s, M.SKIPPED_STEPS.name, {**r0, "reason": "nonfinite_loss"}, f"0x10 0+{per_minute}x30")
        return s

    for precision, threshold in thresholds.items():
        labels = {"job": job, "precision": precision}
        above = min(math.floor(threshold * 600) + 1, 600)  # sustained, just above the threshold: fires
        case(skipping(precision, above), quiet(15, "AmpguardSkipRate"),
             fires(30, "AmpguardSkipRate", labels, f"{above / 6:.4g}%"),
             exprs=(skips_per_600(30, labels, above),))
        below = math.floor(threshold * 600 / 2)  # sustained, half the threshold (fp16's default: 0.5%): silent
        if below >= 1:
            case(skipping(precision, below), quiet(30, "AmpguardSkipRate"))
        # a burst of 20 skips in one minute, then none: not sustained, silent
        s = healthy(r0, 40, precision)
        replace(s, M.SKIPPED_STEPS.name, {**r0, "reason": "nonfinite_loss"}, "0x10 20x30")
        case(s, quiet(14, "AmpguardSkipRate"), quiet(30, "AmpguardSkipRate"))

    # 9. the fp16 loss scale backs off to its floor (1) on both ranks at minute 10 and stays there
    s = healthy(r0, 30) + healthy(r1, 30)
    for r in (r0, r1):
        replace(s, M.LOSS_SCALE.name, r, "65536x10 1x20")
    case(s, quiet(15, "AmpguardLossScaleAtFloor"), fires(25, "AmpguardLossScaleAtFloor", {"job": job}, "1"))
    # touching the floor for 3 minutes then growing again is not sitting there; a bf16 run's scale is 1
    # and it has no floor (NaN)
    s = healthy(r0, 30) + healthy(r1, 30, "bf16")
    replace(s, M.LOSS_SCALE.name, r0, "65536x10 1x3 2x17")
    case(s, quiet(25, "AmpguardLossScaleAtFloor"))

    # 10. rank 0's decoder gradient norm steps up to twice the factor at minute `window` and stays
    big = 2 * grad_growth_factor
    grown = 2 * window + 1
    s = healthy(r0, grown + 5) + healthy(r1, grown + 5)
    replace(s, M.MODULE_GRAD_NORM.name, {**r0, "module": "decoder"}, f"0.5x{window - 1} {big / 2!r}x{window + 5}")
    case(s, quiet(window, "AmpguardModuleGradNormGrowth"),
         fires(grown, "AmpguardModuleGradNormGrowth", {**r0, "module": "decoder"}, f"{big:.1f}"))
    # one noisy sample (say a sampling period) a hundred times the factor up; a module whose norm was 0
    # (frozen) and starts learning: silent
    s = healthy(r0, grown + 5)
    replace(s, M.MODULE_GRAD_NORM.name, {**r0, "module": "decoder"},
            f"0.5x{window - 1} {50 * grad_growth_factor!r} 0.5x{window + 5}")
    replace(s, M.MODULE_GRAD_NORM.name, {**r0, "module": "encoder"}, f"0x{window - 1} 0.5x{window + 5}")
    case(s, quiet(window + 5, "AmpguardModuleGradNormGrowth"), quiet(grown, "AmpguardModuleGradNormGrowth"))
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


def render_rule_tests(**kwargs: Any) -> str:
    header = "# Generated by ampguard.dashboards; run with: promtool test rules ampguard.rules.test.yml\n"
    return header + _yaml().safe_dump(build_rule_tests(**kwargs), sort_keys=False, width=200)

