"""The run trackers on a step whose loss the guard never saw (``StepReport.loss is None``): the habit
``opt.scaler.scale(loss).backward(); opt.step()``. The JSONL log writes ``null``; W&B, MLflow and
OpenTelemetry leave the loss out of that step and keep every other number. Before, ``float(None)``
failed inside each exporter on every step, and the contained failure set the exporter aside."""

from __future__ import annotations

import logging
import warnings

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import ampguard
from ampguard import metrics as M
from ampguard.exporters import OtelExporter
from ampguard.exporters._scalars import step_scalars

from ._models import loss_of, make_data, make_model, make_opt


def _train_without_giving_the_loss(*exporters) -> ampguard.GuardedOptimizer:
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16", exporters=list(exporters))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the guard's one warning about the unseen loss
        for x, y in make_data(4):
            with opt.autocast():
                loss = loss_of(model, x, y)
            opt.scaler.scale(loss).backward()  # the old habit: the guard never sees the loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    opt.flush()
    return opt


def test_run_trackers_leave_an_unknown_loss_out_and_keep_the_rest(caplog):
    reader = InMemoryMetricReader()
    with caplog.at_level(logging.DEBUG, logger="ampguard.exporters"):
        opt = _train_without_giving_the_loss(OtelExporter(MeterProvider(metric_readers=[reader])))
    assert [r.loss for r in opt.history] == [None] * 4
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    names = {m.name: m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    assert [p.value for p in names[M.STEPS.otel_name].data.data_points] == [4]
    assert M.LOSS.otel_name not in names or all(p.value == 0 for p in names[M.LOSS.otel_name].data.data_points)
    for report in opt.history:  # W&B and MLflow log step_scalars' keys
        scalars = step_scalars(report, ())
        assert "ampguard/loss" not in scalars
        assert scalars["ampguard/loss_scale"] == report.loss_scale and scalars["ampguard/step"] == report.step
    opt.close()
