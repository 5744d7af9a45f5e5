"""OtelExporter against the real opentelemetry-sdk (an InMemoryMetricReader), and the OpenTelemetry
naming convention made from the metric catalogue."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import ampguard
from ampguard import metrics as M
from ampguard.errors import BackendUnavailableError
from ampguard.exporters import MultiExporter, OtelExporter
from ampguard.exporters.memory import MemoryPeaks
from ampguard.records import Fp8Cast, RunInfo, StepReport

from ._tracked_run import train

PACKAGE = Path(M.__file__).resolve().parent


def _points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    """Instrument name -> [(attributes, value)] (a histogram's value: its count and sum)."""
    out: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = [
                    (dict(p.attributes), (p.count, p.sum) if hasattr(p, "count") else p.value)
                    for p in metric.data.data_points]
    return out


def _one(points: dict[str, list[tuple[dict[str, Any], Any]]], name: str, **attrs: Any) -> Any:
    found = [v for a, v in points.get(name, []) if all(a.get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, (name, attrs, points.get(name))
    return found[0]


def test_otel_shows_the_steps_and_values_of_the_jsonl_log_of_the_same_run(tmp_path, monkeypatch):
    """Read after every step: the counters count the JSONL log's steps, the gauges hold its values
    (a non-finite value is not recorded: the gauge keeps the last finite one). Each report exported at its step:
    healthy ones otherwise wait for their batch (tests/unit/test_report_lag.py)."""
    monkeypatch.setenv("AMPGUARD_REPORT_BATCH", "0")
    reader = InMemoryMetricReader()
    seen: list[dict[str, list[tuple[dict[str, Any], Any]]]] = []
    opt, records = train(tmp_path, OtelExporter(MeterProvider(metric_readers=[reader])),
                         after_step=lambda step: seen.append(_points(reader)))
    assert len(seen) == len(records)
    rank = {"rank": 0, "local_rank": 0}
    last: dict[str, float] = {}
    for i, (points, rec) in enumerate(zip(seen, records)):
        assert _one(points, M.STEPS.otel_name, **rank) == i + 1
        for reason in M.SKIPPED_STEPS.label_values[0]:
            want = sum(1 for r in records[: i + 1] if r["reason"] == reason)
            assert _one(points, M.SKIPPED_STEPS.otel_name, reason=reason, **rank) == want, (i, reason)
        assert _one(points, M.NONFINITE_STEPS.otel_name, kind="loss", **rank) == sum(
            r["nonfinite_loss"] for r in records[: i + 1])
        assert _one(points, M.SCALE_BACKOFFS.otel_name, **rank) == sum(r["scale_backoff"] for r in records[: i + 1])
        for field, metric in (("loss", M.LOSS), ("loss_scale", M.LOSS_SCALE), ("grad_norm", M.GRAD_NORM)):
            value = float(rec[field])
            if math.isfinite(value):
                last[field] = value
            assert _one(points, metric.otel_name, **rank) == last[field], (i, field)
        finite = [float(r["grad_norm"]) for r in records[: i + 1] if math.isfinite(float(r["grad_norm"]))]
        count, total = _one(points, M.GRAD_NORM_HISTOGRAM.otel_name, **rank)
        assert count == len(finite) and math.isclose(total, sum(finite), rel_tol=1e-12)
        assert _one(points, M.LAST_STEP_TIMESTAMP.otel_name, **rank) == rec["wall_time"]
    anomalies = seen[-1][M.ANOMALIES.otel_name]
    assert {a["kind"]: v for a, v in anomalies if v} == {"overflow": 1, "nonfinite_loss": 1}
    assert _one(seen[-1], M.RUN_INFO.otel_name, **rank) == 1
    assert _one(seen[-1], M.EXPORTER_UP.otel_name, exporter="JsonlExporter", **rank) == 1.0
    assert _one(seen[-1], M.EXPORTER_UP.otel_name, exporter="OtelExporter", **rank) == 1.0
    info = next(a for a, _ in seen[-1][M.RUN_INFO.otel_name])
    assert info["run_id"] == opt.run_info.run_id and info["precision"] == "fp16"


def _info(rank: int, local_rank: int, precision: str = "bf16") -> RunInfo:
    return RunInfo(run_id="r", rank=rank, local_rank=local_rank, world_size=2, precision=precision, backend="local",
                   device="cpu", param_names=("w",), versions=(("torch", torch.__version__),), modules=("fc",),
                   loss_scale_floor=1.0 if precision == "fp16" else None)


def test_every_rank_records_its_own_series_with_rank_attributes():
    """As in a job: one process per rank, each with its own provider and exporter."""
    seen = []
    for rank in (0, 1):
        reader = InMemoryMetricReader()
        exporter = OtelExporter(MeterProvider(metric_readers=[reader]))
        exporter.open(_info(rank, rank))
        exporter.export(StepReport(step=0, skipped=False, reason=None, loss=float(rank + 1), loss_scale=1.0,
                                   next_loss_scale=1.0, grad_norm=0.5, nonfinite_grads=0, nonfinite_loss=False,
                                   world_size=2, rank=rank, wall_time=1.0), ())
        points = _points(reader)
        seen += [(a["rank"], a["local_rank"], v) for a, v in points[M.LOSS.otel_name]]
        assert M.LOSS_SCALE_FLOOR.otel_name not in points  # bf16: no floor, no data point (Prometheus: NaN)
    assert seen == [(0, 0, 1.0), (1, 1, 2.0)]


def test_every_catalogue_family_is_an_instrument_with_its_name_unit_and_kind():
    reader = InMemoryMetricReader()
    exporter = OtelExporter(MeterProvider(metric_readers=[reader]))
    multi = MultiExporter([exporter])
    multi.open(_info(0, 0, "fp16"))
    peaks = {"allocated_bytes": {"all": {"peak": 10}}, "reserved_bytes": {"all": {"peak": 20}}}
    exporter._memory = MemoryPeaks("cuda:0", stats=lambda _: peaks)  # the exporter's own reading
    multi.export(StepReport(step=0, skipped=False, reason=None, loss=1.0, loss_scale=1.0, next_loss_scale=1.0,
                            grad_norm=0.5, nonfinite_grads=0, nonfinite_loss=False, wall_time=1.0,
                            grad_zero_fraction=0.25, group_zero_fractions=(0.25,), headroom_log2=3.0,
                            module_grad_norms=(("fc", 0.5),),
                            module_update_ratios=(("fc", 0.01),),
                            fp8=(Fp8Cast("fc", "input", 2.0, 224.0, 0.0, None, 8.0),)), ())
    data = reader.get_metrics_data()
    assert data is not None
    got = {m.name: (m.unit, type(m.data).__name__) for rm in data.resource_metrics for sm in rm.scope_metrics
           for m in sm.metrics}
    kinds = {"counter": "Sum", "gauge": "Gauge", "histogram": "Histogram", "info": "Gauge"}
    assert got == {m.otel_name: (m.unit, kinds[m.type]) for m in M.CATALOGUE}


def _prometheus_name(otel_name: str, unit: str, monotonic: bool) -> str:
    """OpenTelemetry's Prometheus compatibility rules (metric names): dots to underscores, the unit's
    suffix (curly-brace annotations dropped; ``s`` -> seconds, ``By`` -> bytes), ``_total`` on a monotonic sum."""
    name = otel_name.replace(".", "_")
    suffix = {"s": "seconds", "By": "bytes"}.get(re.sub(r"\{[^}]*\}", "", unit), "")
    if suffix and not name.endswith("_" + suffix):
        name += "_" + suffix
    return name + "_total" if monotonic else name


def test_otel_names_follow_the_convention_and_turn_back_into_the_prometheus_names():
    for m in M.CATALOGUE:
        assert re.fullmatch(r"ampguard\.[a-z][a-z0-9_]*", m.otel_name), m.otel_name
        assert _prometheus_name(m.otel_name, m.unit, m.type == "counter") == m.name, m
        assert M.by_otel_name(m.otel_name) is m
    assert len({m.otel_name for m in M.CATALOGUE}) == len(M.CATALOGUE)
    with pytest.raises(KeyError, match="catalogue"):
        M.by_otel_name("ampguard.nope")


def test_no_module_but_metrics_spells_an_otel_metric_name():
    """As test_metrics checks for the Prometheus names: every module takes the names from the catalogue."""
    names = {m.otel_name for m in M.CATALOGUE}
    offenders = sorted({f"{path.relative_to(PACKAGE)}: {hit}" for path in PACKAGE.rglob("*.py")
                        if path != PACKAGE / "metrics.py"
                        for hit in re.findall(r"ampguard\.[a-z0-9_]+", path.read_text()) if hit in names})
    assert not offenders, "OpenTelemetry names spelled outside ampguard/metrics.py:\n" + "\n".join(offenders)


def test_missing_opentelemetry_names_the_extra(monkeypatch):
    for name in ("opentelemetry", "opentelemetry.metrics"):  # not installed: neither can be imported
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'ampguard\[otel\]'"):
        ampguard.OtelExporter()
