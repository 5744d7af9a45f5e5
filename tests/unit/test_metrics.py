"""The metric catalogue follows Prometheus practice, and is the one place metric names live."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ampguard import metrics as M
from ampguard.records import ANOMALY_KINDS, SKIP_REASONS

PACKAGE = Path(M.__file__).resolve().parent
NAME = re.compile(r"^ampguard_[a-z][a-z0-9_]*$")
# Every series name a scrape can show, and the suffixes a metric name would have (identifiers
# such as ampguard_check or the run-info label ampguard_version are not metric names).
KNOWN = {n for m in M.CATALOGUE for n in (m.name, m.client_name)} | {
    M.GRAD_NORM_HISTOGRAM.name + s for s in ("_bucket", "_sum", "_count")}
SUFFIX = re.compile(r"_(total|seconds|bytes|info|bucket|count|sum|ratio|created|scale|norm|loss)$")


def test_names_types_and_help_follow_prometheus_practice():
    names = [m.name for m in M.CATALOGUE]
    assert len(names) == len(set(names))
    for m in M.CATALOGUE:
        assert NAME.match(m.name), m.name
        assert m.type in ("counter", "gauge", "histogram", "info"), m
        assert m.help and m.help.endswith(".") and "\n" not in m.help, m.name
        assert m.name.endswith("_total") == (m.type == "counter"), m.name
        assert m.name.endswith("_info") == (m.type == "info"), m.name
        assert not re.search(r"_(ms|milliseconds|bytes_total_total|percent)\b", m.name), m.name
        assert len(m.label_values) == len(m.labels), m.name
        assert not set(m.labels) & set(M.RANK_LABELS) and "job" not in m.labels and "instance" not in m.labels
        assert m.all_labels[-2:] == M.RANK_LABELS


def test_the_issue_table_is_covered():
    types = {m.name: m.type for m in M.CATALOGUE}
    for name, kind in {
        "ampguard_steps_total": "counter",
        "ampguard_skipped_steps_total": "counter",
        "ampguard_nonfinite_steps_total": "counter",
        "ampguard_loss_scale": "gauge",
        "ampguard_grad_norm": "gauge",
        "ampguard_loss": "gauge",
        "ampguard_last_step_timestamp_seconds": "gauge",
        "ampguard_scale_backoffs_total": "counter",
        "ampguard_scale_growths_total": "counter",
        "ampguard_rank_divergence_total": "counter",
        "ampguard_run_info": "info",
    }.items():
        assert types.get(name) == kind, name
    assert M.GRAD_NORM_HISTOGRAM.type == "histogram"
    assert M.SKIPPED_STEPS.label_values == (SKIP_REASONS,)
    assert M.NONFINITE_STEPS.label_values == (("grad", "loss"),)
    assert M.ANOMALIES.label_values == (ANOMALY_KINDS,)
    assert list(M.GRAD_NORM_BUCKETS) == sorted(M.GRAD_NORM_BUCKETS) and all(b > 0 for b in M.GRAD_NORM_BUCKETS)


def test_client_name_and_lookup():
    assert M.STEPS.client_name == "ampguard_steps"
    assert M.RUN_INFO.client_name == "ampguard_run"
    assert M.LOSS_SCALE.client_name == "ampguard_loss_scale"
    assert M.by_name("ampguard_grad_norm_finite_bucket") is M.GRAD_NORM_HISTOGRAM
    assert M.by_name("ampguard_steps_created") is M.STEPS
    with pytest.raises(KeyError, match="catalogue"):
        M.by_name("ampguard_nope")


def test_no_module_but_metrics_spells_a_metric_name():
    """Exporters, dashboards and rules take every metric name from ampguard.metrics."""
    spelled = re.compile(r"ampguard_[a-z0-9]+(?:_[a-z0-9]+)*")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "metrics.py" and path.parent == PACKAGE:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for hit in spelled.findall(line):
                if hit in KNOWN or SUFFIX.search(hit):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{lineno}: {hit}")
    assert not offenders, "metric names spelled outside ampguard/metrics.py:\n" + "\n".join(offenders)
