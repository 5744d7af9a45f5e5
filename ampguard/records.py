"""What the host learns about a step: :class:`StepReport` and :class:`Anomaly`.

Only these plain-Python records cross from the step into host-side policies and
exporters: no tensor, no optimizer, no CUDA handle is reachable from them, so an
exporter can never slow down or break a step.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, overload

from .vocab import AnomalyKind, Cause, Phase, SkipReason

__all__ = ["ANOMALY_KINDS", "FP8_ROLES", "SKIP_REASONS", "Anomaly", "Fp8Cast", "History", "RunInfo", "StepReport"]

#: Values ``StepReport.reason`` takes on a skipped step, in order of precedence.
SKIP_REASONS: tuple[str, ...] = tuple(r.value for r in SkipReason)

#: Values ``Anomaly.kind`` takes.
ANOMALY_KINDS: tuple[str, ...] = tuple(k.value for k in AnomalyKind)

#: The roles of an fp8 cast in a torchao ``Float8Linear`` (its ``GemmInputRole`` values).
FP8_ROLES: tuple[str, ...] = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8Cast:
    """One fp8 cast of one ``Float8Linear`` on one step, summed up (plain values; this rank's)."""

    module: str
    """Qualified name of the ``Float8Linear`` (``model.named_modules()``)."""
    role: str
    """``input``, ``weight`` or ``grad_output`` (:data:`FP8_ROLES`)."""
    amax: float
    """max|x| of the high-precision tensor cast (the largest over rows with rowwise scaling); NaN/inf allowed."""
    scale: float
    """The scale the cast multiplied by (the smallest over rows with rowwise scaling); NaN/0/inf allowed."""
    underflow: float | None = None
    """Fraction of the elements non-zero in high precision and zero after the cast, on sampled steps."""
    saturation: float | None = None
    """Fraction of the elements clamped to the fp8 maximum, where the scale can saturate; else None."""
    dynamic_range: float | None = None
    """log2(amax / min nonzero |x|) on sampled steps."""

    @property
    def finite(self) -> bool:
        return math.isfinite(self.amax) and math.isfinite(self.scale) and self.scale > 0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, slots=True)
class StepReport:
    """What one call of ``GuardedOptimizer.step()`` saw and decided. Plain Python values only."""

    step: int
    """0-based index of the ``step()`` call this report describes (skipped steps count)."""
    skipped: bool
    """True when the inner optimizer did not update the parameters on this step."""
    reason: SkipReason | None
    """Why the step was skipped, or None."""
    loss: float | None
    """The loss given to ``backward()`` or ``observe_loss()`` (unscaled; the mean when several
    backward calls accumulated into this step; NaN when non-finite); None when no loss was given
    for this step (a backward the guard did not see: unknown, not non-finite)."""
    loss_scale: float
    """The scale that multiplied this step's loss (1.0 without loss scaling)."""
    next_loss_scale: float
    """The scale the next step will use (after backoff, growth, floor and ceiling)."""
    grad_norm: float
    """Global L2 norm of the unscaled gradients (before clipping); NaN/inf allowed."""
    nonfinite_grads: int
    """Number of gradient *tensors* holding a NaN or inf (summed over ranks)."""
    nonfinite_loss: bool
    """True when the loss was NaN or inf on any rank."""
    nonfinite_ranks: tuple[int, ...] = ()
    """Ranks where the non-finite values originated; ``()`` on one process."""
    clip_coef: float = 1.0
    """Factor the gradients were multiplied by for ``clip_grad_norm`` or ZClip (1.0 when not clipped)."""
    grad_spike: bool = False
    """The gradient norm was flagged as a spike (acted on per ``Spikes.action``)."""
    loss_spike: bool = False
    """The loss was flagged as a spike (acted on per ``Spikes.action``)."""
    world_size: int = 1
    """Number of ranks that took part in the decision."""
    rank: int = 0
    """The rank that produced this report (every rank's report holds the same decision)."""
    param_norms: tuple[float, ...] | None = None
    """Per-parameter gradient norms (in ``GuardedOptimizer.param_names`` order), only on steps
    where they were requested (``GuardConfig.param_norms_every``) or the gradients were non-finite."""
    wall_time: float = 0.0
    """``time.time()`` when the host materialised this report."""
    scale_backoff: bool = False
    """The loss scale was backed off after this step (``next_loss_scale < loss_scale``)."""
    scale_growth: bool = False
    """The loss scale grew after this step (``next_loss_scale > loss_scale``)."""
    grad_zero_fraction: float | None = None
    """Fraction of this rank's gradient elements that were exactly zero (fp16 underflow shows here),
    on steps sampled by ``GuardConfig.numerics_every``; None on other steps."""
    group_zero_fractions: tuple[float, ...] | None = None
    """The same fraction per optimizer param group (``param_groups`` order), on sampled steps (NaN for
    a group with no gradient: frozen or unused parameters are not counted)."""
    headroom_log2: float | None = None
    """log2(65504 / max|scaled gradient|) of this rank's gradients on sampled steps: how many doublings
    of the loss scale fp16 has left before an overflow (negative: beyond fp16's range; -inf or NaN:
    it overflowed). None on other steps, and without fp16 loss scaling (bf16/fp32). See docs/numerics.md."""
    module_grad_norms: tuple[tuple[str, float], ...] | None = None
    """(top-level module, L2 norm of its unscaled gradients) on sampled steps: a leading indicator."""
    module_update_ratios: tuple[tuple[str, float], ...] | None = None
    """(top-level module, ||delta w|| / ||w|| of this step's update) on sampled steps."""
    # -- the detectors' thresholds (docs/detectors.md) --
    spike_threshold: float | None = None
    """The gradient norm above which this step counted as a spike (``Spikes.grad_factor`` times the
    running average, or the z-score detector's ``mean + grad_zscore * std``); None when no
    gradient-norm detector is on. Compared only after ``Spikes.warmup`` healthy steps."""
    clip_threshold: float | None = None
    """ZClip (``GuardConfig.zclip``): the largest gradient norm this step let through: the
    threshold it was clipped to (then ``grad_norm * clip_coef``), else ``mean + ZClip.z * std``;
    inf during warm-up. None when ZClip is off."""
    # -- end of the detectors' thresholds --
    fp8: tuple[Fp8Cast, ...] | None = None
    """Each torchao float8 cast of this step (module, role, amax, scale; underflow on sampled steps),
    when fp8 monitoring is on; None otherwise."""

    @property
    def nonfinite(self) -> bool:
        """True when the loss, any gradient or (fp8 monitoring) an fp8 cast on some rank was non-finite."""
        return self.nonfinite_loss or self.nonfinite_grads > 0 or self.reason == SkipReason.NONFINITE_FP8

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats become the strings "nan", "inf", "-inf")."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            out[f.name] = _jsonable(getattr(self, f.name))
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class Anomaly:
    """Something the guard noticed. ``opt.anomalies`` keeps them in order."""

    step: int
    """The step it was seen on."""
    kind: AnomalyKind
    """What it is about (a ``str``: the JSONL and Prometheus spelling)."""
    detail: str
    """A sentence for a human."""
    ranks: tuple[int, ...] = ()
    """Ranks involved (where it originated); ``()`` on one process."""
    params: tuple[str, ...] = ()
    """Names of the first parameters whose gradients were non-finite, when known."""
    module: str | None = None
    """Qualified name of the first module that produced a non-finite value (forensics)."""
    phase: Phase | None = None
    """Where the first non-finite value appeared (forensics)."""
    cause: Cause | None = None
    """Why (forensics)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, str):
        return str(value)  # a vocab enum becomes its plain string
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Fp8Cast):
        return value.to_dict()
    return value


class History(Sequence[StepReport]):
    """The last ``maxlen`` step reports, indexed by step number.

    ``history[s]`` is the report of step ``s`` (``history[-1]`` the latest); a step that
    has been evicted raises ``IndexError`` naming ``GuardConfig.history_size``.
    ``len(history)`` is the number of reports retained, what iteration (and ``reversed``) yields;
    ``steps_reported`` counts every step reported so far, evicted ones included, and
    ``first_step`` is the step number of the oldest retained report. Indices are step numbers,
    not positions: ``history[history.first_step]`` is the first report iteration yields.
    """

    def __init__(self, maxlen: int) -> None:
        self._items: deque[StepReport] = deque(maxlen=maxlen)
        self._count = 0

    def append(self, report: StepReport) -> None:
        if report.step != self._count:
            raise ValueError(f"history expects step {self._count}, got {report.step}")
        self._items.append(report)
        self._count += 1

    def __len__(self) -> int:
        return len(self._items)

    @property
    def steps_reported(self) -> int:
        """Steps reported so far, evicted ones included (the next report is this step's)."""
        return self._count

    @overload
    def __getitem__(self, index: int) -> StepReport: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[StepReport]: ...

    def __getitem__(self, index: int | slice) -> StepReport | Sequence[StepReport]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count)) if i >= self.first_step]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"step {index} has not been reported (steps reported: {self._count})")
        first = self.first_step
        if index < first:
            raise IndexError(
                f"step {index} was evicted: history keeps the last {self._items.maxlen} steps "
                "(raise GuardConfig.history_size to keep more)"
            )
        return self._items[index - first]

    def __iter__(self) -> Iterator[StepReport]:
        return iter(self._items)

    def __reversed__(self) -> Iterator[StepReport]:
        return reversed(self._items)

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        """The step number of ``value`` (a retained report), searched from step ``start`` to ``stop``."""
        for step, report in enumerate(self._items, self.first_step):
            if start <= step and (stop is None or step < stop) and (report is value or report == value):
                return step
        raise ValueError(f"{value!r} is not in the history")

    @property
    def first_step(self) -> int:
        """Step number of the oldest retained report."""
        return self._count - len(self._items)

    def __repr__(self) -> str:
        return f"History(steps={self._count}, retained={len(self._items)})"


@dataclasses.dataclass(frozen=True, slots=True)
class RunInfo:
    """Facts about the run, fixed at ``wrap()`` time and handed to every exporter's ``open()``."""

    run_id: str
    """Identifier shared by every rank of the run (``AMPGUARD_RUN_ID`` or generated on rank 0
    and broadcast by the distributed backends)."""
    rank: int
    local_rank: int
    world_size: int
    precision: str
    """"fp16" | "bf16" | "fp32"."""
    backend: str
    """"local" | "torch.distributed" | "horovod"."""
    device: str
    """The guard's device, e.g. "cuda:0" or "cpu"."""
    param_names: tuple[str, ...]
    """Parameter names, in the order of ``StepReport.param_norms``."""
    versions: tuple[tuple[str, str], ...] = ()
    """(package, version) pairs: ampguard, torch, python."""
    loss_scale_floor: float | None = None
    """Floor of the fp16 loss scale: ``GuardConfig.min_scale`` rounded to float32, as the scaler
    clamps to it. None without loss scaling (bf16, fp32)."""
    param_groups: int = 1
    """Number of the optimizer's param groups at ``wrap()`` (the ``group`` label values of the
    sampled zero fraction: "all", "0", "1", ...)."""
    modules: tuple[str, ...] = ()
    """Top-level modules whose leading indicators are sampled (``GuardConfig.indicators_every`` with
    ``wrap(model=...)``), in the order of ``StepReport.module_grad_norms``; ``()`` when off."""

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        d["versions"] = dict(self.versions)
        return d
