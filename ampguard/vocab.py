"""The words ampguard's records use, spelled once each.

Every enum here is a ``str`` subclass whose values are the strings users already see in
JSONL logs, Prometheus labels and ``StepReport``/``Anomaly`` fields: ``SkipReason.NONFINITE_LOSS
== "nonfinite_loss"`` is true, ``json.dumps`` writes the plain string, and ``str()`` gives
the value (not ``SkipReason.NONFINITE_LOSS``) on every supported Python.
"""

from __future__ import annotations

import enum
from typing import Literal

__all__ = ["AnomalyKind", "Cause", "OnSpike", "Phase", "Precision", "SkipReason"]


class _StrEnum(str, enum.Enum):
    """``enum.StrEnum`` for Python 3.10 too: ``str(member)`` and ``format(member)`` are the value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(str(self.value), format_spec)


class SkipReason(_StrEnum):
    """Why a step was skipped (``StepReport.reason``). Where several apply, the first of nonfinite_loss,
    nonfinite_fp8, nonfinite_grad, no_gradients, grad_spike, loss_spike (:func:`ampguard.policies.decide`);
    new words are appended, so the order of the old ones (and of their label series) stays."""

    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad"
    GRAD_SPIKE = "grad_spike"
    LOSS_SPIKE = "loss_spike"
    ROLLBACK = "rollback"
    NO_GRADIENTS = "no_gradients"
    """No parameter of the optimizer received a gradient on some rank (a detached output)."""
    NONFINITE_FP8 = "nonfinite_fp8"
    """A torchao float8 cast had a non-finite amax or a non-finite or zero scale on some rank (fp8 monitoring,
    ``wrap(fp8=...)``): one bad element poisons the whole cast. Precedes ``nonfinite_grad``."""


class AnomalyKind(_StrEnum):
    """What an :class:`~ampguard.Anomaly` is about (``Anomaly.kind``)."""

    NONFINITE_LOSS = "nonfinite_loss"
    """The loss was NaN/inf (bf16/fp32, or fp16 whatever the scale)."""
    NONFINITE_GRAD = "nonfinite_grad"
    """A gradient was NaN/inf without loss scaling (bf16/fp32), or forensics found a NaN that the
    fp16 scale did not cause."""
    OVERFLOW = "overflow"
    """fp16: a scaled gradient overflowed; the scale backs off (after hysteresis)."""
    GRAD_SPIKE = "grad_spike"
    """The gradient norm exceeded its detector's threshold (``Spikes.grad_factor`` or ``Spikes.grad_zscore``)."""
    LOSS_SPIKE = "loss_spike"
    """The loss exceeded ``Spikes.loss_factor`` x its running average."""
    SCALE_FLOOR = "scale_floor"
    """The loss scale reached ``GuardConfig.min_scale``."""
    RANK_DIVERGENCE = "rank_divergence"
    """Ranks disagree on step/skip count, scale or parameters."""
    ROLLBACK = "rollback"
    """The escalation ladder restored the last good snapshot."""
    ABORT = "abort"
    """The escalation ladder stopped training (NonFiniteError follows)."""
    NO_GRADIENTS = "no_gradients"
    """A backward reached no parameter of the optimizer (on the ranks named); the step was skipped."""
    REBASELINE = "rebaseline"
    """A spike detector (or ZClip) flagged ``Spikes.warmup`` (``ZClip.warmup``) steps in a row: the level moved, so its
    statistics were re-based on those steps and the next steps are judged against the new level."""
    NONFINITE_PARAMS = "nonfinite_params"
    """A parameter held a NaN/Inf after an update from finite gradients (``GuardConfig.param_check_every``):
    the ladder rolls back where it can, else training stops (NonFiniteError)."""
    FP8_NONFINITE = "fp8_nonfinite"
    """A torchao float8 cast's amax or scale was non-finite (or the scale 0): the anomaly names the module, the
    role (input, weight, grad_output) and the rank; the step was skipped on every rank."""


class Phase(_StrEnum):
    """Where forensics saw the first non-finite value (``Anomaly.phase``)."""

    FORWARD = "forward"
    """A module whose inputs were finite produced a non-finite output."""
    BACKWARD = "backward"
    """A module whose incoming gradient was finite produced a non-finite outgoing gradient (or a
    parameter's gradient went non-finite outside every module's backward)."""
    LOSS = "loss"
    """Every module output was finite; the loss was not."""
    INPUT = "input"
    """The model's input (the batch) was non-finite before any module ran on it."""


class Cause(_StrEnum):
    """Why forensics thinks it went non-finite (``Anomaly.cause``)."""

    OVERFLOW = "overflow"
    """Recomputed, non-finite in the run's precision and finite in fp32 (beyond fp16's range);
    or, in backward, inf without NaN under fp16 loss scaling."""
    NAN = "nan"
    """Non-finite in fp32 too: a genuine NaN/inf (bad input or math)."""
    TRANSIENT = "transient"
    """A replay of the same batch was clean: suspect hardware or a race."""
    FP8 = "fp8"
    """A torchao ``Float8Linear`` recomputed on its saved inputs: non-finite in its own fp8 recipe, finite in the
    run's high precision (the same layer without fp8) and in fp32: the fp8 casts or the fp8 GEMM made it."""
    NOT_REPRODUCED = "not_reproduced"
    """Recomputing the culprit on its saved inputs was finite in the run's precision and in
    fp32, and no replay said more: an injected value, a race, hardware, or state the recompute
    does not see."""


Precision = Literal["auto", "fp16", "bf16", "fp32"]
"""``wrap(precision=...)``: "auto" resolves to one of the other three."""

OnSpike = Literal["warn", "skip"]
"""``Spikes.action``."""
