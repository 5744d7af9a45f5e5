"""Loss-scale control on top of GradScaler: hysteresis, floor and ceiling, on device.

GradScaler's own rule (``torch._amp_update_scale_``) backs off on every overflowing step and
grows after ``growth_interval`` clean ones. :func:`next_scale` computes the same rule with
plain tensor ops, plus hysteresis (back off only after N consecutive overflows) and a
[min, max] clamp, and hands the result to ``GradScaler.update(new_scale=...)``. With
hysteresis 1 and a scale inside [min, max] the result is bitwise GradScaler's.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["ScaleState", "next_scale"]


@dataclasses.dataclass(slots=True)
class ScaleState:
    """Device tensors the scale rule carries from step to step."""

    overflow_run: torch.Tensor
    """int32: consecutive overflowing steps not yet answered by a backoff (hysteresis)."""

    @classmethod
    def fresh(cls, device: torch.device) -> ScaleState:
        return cls(overflow_run=torch.zeros((), dtype=torch.int32, device=device))


def next_scale(
    *,
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    overflow: torch.Tensor,
    held: torch.Tensor,
    state: ScaleState,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scale for the next step, without a host sync.

    ``overflow`` (bool, 0-d): the gradients were non-finite on some rank. ``held`` (bool): the
    step was skipped for another reason (a spike, a non-finite loss with finite gradients):
    the scale and the growth count stay as they are. Updates ``state`` and ``growth_tracker``
    in place. Returns ``(new_scale, new_tracker, backoff, growth, floor_hit)``; the last three
    are bool tensors for the report.
    """
    run = torch.where(overflow, state.overflow_run + 1, torch.zeros_like(state.overflow_run))
    backoff = overflow & (run >= hysteresis)
    state.overflow_run.copy_(torch.where(backoff, torch.zeros_like(run), run))

    tracker = torch.where(
        overflow,
        torch.zeros_like(growth_tracker),
        torch.where(held, growth_tracker, growth_tracker + 1),
    )
    grown = scale * growth_factor
    reached = (tracker >= growth_interval) & ~overflow & ~held
    growth = reached & torch.isfinite(grown)
    tracker = torch.where(reached, torch.zeros_like(tracker), tracker)

    backed = scale * backoff_factor
    new = torch.where(backoff, backed, torch.where(growth, grown, scale))
    floor_hit = backoff & (backed <= min_scale)
    new = torch.clamp(new, min=min_scale, max=max_scale)
    if max_scale is not None:
        growth = growth & (grown <= max_scale)
    return new, tracker, backoff, growth, floor_hit
