"""The Grafana dashboard, Prometheus recording/alert rules and promtool rule tests, built from
:mod:`ampguard.metrics` (metric names are never spelled here: every one comes from the catalogue).

``write_all(out_dir)`` writes ``ampguard.json``, ``ampguard.rules.yml`` and
``ampguard.rules.test.yml``; the checked-in copies in ``dashboards/`` are its output with
the defaults (a test checks they are equal).

What a "run" is for the rules: the Prometheus ``job`` (one scrape job per training run, as
in the README examples). Every rank reports the same global decision, so run-level numbers
take the ``max`` over ranks rather than the sum.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import metrics as M
from .errors import BackendUnavailableError

__all__ = [
    "ALERTS",
    "DEFAULT_BURST_THRESHOLD",
    "DEFAULT_GRAD_GROWTH_FACTOR",
    "DEFAULT_GRAD_GROWTH_WINDOW",
    "DEFAULT_SKIP_RATE_THRESHOLDS",
    "MIN_BURST_THRESHOLD",
    "Matcher",
    "build_dashboard",
    "build_rule_tests",
    "build_rules",
    "dashboard_queries",
    "parse_selector",
    "render_dashboard",
    "render_rule_tests",
    "render_rules",
    "write_all",
]

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
#: The rule tests' job label when neither ``test_job`` nor a ``job="..."`` matcher names one.
DEFAULT_TEST_JOB = "train"
DASHBOARD_UID = "ampguard-numerics"
RULES_FILE = "ampguard.rules.yml"
RULES_TEST_FILE = "ampguard.rules.test.yml"
DASHBOARD_FILE = "ampguard.json"

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


# ---------------------------------------------------------------------------------- selectors
@dataclasses.dataclass(frozen=True)
class Matcher:
    """One PromQL label matcher of a job selector: ``name op "value"``."""

    name: str
    op: str
    """``=``, ``!=``, ``=~`` or ``!~``."""
    value: str
    """The string's value (escapes resolved)."""

    def matches(self, value: str) -> bool:
        """Does a series whose label ``name`` is ``value`` ("" where it has none) match? Regular
        expressions are fully anchored, as in Prometheus (Python's ``re`` stands in for RE2)."""
        if self.op in ("=", "!="):
            return (value == self.value) == (self.op == "=")
        return (re.fullmatch(self.value, value) is not None) == (self.op == "=~")

    def __str__(self) -> str:
        return f"{self.name}{self.op}{json.dumps(self.value)}"


_TOKEN = re.compile(r"""\s*(?:
    (?P<name>[A-Za-z_][A-Za-z0-9_]*|"(?:[^"\\]|\\.)*")\s*(?P<op>=~|!~|!=|=)\s*
    (?P<value>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)\s*
    (?P<sep>,|$))""", re.VERBOSE)
_ESCAPE = re.compile(r"\\(?:([abfnrtv\\'\"])|x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|([0-7]{3})|(.))",
                     re.DOTALL)
_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}


def _unquote(token: str) -> str:
    """A PromQL string literal's value: Go's escapes in "..." and '...', none in `...`."""
    if token[0] == "`":
        return token[1:-1]

    def escape(m: re.Match[str]) -> str:
        simple, hex2, hex4, hex8, octal, bad = m.groups()
        if bad is not None:
            raise ValueError(f"unknown escape sequence \\{bad} in {token}")
        if simple is not None:
            return _SIMPLE_ESCAPES.get(simple, simple)
        return chr(int(hex2 or hex4 or hex8, 16) if octal is None else int(octal, 8))

    return _ESCAPE.sub(escape, token[1:-1])


def parse_selector(selector: str) -> tuple[Matcher, ...]:
    """The label matchers of a job selector, the inside of a PromQL ``{...}``: ``name op "value"``
    separated by commas, e.g. ``'job=~"llm-.*", cluster="a"'`` ("" or blanks: none). Raises
    ``ValueError`` saying what is wrong and where, with an example of the syntax."""
    if not isinstance(selector, str):
        raise ValueError(f"job_selector={selector!r}; allowed: a string of PromQL label matchers")
    matchers: list[Matcher] = []
    pos = 0
    while selector[pos:].strip():
        m = _TOKEN.match(selector, pos)
        if m is None:
            braces = " (without the braces)" if selector.strip().startswith("{") else ""
            raise ValueError(
                f"job_selector {selector!r} is not a list of PromQL label matchers{braces} (at {selector[pos:]!r}); "
                'allowed: name op "value", ... with op one of = != =~ !~, e.g. \'job=~"llm-.*"\' or \'job="llm"\''
            )
        name = m["name"]
        try:
            matcher = Matcher(_unquote(name) if name[0] == '"' else name, m["op"], _unquote(m["value"]))
        except ValueError as exc:
            raise ValueError(f"job_selector {selector!r}: {exc}") from None
        if matcher.op in ("=~", "!~"):
            try:
                re.compile(matcher.value)
            except re.error as exc:
                raise ValueError(f"job_selector {selector!r}: {matcher} is not a valid regular expression ({exc})"
                                 ) from None
        matchers.append(matcher)
        pos = m.end()
        if m["sep"] == "":
            break
    return tuple(matchers)


def _test_job(selector: str, test_job: str | None) -> str:
    """The job label of the rule tests' series: ``test_job``, else the value of the selector's
    ``job="..."`` matcher, else "train". Checked: the rule tests' synthetic series (labels
    job, instance, rank, local_rank) must match every matcher of the selector, or the generated
    tests would fail under promtool."""
    matchers = parse_selector(selector)
    if test_job is None:
        test_job = next((m.value for m in matchers if m.name == "job" and m.op == "="), DEFAULT_TEST_JOB)
    ranks = [_rank_labels(test_job, r) for r in (0, 1)]
    labels = ranks[0]
    for matcher in matchers:
        if all(matcher.matches(rank.get(matcher.name, "")) for rank in ranks):
            continue
        if matcher.name == "job":
            raise ValueError(f"test_job={test_job!r} (--test-job) does not match {matcher} of job_selector "
                             f"{selector!r}: the rule tests' series would not reach the rules; pass a job name the "
                             "selector matches")
        raise ValueError(f"job_selector {selector!r}: {matcher} does not match the rule tests' series, which carry "
                         f"only the labels {', '.join(labels)}; select on those (e.g. job) so the generated tests "
                         "can exercise the rules")
    return test_job


def _rank_labels(job: str, rank: int) -> dict[str, str]:
    """The labels of rank ``rank``'s series in the rule tests."""
    return {"job": job, "instance": f"node0:{9400 + rank}", "rank": str(rank), "local_rank": str(rank)}


def _sel(metric: str, selector: str) -> str:
    return f"{metric}{{{selector}}}" if selector else metric


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


# ---------------------------------------------------------------------------------- rules
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


# ---------------------------------------------------------------------------------- rule tests
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


# ---------------------------------------------------------------------------------- dashboard
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


def build_dashboard() -> dict[str, Any]:
    """The Grafana dashboard (classic JSON model, schemaVersion 39)."""
    rate = "$__rate_interval"
    skipped, nonfinite, steps = M.SKIPPED_STEPS, M.NONFINITE_STEPS, M.STEPS
    scale, last = M.LOSS_SCALE, M.LAST_STEP_TIMESTAMP
    stat_opts = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "value"}
    red_above = lambda v: {  # noqa: E731 - tiny local helper
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "red", "value": v}]}
    }
    panels: list[dict[str, Any]] = [
        _panel(1, "row", "Health", "Run-level numbers; every rank holds the same global decision.", "none", [],
               (0, 0, 24, 1), collapsed=False),
        _panel(
            2, "stat", "Non-finite steps", "Steps that saw NaN/inf loss or gradients since the run started "
            "(max over ranks: every rank counts the same global steps).", "short",
            [_target(f"max(sum without (kind) ({_q(nonfinite)}))", "non-finite steps")],
            (0, 1, 5, 4), options=stat_opts, defaults=red_above(1),
        ),
        _panel(
            3, "stat", "Skip ratio", "Fraction of steps skipped (non-finite values or spikes) over the rate "
            "interval.", "percentunit",
            [_target(f"max(sum without (reason) (rate({_q(skipped)}[{rate}])))\n  / max(rate({_q(steps)}[{rate}]))",
                     "skip ratio")],
            (5, 1, 5, 4), options=stat_opts, defaults=red_above(0.1),
        ),
        _panel(
            4, "stat", "Lowest loss scale", "Smallest loss scale that multiplied the last step's loss, across "
            "the selected ranks (fp16; 1 for bf16/fp32). Below 1 means gradients overflow even unscaled.", "short",
            [_target(f"min({_q(scale)})", "lowest loss scale")],
            (10, 1, 5, 4), options=stat_opts,
        ),
        _panel(
            5, "stat", "Seconds since last step", "Time since the most recent step of any selected rank; grows "
            "when training hangs.", "s",
            [_target(f"time() - max({_q(last)} > 0)", "since last step")],
            (15, 1, 5, 4), options=stat_opts, defaults=red_above(600),
        ),
        _panel(
            6, "stat", "Ranks up", "Metric endpoints of the job that Prometheus scraped successfully.", "short",
            [_target(f"sum(up{{{_JOB}}})", "ranks up")],
            (20, 1, 4, 4), options=stat_opts,
        ),
        _panel(
            7, "timeseries", "Loss scale per rank", "fp16 loss scale that multiplied each rank's last step (log2 "
            "axis). Ranks must agree: a rank apart from the others has diverged.", "short",
            [_target(_q(scale), "rank {{rank}}")],
            (0, 5, 12, 8), defaults={"custom": {"scaleDistribution": {"type": "log", "log": 2}}},
        ),
        _panel(
            8, "timeseries", "Skipped steps per rank", "Skipped steps per second, by rank and reason.", "cps",
            [_target(f"sum by (rank, reason) (rate({_q(skipped)}[{rate}]))", "rank {{rank}} {{reason}}")],
            (12, 5, 12, 8),
        ),
        _panel(
            9, "timeseries", "Non-finite steps per rank", "Steps per second that saw NaN/inf, by rank and kind "
            "(loss or grad).", "cps",
            [_target(f"sum by (rank, kind) (rate({_q(nonfinite)}[{rate}]))", "rank {{rank}} {{kind}}")],
            (0, 13, 12, 8),
        ),
        _panel(
            10, "timeseries", "Non-finite origin per rank", "Non-finite steps per second whose NaN/inf started on "
            "that rank: the one bad rank stands out.", "cps",
            [_target(f"sum by (rank) (rate({_q(M.NONFINITE_ORIGIN)}[{rate}]))", "rank {{rank}}")],
            (12, 13, 12, 8),
        ),
        _panel(
            11, "heatmap", "Gradient norm distribution", "Finite global gradient norms per time bucket (histogram "
            "buckets; non-finite norms are not observed).", "short",
            [_target(f"sum by (le) (increase({_q(M.GRAD_NORM_HISTOGRAM, '_bucket')}[{rate}]))", "{{le}}",
                     format="heatmap")],
            (0, 21, 12, 8),
            options={"calculate": False, "yAxis": {"unit": "short"}, "cellValues": {"unit": "short"}},
        ),
        _panel(
            12, "timeseries", "Gradient norm (last step)", "Global L2 norm of the unscaled gradients at the last "
            "step of each rank (gaps: NaN/inf).", "short",
            [_target(_q(M.GRAD_NORM), "rank {{rank}}")],
            (12, 21, 12, 8), defaults={"custom": {"scaleDistribution": {"type": "log", "log": 10}}},
        ),
        _panel(
            13, "timeseries", "Loss", "Loss of the last step of each rank (gaps: NaN/inf).", "short",
            [_target(_q(M.LOSS), "rank {{rank}}")],
            (0, 29, 12, 8),
        ),
        _panel(
            14, "timeseries", "Loss-scale changes", "Loss-scale backoffs and growths per second.", "cps",
            [
                _target(f"sum by (rank) (rate({_q(M.SCALE_BACKOFFS)}[{rate}]))", "rank {{rank}} backoff", "A"),
                _target(f"sum by (rank) (rate({_q(M.SCALE_GROWTHS)}[{rate}]))", "rank {{rank}} growth", "B"),
            ],
            (12, 29, 12, 8),
        ),
        _panel(
            16, "timeseries", "Device memory peak per rank", "Peak CUDA memory, allocated and reserved by the "
            "caching allocator: its high-water mark, read by the exporter (empty for CPU runs). Half of why one "
            "trains in mixed precision.",
            "bytes",
            [_target(f"max by (rank, kind) ({_q(M.DEVICE_MEMORY_PEAK)})", "rank {{rank}} {{kind}}")],
            (0, 37, 12, 8),
        ),
        _panel(
            17, "timeseries", "Transient faults per rank", "Non-finite steps a replay did not reproduce, by the "
            "rank they started on: repeated ones on one rank point at bad hardware.", "short",
            [_target(f"sum by (rank) (increase({_q(M.TRANSIENT_FAULTS)}[{rate}]))", "rank {{rank}}")],
            (12, 37, 12, 8),
        ),
        _panel(
            18, "timeseries", "Exporters", "Per rank and exporter: up (1 while it works, 0 from a failed call until "
            "a retry works; ampguard retries with backoff and holds the last steps for it) and its failed calls "
            "per interval. A JSONL exporter down means a gap in the event log until it recovers.", "short",
            [
                _target(f"min by (rank, exporter) ({_q(M.EXPORTER_UP)})", "rank {{rank}} {{exporter}} up", "A"),
                _target(f"sum by (rank, exporter) (increase({_q(M.EXPORTER_ERRORS)}[{rate}]))",
                        "rank {{rank}} {{exporter}} errors", "B"),
            ],
            (0, 53, 24, 8),
        ),
        _panel(
            15, "table", "Per-rank summary", "One row per rank: steps, skipped, non-finite origin, loss scale, "
            "consistency failures. The bad rank is the odd one out.", "short",
            [
                _target(f"max by (rank) ({_q(steps)})", "", "A", instant=True, format="table"),
                _target(f"sum by (rank) ({_q(skipped)})", "", "B", instant=True, format="table"),
                _target(f"sum by (rank) ({_q(M.NONFINITE_ORIGIN)})", "", "C", instant=True, format="table"),
                _target(f"max by (rank) ({_q(scale)})", "", "D", instant=True, format="table"),
                _target(f"sum by (rank) ({_q(M.RANK_DIVERGENCE)})", "", "E", instant=True, format="table"),
            ],
            (0, 45, 24, 8),
            transformations=[
                {"id": "merge", "options": {}},
                {
                    "id": "organize",
                    "options": {
                        "excludeByName": {"Time": True},
                        "renameByName": {
                            "Value #A": "steps",
                            "Value #B": "skipped",
                            "Value #C": "non-finite origin",
                            "Value #D": "loss scale",
                            "Value #E": "divergence",
                        },
                    },
                },
            ],
        ),
    ]
    for row in (_precision_panels, _numerics_panels, _indicator_panels):  # the numerics rows, each below the last
        panels += row(*_below(panels))
    annotations = [
        {
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        },
        {
            "datasource": _DS,
            "enable": True,
            "iconColor": "orange",
            "name": "Skipped steps",
            "expr": f"sum by (rank, reason) (increase({_q(skipped)}[{rate}])) > 0",
            "step": "15s",
            "titleFormat": "skipped steps",
            "textFormat": "rank {{rank}}: {{reason}}",
            "tagKeys": "rank,reason",
        },
        {
            "datasource": _DS,
            "enable": True,
            "iconColor": "red",
            "name": "Firing alerts",
            "expr": f'ALERTS{{alertname=~"Ampguard.*", alertstate="firing", {_JOB}}}',
            "step": "15s",
            "titleFormat": "{{alertname}}",
            "textFormat": "{{job}} {{rank}}",
            "tagKeys": "alertname,severity",
        },
    ]
    templating = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
            "regex": "",
        },
        {
            "name": "job",
            "label": "Job",
            "type": "query",
            "datasource": _DS,
            "query": {"query": f"label_values({M.STEPS.name}, job)", "refId": "job"},
            "definition": f"label_values({M.STEPS.name}, job)",
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "current": {},
            "sort": 1,
        },
        {
            "name": "rank",
            "label": "Rank",
            "type": "query",
            "datasource": _DS,
            "query": {"query": f'label_values({M.STEPS.name}{{{_JOB}}}, rank)', "refId": "rank"},
            "definition": f'label_values({M.STEPS.name}{{{_JOB}}}, rank)',
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "current": {},
            "sort": 3,
        },
        {
            "name": "group",
            "label": "Param group",
            "type": "query",
            "datasource": _DS,
            "query": {"query": f'label_values({M.GRAD_ZERO_FRACTION.name}{{{_JOB}}}, group)', "refId": "group"},
            "definition": f'label_values({M.GRAD_ZERO_FRACTION.name}{{{_JOB}}}, group)',
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "current": {},
            "sort": 1,
        },
    ]
    return {
        "__inputs": [],
        "uid": DASHBOARD_UID,
        "title": "ampguard: training numerics",
        "description": "Loss scale, non-finite values, skipped steps and gradient norms per rank, from ampguard's "
        "PrometheusExporter.",
        "tags": ["ampguard", "training", "pytorch"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "annotations": {"list": annotations},
        "templating": {"list": templating},
        "panels": panels,
        "links": [],
    }


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


def dashboard_queries(dashboard: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target of every panel."""
    d = dashboard if dashboard is not None else build_dashboard()
    return [(p["title"], t["expr"]) for p in d["panels"] for t in p.get("targets", [])]


def render_dashboard() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=False) + "\n"


# ---------------------------------------------------------------------------------- files
def write_all(
    out_dir: str | os.PathLike[str] = "dashboards",
    job_selector: str = "",
    burst_threshold: int = DEFAULT_BURST_THRESHOLD,
    test_job: str | None = None,
    *,
    skip_rate_thresholds: Mapping[str, float] | None = None,
    grad_growth_factor: float = DEFAULT_GRAD_GROWTH_FACTOR,
    grad_growth_window: str = DEFAULT_GRAD_GROWTH_WINDOW,
) -> list[Path]:
    """Write the dashboard, the rules and their promtool tests into ``out_dir``; return the paths.

    ``job_selector`` (PromQL label matchers, e.g. ``'job=~"llm-.*"'``; checked by
    :func:`parse_selector`) restricts every rule to matching series; ``burst_threshold`` is
    AmpguardNonFiniteBurst's threshold; ``test_job`` is the job label of the rule tests' synthetic
    series (it must match ``job_selector``; None: see :func:`build_rule_tests`); the other options
    are :func:`build_rules`'s. Every file is rendered, and every option checked (``ValueError``),
    before anything is written."""
    options: dict[str, Any] = {
        "job_selector": job_selector, "burst_threshold": burst_threshold, "skip_rate_thresholds": skip_rate_thresholds,
        "grad_growth_factor": grad_growth_factor, "grad_growth_window": grad_growth_window,
    }
    files = {
        DASHBOARD_FILE: render_dashboard(),
        RULES_FILE: render_rules(**options),
        RULES_TEST_FILE: render_rule_tests(test_job=test_job, **options),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


if __name__ == "__main__":  # python -m ampguard.dashboards [out_dir]
    import sys

    for p in write_all(sys.argv[1] if len(sys.argv) > 1 else "dashboards"):
        print(p)
