"""The loss-scale rule, written once (:func:`next_scale`), and the state it carries.

GradScaler's own rule (``torch._amp_update_scale_``) backs off on every overflowing step and
grows after ``growth_interval`` clean ones. :func:`next_scale` is that rule, plus hysteresis (an
allowance of ``hysteresis - 1`` overflows that do not back off, refilled only when the scale
grows, as DeepSpeed and Megatron-LM refill theirs), a [min, max] clamp and the opt-in headroom
policy. It runs on tensors (:class:`~ampguard.ops.TensorOps`: no host sync; the result goes to
``GradScaler.update(new_scale=...)``) or on host floats (:data:`~ampguard.ops.HOST`, float32 op for
op), with the same bits. With hysteresis 1 and a scale inside [min, max] it is bitwise GradScaler's.
"""

from __future__ import annotations

import dataclasses

import torch

from .ops import Ops, Value, f32

__all__ = ["HEADROOM_MAX_SCALE", "ScaleState", "ScalerView", "next_scale"]


@dataclasses.dataclass(slots=True)
class ScalerView:
    """What the decision needs of a GradScaler (None when there is no loss scaling)."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    growth_factor: float
    backoff_factor: float
    growth_interval: int


@dataclasses.dataclass(slots=True)
class ScaleState:
    """Device tensors the scale rule carries from step to step."""

    overflow_run: torch.Tensor
    """int32: overflowing steps since the scale last grew (or since the start), at most
    ``hysteresis``: the hysteresis allowance spent (Megatron-LM's ``hysteresis_tracker`` is
    ``hysteresis - overflow_run``). An overflow backs off once it reaches ``hysteresis``; only a
    growth of the scale sets it back to 0."""

    @classmethod
    def fresh(cls, device: torch.device) -> ScaleState:
        return cls(overflow_run=torch.zeros((), dtype=torch.int32, device=device))


HEADROOM_MAX_SCALE = 2.0**24
"""The headroom policy's ceiling when ``GuardConfig.max_scale`` is None."""


_SHIFT_MAX = 126.0
"""The policy's largest step, in doublings (headroom of a tiny gradient can exceed float32's range)."""


def next_scale(
    o: Ops,
    *,
    scale: Value,
    growth_tracker: Value,
    overflow: Value,
    held: Value,
    overflow_run: Value,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float | None,
    headroom: Value | None = None,
    margin: int = 2,
) -> tuple[Value, Value, Value, Value, Value, Value]:
    """The scale for the next step, on tensors or host values (``o``: :class:`~ampguard.ops.TensorOps`
    or :data:`~ampguard.ops.HOST`); reads nothing else and writes nothing.

    Hysteresis: an overflow backs the scale off when it brings the overflows counted since the
    scale last grew (``overflow_run``, capped at ``hysteresis``) to ``hysteresis``; clean steps do
    not refill the allowance, a growth does. So the first ``hysteresis - 1`` overflows after a
    growth are skipped without a backoff and every later one backs off (DeepSpeed's
    ``DynamicLossScaler`` with ``consecutive_hysteresis=False``, Megatron-LM's
    ``DynamicGradScaler``); intermittent overflows back the scale off as consecutive ones do.
    With ``hysteresis=1`` every overflow backs off: GradScaler's rule.

    ``overflow`` (bool): the gradients were non-finite on some rank. ``held`` (bool): the step was
    skipped for another reason (a spike, a non-finite loss with finite gradients): the scale and
    the growth count stay as they are. Returns ``(new_scale, new_tracker, backoff, growth,
    floor_hit, new_overflow_run)``; the flags are for the report.

    ``headroom`` (the headroom scale policy, ``GuardConfig.scale_policy="headroom"``): the headroom
    agreed across ranks (NaN on a step not sampled). The growth timer is then off (tracker 0, no
    growth by it); on a sampled step that was taken the scale becomes ``scale * 2**(floor(headroom)
    - margin)`` (the step bounded to +-126 doublings: exact, a power of two), clamped to [min_scale,
    max_scale] (None: ``HEADROOM_MAX_SCALE``). Overflows back off as without it. ``backoff`` and
    ``growth`` then also say which way the policy moved the scale.
    """
    lo, hi = f32(min_scale), None if max_scale is None else f32(max_scale)  # as torch rounds them
    if hysteresis == 1:  # GradScaler's rule, the default: every overflow backs off and sets the run to 1 (the carried
        # run is a count >= 0, so min(run + 1, 1) is 1): the same values by one op where the general rule takes five
        run = o.where(overflow, 1, overflow_run)
        backoff = overflow
    else:
        run = o.where(overflow, o.imin(overflow_run + 1, hysteresis), overflow_run)
        backoff = overflow & (run >= hysteresis)
    backed = o.mul(scale, f32(backoff_factor))
    floor_hit = backoff & (backed <= lo)
    if headroom is not None:  # the headroom policy: no growth timer; a taken sampled step sets the scale
        apply = o.isfinite(headroom) & o.not_(overflow | held)
        target = scale  # taken only where apply: the host skips it on other steps
        if o.may(apply):
            shift = o.clamp(o.sub(o.floor(headroom), margin), -_SHIFT_MAX, _SHIFT_MAX)
            target = o.clamp(o.mul(scale, o.exp2(shift)), lo, HEADROOM_MAX_SCALE if hi is None else hi)
        new = o.clamp(o.first([(backoff, backed), (apply, target)], scale), lo, hi)
        moved_down, moved_up = apply & (new < scale), apply & (new > scale)
        return (new, o.zeros_like(growth_tracker), backoff | moved_down, moved_up, floor_hit,
                o.where(moved_up, 0, run))  # a growth refills the allowance

    tracker = o.first([(overflow, 0), (held, growth_tracker)], growth_tracker + 1)
    grown = o.mul(scale, f32(growth_factor))
    reached = (tracker >= growth_interval) & o.not_(overflow | held)
    growth = reached & o.isfinite(grown)
    tracker = o.where(reached, 0, tracker)
    new = o.clamp(o.first([(backoff, backed), (growth, grown)], scale), lo, hi)
    if hi is not None:
        growth = growth & (grown <= hi)
    return new, tracker, backoff, growth, floor_hit, o.where(growth, 0, run)  # only a growth refills
