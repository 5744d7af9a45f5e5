"""OtelExporter: the guard's metrics as OpenTelemetry instruments, per rank.

opentelemetry is optional (``pip install 'ampguard[otel]'``: the API and SDK); it is imported when
the exporter is made, never by ``import ampguard``.

Every instrument comes from :mod:`ampguard.metrics` (:attr:`~ampguard.metrics.Metric.otel_name`,
:attr:`~ampguard.metrics.Metric.unit`; the names are listed in docs/exporters.md): a counter, gauge
or histogram (with the catalogue's buckets) per family, the same families, meanings and updates as
the Prometheus exporter. Every data point carries the attributes ``rank`` and ``local_rank`` (ints)
and the family's own (``reason``, ``kind``, ``exporter``, ``group``, ``module``); every rank records
its own, as every rank serves its own Prometheus endpoint. Counters start at 0 for every known
attribute combination; the run's facts are a gauge of 1 (:data:`ampguard.metrics.RUN_INFO`) with
:data:`ampguard.metrics.RUN_INFO_LABELS` as attributes. A gauge is recorded with finite values only
(the SDK refuses NaN and inf): on a non-finite step the loss or gradient-norm gauge keeps its last
finite value, and the non-finite and skipped-step counters count the step; a gauge with no value yet
(memory off CUDA, the loss-scale floor without fp16) has no data point, where Prometheus shows NaN.

The exporter records into a ``MeterProvider``: the one given, else the global one
(``opentelemetry.metrics.get_meter_provider()``, what ``opentelemetry-instrument`` or your own setup
installs). The provider's readers and exporters (OTLP, Prometheus, in-memory) decide where the
numbers go and when; a reader's export runs on its own thread, so a dead collector does not hold a step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .. import metrics as M
from .._version import __version__
from ..records import Anomaly, RunInfo, StepReport
from ..vocab import AnomalyKind, Cause, SkipReason
from ._fp8 import fp8_series
from ._scalars import optional_module
from .base import ExporterHealth
from .memory import MemoryPeaks

__all__ = ["OtelExporter"]


def _otel_metrics() -> Any:
    return optional_module("OtelExporter", "otel", "opentelemetry.metrics")


class OtelExporter:
    """Record the guard's metrics as OpenTelemetry instruments (see the module docstring).

    - ``meter_provider``: the ``MeterProvider`` to record into; None: the global one. One
      ``OtelExporter`` per provider (a second one's instruments would carry the same names).

    Counters and gauges are observable instruments: ``export()`` stores plain Python numbers (as the
    Prometheus exporter does) and the provider's reader reads them when it collects, on its own
    thread; the grad-norm histogram records each finite norm (one SDK call a step).
    """

    def __init__(self, meter_provider: Any = None) -> None:
        self.meter_provider = meter_provider
        self._histogram: Any = None
        self._rank: dict[str, Any] = {}
        self._memory: MemoryPeaks | None = None
        self._values: dict[str, dict[tuple[str, ...], float]] = {m.name: {} for m in M.CATALOGUE}
        """Per family, per values of its own labels: the counter's total or the gauge's last value."""
        self._health: Mapping[str, ExporterHealth] = {}
        self._health_seen: dict[str, tuple[bool, int]] = {}
        self._fp8_known: list[str] = []
        _otel_metrics()  # fail at construction, naming the extra, when opentelemetry is missing

    def watch_exporters(self, health: Mapping[str, ExporterHealth]) -> None:
        """Called by :class:`~ampguard.exporters.MultiExporter` before ``open()``: every exporter's health
        (a live view), recorded per exporter (:data:`ampguard.metrics.PER_EXPORTER`)."""
        self._health = health

    def open(self, info: RunInfo) -> None:
        """Create the instruments (once), every counter at 0, the run's facts and the scale floor."""
        if self._histogram is None:
            provider = self.meter_provider or _otel_metrics().get_meter_provider()
            meter = provider.get_meter("ampguard", __version__)
            for metric in M.CATALOGUE:
                self._instrument(meter, metric)
        self._rank = {"rank": info.rank, "local_rank": info.local_rank}
        self._memory = MemoryPeaks(info.device)
        for stored in self._values.values():
            stored.clear()
        self._fp8_known.clear()
        for metric in M.CATALOGUE:
            if metric.type == "counter" and metric not in M.PER_EXPORTER:
                for combo in M.label_combinations(metric):
                    self._values[metric.name][combo] = 0
        self._values[M.RUN_INFO.name][tuple(M.run_info_values(info).values())] = 1
        if info.loss_scale_floor is not None:  # fp16; bf16 and fp32 have no floor (no data point)
            self._set(M.LOSS_SCALE_FLOOR, info.loss_scale_floor)
        self._health_seen = {}
        self._report_health()

    def _instrument(self, meter: Any, metric: M.Metric) -> None:
        kw: dict[str, Any] = {"unit": metric.unit, "description": metric.help}
        if metric.type == "histogram":
            self._histogram = meter.create_histogram(
                metric.otel_name, explicit_bucket_boundaries_advisory=list(M.GRAD_NORM_BUCKETS), **kw)
            return
        observation = _otel_metrics().Observation
        labels = M.RUN_INFO_LABELS if metric is M.RUN_INFO else metric.labels
        stored = self._values[metric.name]

        def observe(options: Any) -> list[Any]:  # the reader's thread: a copy of what export() stored
            rank = self._rank
            return [observation(v, {**dict(zip(labels, combo)), **rank}) for combo, v in list(stored.items())]

        make = meter.create_observable_counter if metric.type == "counter" else meter.create_observable_gauge
        make(metric.otel_name, callbacks=[observe], **kw)  # gauges, and the run-info family (a gauge of 1)

    def _add(self, metric: M.Metric, *values: str, amount: float = 1) -> None:
        counts = self._values[metric.name]
        counts[values] = counts.get(values, 0) + amount

    def _set(self, metric: M.Metric, value: float, *values: str) -> None:
        if math.isfinite(value):  # the SDK refuses NaN and inf: the gauge keeps its last finite value
            self._values[metric.name][values] = value

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        if not self._rank:
            return
        self._add(M.STEPS)
        if report.skipped:
            reason = report.reason if report.reason in M.SKIPPED_STEPS.label_values[0] else SkipReason.NONFINITE_GRAD
            self._add(M.SKIPPED_STEPS, str(reason))
        if report.nonfinite_loss:
            self._add(M.NONFINITE_STEPS, "loss")
        elif report.nonfinite_grads > 0:
            self._add(M.NONFINITE_STEPS, "grad")
        if report.nonfinite and (report.world_size == 1 or report.rank in report.nonfinite_ranks):
            self._add(M.NONFINITE_ORIGIN)
        self._set(M.LOSS_SCALE, report.loss_scale)
        self._set(M.GRAD_NORM, report.grad_norm)
        if math.isfinite(report.grad_norm):
            self._histogram.record(report.grad_norm, self._rank)
        if report.loss is not None:  # None: no loss was given for the step; the gauge keeps its last value
            self._set(M.LOSS, report.loss)
        self._set(M.LAST_STEP_TIMESTAMP, report.wall_time)
        if report.scale_backoff:
            self._add(M.SCALE_BACKOFFS)
        if report.scale_growth:
            self._add(M.SCALE_GROWTHS)
        for anomaly in anomalies:
            if anomaly.kind in M.ANOMALIES.label_values[0]:
                self._add(M.ANOMALIES, str(anomaly.kind))
            if anomaly.kind == AnomalyKind.RANK_DIVERGENCE:
                self._add(M.RANK_DIVERGENCE)
            if anomaly.cause == Cause.TRANSIENT and (not anomaly.ranks or report.rank in anomaly.ranks):
                self._add(M.TRANSIENT_FAULTS)
        if report.grad_zero_fraction is not None:  # a step sampled by GuardConfig.numerics_every
            self._set(M.GRAD_ZERO_FRACTION, report.grad_zero_fraction, "all")
            for group, value in enumerate(report.group_zero_fractions or ()):
                self._set(M.GRAD_ZERO_FRACTION, value, str(group))
        if report.headroom_log2 is not None:
            self._set(M.LOSS_SCALE_HEADROOM, report.headroom_log2)
        peaks = self._memory.read() if self._memory is not None else None  # the exporter's own reading
        for kind, peak in zip(M.MEMORY_KINDS, peaks or ()):
            self._set(M.DEVICE_MEMORY_PEAK, peak, kind)
        for metric, pairs in ((M.MODULE_GRAD_NORM, report.module_grad_norms),
                              (M.MODULE_UPDATE_RATIO, report.module_update_ratios)):
            for module, value in pairs or ():
                self._set(metric, value, module)
        for series in fp8_series(report.fp8, self._fp8_known):  # bounded: metrics.FP8_MODULES modules + "_other"
            for metric, value in series.values():
                if metric.type == "counter":
                    self._add(metric, series.module, series.role, amount=value)
                else:
                    self._set(metric, value, series.module, series.role)
        self._report_health()

    def _report_health(self) -> None:
        for name, health in self._health.items():  # recorded when it changes (a gauge keeps its last value)
            seen = self._health_seen.get(name)
            if seen is None or seen != (health.up, health.errors):
                self._set(M.EXPORTER_UP, 1.0 if health.up else 0.0, name)
                self._add(M.EXPORTER_ERRORS, name, amount=health.errors - (seen[1] if seen else 0))  # 0 at first
                self._health_seen[name] = (health.up, health.errors)

    def close(self) -> None:
        """Nothing to release: the provider (and its readers) are the application's."""
        self._rank = {}

    def __repr__(self) -> str:
        return f"OtelExporter({type(self.meter_provider).__name__ if self.meter_provider else 'global provider'})"
