"""The metric catalogue: the one place ampguard's metric names, types, help texts and labels live.

The Prometheus exporter, the Grafana dashboard and the Prometheus rules
(:mod:`ampguard.dashboards`) are all built from :data:`CATALOGUE`; a test checks that no
other module of ampguard spells a metric name.

Conventions (Prometheus practice): ``ampguard_`` prefix, base units (seconds), ``_total``
on counters, every series carries ``rank`` and ``local_rank``; ``job`` (and ``instance``)
are left to service discovery. Every known label combination is created at 0 when the
exporter opens, so ``increase()`` sees the very first NaN.

OpenTelemetry names (:attr:`Metric.otel_name`, :attr:`Metric.unit`, used by
:class:`~ampguard.exporters.OtelExporter`) are made from the same entries: ``ampguard.`` and the
Prometheus name without its ``ampguard_`` prefix, its ``_total`` and its unit suffix
(``ampguard_steps_total`` -> ``ampguard.steps``, unit ``{step}``;
``ampguard_last_step_timestamp_seconds`` -> ``ampguard.last_step_timestamp``, unit ``s``), with the
same attributes as the Prometheus labels (``rank``, ``local_rank`` and the family's own). OpenTelemetry's
Prometheus compatibility rules (dots to underscores, the unit's suffix, ``_total`` on a monotonic sum)
turn each name back into its Prometheus name, so the dashboards and rules work on either path.

Importing this module creates no metric and touches no registry: it is plain data.
"""

from __future__ import annotations

import dataclasses

from .records import ANOMALY_KINDS, FP8_ROLES, SKIP_REASONS, RunInfo

__all__ = [
    "ANOMALIES",
    "CATALOGUE",
    "DEVICE_MEMORY_PEAK",
    "EXPORTER_ERRORS",
    "EXPORTER_UP",
    "FP8",
    "FP8_AMAX",
    "FP8_DYNAMIC_RANGE",
    "FP8_MODULES",
    "FP8_NONFINITE",
    "FP8_OTHER",
    "FP8_SCALE",
    "FP8_UNDERFLOW",
    "MEMORY_KINDS",
    "GRAD_NORM",
    "GRAD_ZERO_FRACTION",
    "LOSS_SCALE_HEADROOM",
    "MODULE_GRAD_NORM",
    "MODULE_UPDATE_RATIO",
    "GRAD_NORM_BUCKETS",
    "GRAD_NORM_HISTOGRAM",
    "LAST_STEP_TIMESTAMP",
    "LOSS",
    "LOSS_SCALE",
    "LOSS_SCALE_FLOOR",
    "NONFINITE_KINDS",
    "NONFINITE_ORIGIN",
    "NONFINITE_STEPS",
    "PER_EXPORTER",
    "PER_MODULE",
    "RANK_DIVERGENCE",
    "RANK_LABELS",
    "RUN_INFO",
    "RUN_INFO_LABELS",
    "SCALE_BACKOFFS",
    "SCALE_GROWTHS",
    "SKIPPED_STEPS",
    "STEPS",
    "TRANSIENT_FAULTS",
    "Metric",
    "OTEL_PREFIX",
    "PREFIX",
    "by_name",
    "by_otel_name",
    "label_combinations",
    "run_info_values",
]

#: Every Prometheus name starts with this; every OpenTelemetry name with :data:`OTEL_PREFIX`.
PREFIX = "ampguard_"
OTEL_PREFIX = "ampguard."
#: Prometheus name suffix of each OpenTelemetry unit that has one (OpenTelemetry's Prometheus compatibility).
_UNIT_SUFFIXES = {"s": "_seconds", "By": "_bytes"}

#: Labels every ampguard series carries.
RANK_LABELS = ("rank", "local_rank")

#: Values of the ``kind`` label of :data:`NONFINITE_STEPS`.
NONFINITE_KINDS = ("grad", "loss")

#: Upper bounds of the finite grad-norm histogram: powers of 4 from 2**-20 to 2**20
#: (gradient norms span many orders of magnitude; +Inf is added by the client).
GRAD_NORM_BUCKETS = tuple(4.0**e for e in range(-10, 11))


@dataclasses.dataclass(frozen=True, slots=True)
class Metric:
    """One metric family, as Prometheus exposes it."""

    name: str
    """Full exposed name (``ampguard_steps_total``; for an info metric ``ampguard_run_info``)."""
    type: str
    """"counter" | "gauge" | "histogram" | "info"."""
    help: str
    """HELP text."""
    labels: tuple[str, ...] = ()
    """Labels beyond :data:`RANK_LABELS`."""
    label_values: tuple[tuple[str, ...], ...] = ()
    """Known values of each label in :attr:`labels` (same order); every combination exists at 0.
    ``()`` for a label: its values are known when the exporter opens (the run's exporter names,
    :data:`PER_EXPORTER`), and its series are created then."""
    unit: str = ""
    """OpenTelemetry unit (UCUM; ``{step}``-style annotations for counts; ``""``: dimensionless). The
    Prometheus name already ends in its base unit (``_seconds``, ``_bytes``)."""

    @property
    def client_name(self) -> str:
        """The name to give prometheus_client (it appends ``_total`` / ``_info`` itself)."""
        suffix = {"counter": "_total", "info": "_info"}.get(self.type, "")
        if suffix and self.name.endswith(suffix):
            return self.name[: -len(suffix)]
        return self.name

    @property
    def all_labels(self) -> tuple[str, ...]:
        return (*self.labels, *RANK_LABELS)

    @property
    def otel_name(self) -> str:
        """The OpenTelemetry instrument name (see the module docstring): ``ampguard.steps``."""
        stem = self.name.removeprefix(PREFIX)
        if self.type == "counter":
            stem = stem.removesuffix("_total")
        return OTEL_PREFIX + stem.removesuffix(_UNIT_SUFFIXES.get(self.unit, "\0"))

    def series(self, suffix: str = "") -> str:
        """The name of a series of this family (``series("_bucket")`` for a histogram's buckets)."""
        return self.name + suffix


STEPS = Metric("ampguard_steps_total", "counter", "Optimizer steps attempted (skipped ones included).",
               unit="{step}")
SKIPPED_STEPS = Metric(
    "ampguard_skipped_steps_total",
    "counter",
    "Steps whose parameter update was skipped, by reason (the exemplar carries the step number).",
    labels=("reason",),
    label_values=(SKIP_REASONS,),
    unit="{step}",
)
NONFINITE_STEPS = Metric(
    "ampguard_nonfinite_steps_total",
    "counter",
    "Steps that saw non-finite values: kind=loss when the loss was NaN/inf, kind=grad when only "
    "gradients were (each step counts once).",
    labels=("kind",),
    label_values=(NONFINITE_KINDS,),
    unit="{step}",
)
NONFINITE_ORIGIN = Metric(
    "ampguard_nonfinite_origin_steps_total",
    "counter",
    "Non-finite steps whose NaN/inf originated on this rank (spots the one bad rank).",
    unit="{step}",
)
LOSS_SCALE = Metric(
    "ampguard_loss_scale",
    "gauge",
    "Loss scale that multiplied the last step's loss, as StepReport.loss_scale (1 without loss scaling).",
)
LOSS_SCALE_FLOOR = Metric(
    "ampguard_loss_scale_floor",
    "gauge",
    "Floor of the fp16 loss scale (GuardConfig.min_scale, as the scaler clamps to it), set once at open; NaN "
    "without loss scaling (bf16, fp32).",
)
GRAD_NORM = Metric(
    "ampguard_grad_norm", "gauge", "Global L2 norm of the unscaled gradients of the last step (NaN/inf allowed)."
)
GRAD_NORM_HISTOGRAM = Metric(
    "ampguard_grad_norm_finite",
    "histogram",
    "Distribution of the finite global gradient norms (non-finite norms are not observed).",
)
LOSS = Metric("ampguard_loss", "gauge", "Loss of the last step (unscaled; NaN when non-finite).")
LAST_STEP_TIMESTAMP = Metric(
    "ampguard_last_step_timestamp_seconds",
    "gauge",
    "Unix time at which the last step was reported (0 before the first step).",
    unit="s",
)
SCALE_BACKOFFS = Metric("ampguard_scale_backoffs_total", "counter", "Times the loss scale was decreased.",
                        unit="{backoff}")
SCALE_GROWTHS = Metric("ampguard_scale_growths_total", "counter", "Times the loss scale was increased.",
                       unit="{growth}")
RANK_DIVERGENCE = Metric(
    "ampguard_rank_divergence_total",
    "counter",
    "Failed consistency checks: ranks disagreed on step/skip count, loss scale or parameters.",
    unit="{check}",
)
ANOMALIES = Metric(
    "ampguard_anomalies_total",
    "counter",
    "Anomalies the guard recorded, by kind.",
    labels=("kind",),
    label_values=(ANOMALY_KINDS,),
    unit="{anomaly}",
)
TRANSIENT_FAULTS = Metric(
    "ampguard_transient_faults_total",
    "counter",
    "Non-finite steps that originated on this rank and that a replay of the same batch did not reproduce "
    "(forensics cause=transient): repeated ones on one rank point at bad hardware.",
    unit="{step}",
)
#: Values of the ``kind`` label of :data:`DEVICE_MEMORY_PEAK`.
MEMORY_KINDS = ("allocated", "reserved")
DEVICE_MEMORY_PEAK = Metric(
    "ampguard_device_memory_peak_bytes",
    "gauge",
    "Peak device memory on this rank (CUDA caching allocator): its high-water mark, read by the exporter "
    "(nothing reset, no sync); NaN off CUDA.",
    labels=("kind",),
    label_values=(MEMORY_KINDS,),
    unit="By",
)
EXPORTER_ERRORS = Metric(
    "ampguard_exporter_errors_total",
    "counter",
    "Failed calls (open/export/close, retries included) of each of the run's exporters; a failed exporter is "
    "retried with backoff.",
    labels=("exporter",),
    label_values=((),),
    unit="{call}",
)
EXPORTER_UP = Metric(
    "ampguard_exporter_up",
    "gauge",
    "1 while the exporter works, 0 from a failed call until a retry works (its records are held meanwhile).",
    labels=("exporter",),
    label_values=((),),
)
#: Metrics whose ``exporter`` label takes the names of the run's exporters (``JsonlExporter``,
#: ``JsonlExporter#2`` for a second one: :attr:`ampguard.exporters.ExporterHealth.name`).
PER_EXPORTER = (EXPORTER_ERRORS, EXPORTER_UP)
GRAD_ZERO_FRACTION = Metric(
    "ampguard_grad_zero_fraction",
    "gauge",
    "Fraction of this rank's gradient elements exactly zero at the last sampled step (GuardConfig.numerics_every), "
    "per param group (group=\"all\": every gradient; NaN: a group without gradients): fp16 underflow shows as a rise.",
    labels=("group",),
    label_values=((),),
)
LOSS_SCALE_HEADROOM = Metric(
    "ampguard_loss_scale_headroom_log2",
    "gauge",
    "log2(65504 / max|scaled gradient|) of this rank at the last sampled step: doublings of the loss scale left "
    "before fp16 overflows (negative: beyond fp16's range; -inf or NaN: it overflowed). fp16 only.",
)
MODULE_GRAD_NORM = Metric(
    "ampguard_module_grad_norm",
    "gauge",
    "L2 norm of the unscaled gradients of each top-level module at the last sampled step (leading indicator).",
    labels=("module",),
    label_values=((),),
)
MODULE_UPDATE_RATIO = Metric(
    "ampguard_module_update_ratio",
    "gauge",
    "||delta w|| / ||w|| of each top-level module's update at the last sampled step (leading indicator).",
    labels=("module",),
    label_values=((),),
)
#: Metrics whose ``module`` label takes the run's top-level module names (``RunInfo.modules``, known
#: when the exporter opens); sampled every ``GuardConfig.numerics_every`` steps.
PER_MODULE = (MODULE_GRAD_NORM, MODULE_UPDATE_RATIO)
RUN_INFO = Metric(
    "ampguard_run_info",
    "info",
    "The run: id, precision, backend, world size and versions (value always 1).",
)

#: At most this many fp8 modules get a ``module`` label value of their own (the first seen, in the model's
#: order); the casts of every other module fold into ``module="_other"`` (:data:`FP8_OTHER`).
FP8_MODULES = 16
FP8_OTHER = "_other"
_FP8_LABELS = ("module", "role")
_FP8_VALUES: tuple[tuple[str, ...], ...] = ((), FP8_ROLES)
_FP8_FOLD = f"(at most {FP8_MODULES} modules by name, the rest folded into module=\"{FP8_OTHER}\"; "
FP8_AMAX = Metric(
    "ampguard_fp8_amax",
    "gauge",
    "max|x| of the high-precision tensor of each torchao float8 cast at the last step " + _FP8_FOLD + "max).",
    labels=_FP8_LABELS,
    label_values=_FP8_VALUES,
)
FP8_SCALE = Metric(
    "ampguard_fp8_scale",
    "gauge",
    "Scale of each torchao float8 cast at the last step " + _FP8_FOLD + "min).",
    labels=_FP8_LABELS,
    label_values=_FP8_VALUES,
)
FP8_UNDERFLOW = Metric(
    "ampguard_fp8_underflow_ratio",
    "gauge",
    "Fraction of each float8 cast's non-zero elements flushed to zero, at the last sampled step " + _FP8_FOLD
    + "max).",
    labels=_FP8_LABELS,
    label_values=_FP8_VALUES,
)
FP8_DYNAMIC_RANGE = Metric(
    "ampguard_fp8_dynamic_range_log2",
    "gauge",
    "log2(amax / min nonzero |x|) of each float8 cast's input, at the last sampled step " + _FP8_FOLD + "max).",
    labels=_FP8_LABELS,
    label_values=_FP8_VALUES,
)
FP8_NONFINITE = Metric(
    "ampguard_fp8_nonfinite_total",
    "counter",
    "float8 casts whose amax or scale was non-finite (or scale <= 0) " + _FP8_FOLD + "summed).",
    labels=_FP8_LABELS,
    label_values=_FP8_VALUES,
    unit="{cast}",
)
#: The fp8 cast metrics (filled from ``StepReport.fp8`` when fp8 monitoring is on); module label bounded
#: by :data:`FP8_MODULES`.
FP8 = (FP8_AMAX, FP8_SCALE, FP8_UNDERFLOW, FP8_DYNAMIC_RANGE, FP8_NONFINITE)

#: Labels of :data:`RUN_INFO` beyond :data:`RANK_LABELS`: the fields of ``RunInfo`` of the same
#: name, and ``<package>_version`` from ``RunInfo.versions`` ("" when not known).
RUN_INFO_LABELS = (
    "run_id",
    "precision",
    "backend",
    "world_size",
    "device",
    "ampguard_version",
    "torch_version",
    "python_version",
)

#: Every metric family ampguard exports, in exposition order.
CATALOGUE: tuple[Metric, ...] = (
    STEPS,
    SKIPPED_STEPS,
    NONFINITE_STEPS,
    NONFINITE_ORIGIN,
    LOSS_SCALE,
    LOSS_SCALE_FLOOR,
    GRAD_NORM,
    GRAD_NORM_HISTOGRAM,
    LOSS,
    LAST_STEP_TIMESTAMP,
    SCALE_BACKOFFS,
    SCALE_GROWTHS,
    RANK_DIVERGENCE,
    ANOMALIES,
    TRANSIENT_FAULTS,
    DEVICE_MEMORY_PEAK,
    GRAD_ZERO_FRACTION,
    LOSS_SCALE_HEADROOM,
    EXPORTER_ERRORS,
    EXPORTER_UP,
    MODULE_GRAD_NORM,
    MODULE_UPDATE_RATIO,
    RUN_INFO,
    *FP8,
)


def by_name(name: str) -> Metric:
    """The catalogue entry a series named ``name`` belongs to (``_bucket``/``_sum``/``_count`` of a
    histogram, and the ``_created`` series prometheus_client adds to counters and histograms, too)."""
    for m in CATALOGUE:
        names = {m.name}
        if m.type == "histogram":
            names |= {m.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        elif m.type == "counter":
            names.add(m.client_name + "_created")
        if name in names:
            return m
    raise KeyError(f"{name!r} is not in ampguard's metric catalogue (ampguard.metrics.CATALOGUE)")


def by_otel_name(name: str) -> Metric:
    """The catalogue entry whose OpenTelemetry instrument is named ``name`` (``ampguard.steps``)."""
    for m in CATALOGUE:
        if m.otel_name == name:
            return m
    raise KeyError(f"{name!r} is not an OpenTelemetry name of ampguard's metric catalogue (ampguard.metrics.CATALOGUE)")


def label_combinations(metric: Metric) -> list[tuple[str, ...]]:
    """Every combination of the known values of ``metric``'s labels beyond the rank's (``[()]``
    without such labels): the series that exist at 0 from the start."""
    out: list[tuple[str, ...]] = [()]
    for choices in metric.label_values:
        out = [(*prefix, v) for prefix in out for v in choices]
    return out


def run_info_values(info: RunInfo) -> dict[str, str]:
    """The labels of :data:`RUN_INFO` (:data:`RUN_INFO_LABELS`) for ``info``."""
    versions = dict(info.versions)
    return {
        name: versions.get(name.removesuffix("_version"), "") if name.endswith("_version") else str(getattr(info, name))
        for name in RUN_INFO_LABELS
    }
