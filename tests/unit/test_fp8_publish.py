"""fp8 cast statistics (StepReport.fp8) published like the other numerics: bounded series, real scrapes."""

from __future__ import annotations

import math
import urllib.request
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from ampguard import metrics as M
from ampguard.exporters import PrometheusExporter
from ampguard.exporters._fp8 import fp8_series
from ampguard.records import FP8_ROLES, Fp8Cast, RunInfo, StepReport


def _info() -> RunInfo:
    return RunInfo(run_id="run-fp8", rank=0, local_rank=0, world_size=1, precision="bf16", backend="local",
                   device="cpu", param_names=("fc.weight",), versions=(("torch", torch.__version__),),
                   modules=("fc",))


def _casts(modules: int, *, amax: float = 3.0, sampled: bool = True) -> tuple[Fp8Cast, ...]:
    out = []
    for i in range(modules):
        for role in FP8_ROLES:
            a = amax * (i + 1)
            out.append(Fp8Cast(f"layers.{i}.mlp", role, a, 448.0 / a, 0.01 * i if sampled else None, None,
                               10.0 + i if sampled else None))
    return tuple(out)


def _report(step: int, fp8: tuple[Fp8Cast, ...] | None) -> StepReport:
    return StepReport(step=step, skipped=False, reason=None, loss=1.0, loss_scale=1.0, next_loss_scale=1.0,
                      grad_norm=0.5, nonfinite_grads=0, nonfinite_loss=False, wall_time=1000.0 + step, fp8=fp8)


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return {(s.labels["module"], s.labels["role"]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name}


def test_fold_keeps_the_worst_of_the_folded_modules() -> None:
    known: list[str] = []
    casts = _casts(40)
    series = fp8_series(casts, known, max_modules=16)
    assert len(series) == (16 + 1) * 3 and len(known) == 16
    other = {s.role: s for s in series if s.module == M.FP8_OTHER}
    assert other["input"].amax == max(c.amax for c in casts[16 * 3:])
    assert other["input"].scale == min(c.scale for c in casts[16 * 3:])
    # A NaN amax in a folded module is not hidden by the max, and counts as a non-finite cast.
    bad = (*casts, Fp8Cast("layers.39.mlp", "weight", math.nan, 1.0))
    folded = {(s.module, s.role): s for s in fp8_series(bad, known, max_modules=16)}
    assert math.isnan(folded[(M.FP8_OTHER, "weight")].amax) and folded[(M.FP8_OTHER, "weight")].nonfinite == 1


def test_prometheus_scrape_shows_fp8_series_bounded_with_40_modules() -> None:
    registry = CollectorRegistry(auto_describe=True)
    exporter = PrometheusExporter(port=0, addr="127.0.0.1", registry=registry)
    exporter.open(_info())
    try:
        exporter.export(_report(1, _casts(40)), [])
        exporter.export(_report(2, _casts(40, amax=4.0, sampled=False)), [])  # an unsampled step
        nan = (Fp8Cast("layers.0.mlp", "grad_output", math.inf, 0.0),)
        exporter.export(_report(3, nan), [])
        assert exporter.url is not None
        with urllib.request.urlopen(exporter.url, timeout=10) as resp:  # a real HTTP scrape
            text = resp.read().decode()
    finally:
        exporter.close()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    amax = {(s.labels["module"], s.labels["role"]): s.value for s in fams["ampguard_fp8_amax"].samples}
    assert len(amax) == (M.FP8_MODULES + 1) * len(FP8_ROLES)  # 40 modules -> 16 named + "_other"
    assert {m for m, _ in amax} == {*(f"layers.{i}.mlp" for i in range(16)), M.FP8_OTHER}
    assert amax[("layers.3.mlp", "input")] == 16.0  # step 2's value (4.0 * 4)
    assert amax[(M.FP8_OTHER, "weight")] == 160.0  # the largest of modules 16..39
    assert math.isinf(amax[("layers.0.mlp", "grad_output")])
    under = {(s.labels["module"], s.labels["role"]): s.value for s in fams["ampguard_fp8_underflow_ratio"].samples}
    assert math.isclose(under[("layers.5.mlp", "input")], 0.05)  # kept from the sampled step 1
    dyn = {(s.labels["module"], s.labels["role"]): s.value for s in fams["ampguard_fp8_dynamic_range_log2"].samples}
    assert dyn[(M.FP8_OTHER, "input")] == 49.0
    nonfinite: dict[Any, float] = {(s.labels["module"], s.labels["role"]): s.value
                                   for s in fams["ampguard_fp8_nonfinite"].samples
                                   if s.name == "ampguard_fp8_nonfinite_total"}
    assert nonfinite[("layers.0.mlp", "grad_output")] == 1.0 and nonfinite[("layers.1.mlp", "input")] == 0.0
    assert _samples(registry, "ampguard_fp8_scale")[("layers.0.mlp", "grad_output")] == 0.0


def test_no_fp8_series_without_fp8_monitoring() -> None:
    registry = CollectorRegistry(auto_describe=True)
    exporter = PrometheusExporter(registry=registry, serve=False)
    exporter.open(_info())
    exporter.export(_report(1, None), [])
    assert _samples(registry, "ampguard_fp8_amax") == {}


def test_otel_in_memory_reader_shows_fp8_series_bounded() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from ampguard.exporters import OtelExporter

    reader = InMemoryMetricReader()
    exporter = OtelExporter(MeterProvider(metric_readers=[reader]))
    exporter.open(_info())
    exporter.export(_report(1, _casts(40)), [])
    exporter.export(_report(2, (Fp8Cast("layers.2.mlp", "weight", math.nan, 1.0),)), [])  # the gauge keeps 9.0
    data = reader.get_metrics_data()
    assert data is not None
    points = {m.name: {(dict(p.attributes)["module"], dict(p.attributes)["role"]): p.value for p in m.data.data_points}
              for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
              if m.name.startswith("ampguard.fp8")}
    assert len(points["ampguard.fp8_amax"]) == (M.FP8_MODULES + 1) * 3
    assert points["ampguard.fp8_amax"][(M.FP8_OTHER, "input")] == 120.0
    assert points["ampguard.fp8_amax"][("layers.2.mlp", "weight")] == 9.0  # the SDK refuses NaN
    assert points["ampguard.fp8_nonfinite"][("layers.2.mlp", "weight")] == 1
    assert points["ampguard.fp8_underflow_ratio"][("layers.1.mlp", "grad_output")] == 0.01


def _tracked(exporter: Any) -> None:
    exporter.open(_info())
    exporter.export(_report(1, _casts(40)), [])
    exporter.export(_report(2, (*_casts(40, amax=4.0, sampled=False), Fp8Cast("layers.20.mlp", "weight",
                                                                                math.inf, 0.0))), [])
    exporter.close()


def test_tensorboard_event_file_holds_fp8_scalars(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ampguard.exporters import TensorBoardExporter

    _tracked(TensorBoardExporter(tmp_path / "tb"))
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("ampguard/fp8/")]
    assert len({t.split("/")[2] for t in tags}) == M.FP8_MODULES + 1  # 40 modules -> 16 + "_other"
    assert [(e.step, e.value) for e in acc.Scalars("ampguard/fp8/layers.3.mlp/input/amax")] == [(1, 12.0), (2, 16.0)]
    assert [e.step for e in acc.Scalars("ampguard/fp8/layers.3.mlp/input/underflow_ratio")] == [1]  # sampled only
    assert [e.value for e in acc.Scalars("ampguard/fp8/_other/weight/nonfinite")] == [0.0, 1.0]


def test_mlflow_file_store_holds_fp8_scalars(tmp_path: Any, monkeypatch: Any) -> None:
    from mlflow.tracking import MlflowClient

    from ampguard.exporters import MlflowExporter

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (tmp_path / "mlruns").as_uri()
    exporter = MlflowExporter(store, experiment="ampguard-fp8")
    _tracked(exporter)
    client = MlflowClient(store)
    run = client.get_run(exporter.active_run_id)
    keys = [k for k in run.data.metrics if k.startswith("ampguard/fp8/")]
    assert len({k.split("/")[2] for k in keys}) == M.FP8_MODULES + 1
    history = client.get_metric_history(run.info.run_id, "ampguard/fp8/_other/input/amax")
    assert sorted((m.step, m.value) for m in history) == [(1, 120.0), (2, 160.0)]
    nonfinite = client.get_metric_history(run.info.run_id, "ampguard/fp8/_other/weight/nonfinite")
    assert sorted((m.step, m.value) for m in nonfinite) == [(1, 0.0), (2, 1.0)]


def test_jsonl_keeps_every_cast_on_sampled_and_nonfinite_steps_and_the_bounded_fold_otherwise(tmp_path: Any) -> None:
    import json

    from ampguard.exporters import JsonlExporter

    exporter = JsonlExporter(tmp_path / "log.jsonl")
    bad = (*_casts(40, sampled=False)[:-1], Fp8Cast("layers.39.mlp", "grad_output", math.nan, 1.0))
    _tracked_steps = [_report(1, _casts(40)), _report(2, _casts(40, sampled=False)), _report(3, bad)]
    exporter.open(_info())
    for report in _tracked_steps:
        exporter.export(report, [])
    exporter.close()
    steps = [r for line in (tmp_path / "log.jsonl").read_text().splitlines()
             if (r := json.loads(line)).get("event") == "step"]
    assert [len(r["fp8"]) for r in steps] == [120, (M.FP8_MODULES + 1) * 3, 120]
    folded = {(c["module"], c["role"]): c for c in steps[1]["fp8"]}
    assert folded[(M.FP8_OTHER, "input")]["amax"] == 120.0 and folded[(M.FP8_OTHER, "input")]["underflow"] is None


def test_wandb_offline_run_holds_fp8_scalars(tmp_path: Any, monkeypatch: Any) -> None:
    from pathlib import Path

    import wandb

    from ampguard.exporters import WandbExporter

    from .test_exporters_wandb import _SETTINGS, _history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    exporter = WandbExporter(project="ampguard-fp8", settings=wandb.Settings(**_SETTINGS))
    _tracked(exporter)
    rows = _history(Path(exporter.active_run.dir).parent)
    assert [row["ampguard/fp8/layers.3.mlp/input/amax"] for row in rows] == [12.0, 16.0]
    assert len({k.split("/")[2] for row in rows for k in row if k.startswith("ampguard/fp8/")}) == M.FP8_MODULES + 1
    assert [row["ampguard/fp8/_other/weight/nonfinite"] for row in rows] == [0.0, 1.0]
