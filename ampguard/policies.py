"""Detectors and the step decision, computed on device from the gathered statistics.

:func:`decide` turns the ``[world_size, LOCAL_K]`` matrix every rank gathered into the
decision vector (:class:`~ampguard.stats.Dec`). It is a pure function of that matrix and
of state every rank holds identically, so every rank takes the same decision without
talking again, and without the host reading a single value.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import GuardConfig
from .scaling import ScaleState, next_scale
from .stats import DECISION_K, Loc

__all__ = ["SpikeState", "decide"]


@dataclasses.dataclass(slots=True)
class SpikeState:
    """Running averages of the healthy steps' gradient norm and loss (float32, on device)."""

    grad_ema: torch.Tensor
    loss_ema: torch.Tensor
    count: torch.Tensor  # healthy steps folded into the averages (int32)

    @classmethod
    def fresh(cls, device: torch.device) -> SpikeState:
        z = torch.zeros((), dtype=torch.float32, device=device)
        return cls(grad_ema=z.clone(), loss_ema=z.clone(), count=torch.zeros((), dtype=torch.int32, device=device))


@dataclasses.dataclass(slots=True)
class ScalerView:
    """What :func:`decide` needs of a GradScaler (None when there is no loss scaling)."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    growth_factor: float
    backoff_factor: float
    growth_interval: int


def decide(
    gathered: torch.Tensor,
    *,
    config: GuardConfig,
    spikes: SpikeState,
    scale_state: ScaleState,
    scaler: ScalerView | None,
    grads_sharded: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decision vector from the gathered local vectors; updates ``spikes`` and ``scale_state``
    in place. Returns ``(decision, new_growth_tracker)`` (the tracker is None without a scaler)."""
    g = gathered
    dev = g.device
    loss_bad = g[:, Loc.LOSS_NONFINITE].amax() > 0
    loss = g[:, Loc.LOSS].mean()
    if grads_sharded:  # each rank holds a shard: the global norm adds the squares
        grad_norm = torch.linalg.vector_norm(g[:, Loc.GRAD_NORM], 2.0)
    elif g.shape[0] == 1:
        grad_norm = g[0, Loc.GRAD_NORM]
    else:  # replicated gradients: equal everywhere when healthy; NaN/inf if any rank's is
        grad_norm = g[:, Loc.GRAD_NORM].amax()
    nonfinite_tensors = g[:, Loc.NONFINITE_TENSORS].sum()
    grad_bad = (nonfinite_tensors > 0) | (g[:, Loc.FOUND_INF].amax() > 0) | ~torch.isfinite(grad_norm)
    nonfinite = loss_bad | grad_bad

    warm = spikes.count >= config.spike_warmup
    false = torch.zeros((), dtype=torch.bool, device=dev)
    grad_spike = false
    loss_spike = false
    if config.grad_spike_factor is not None:
        grad_spike = warm & ~nonfinite & (grad_norm > config.grad_spike_factor * spikes.grad_ema)
    if config.loss_spike_factor is not None:
        loss_spike = warm & ~nonfinite & (loss > config.loss_spike_factor * spikes.loss_ema)
    spike = grad_spike | loss_spike
    skip = nonfinite | (spike if config.on_spike == "skip" else false)

    reason = torch.where(
        loss_bad,
        1.0,
        torch.where(grad_bad, 2.0, torch.where(skip & grad_spike, 3.0, torch.where(skip & loss_spike, 4.0, 0.0))),
    )

    healthy = ~nonfinite & ~spike
    d = config.spike_ema_decay
    first = spikes.count == 0
    spikes.grad_ema.copy_(
        torch.where(healthy, torch.where(first, grad_norm, d * spikes.grad_ema + (1 - d) * grad_norm), spikes.grad_ema)
    )
    spikes.loss_ema.copy_(
        torch.where(healthy, torch.where(first, loss, d * spikes.loss_ema + (1 - d) * loss), spikes.loss_ema)
    )
    spikes.count.add_(healthy.int())

    if config.clip_grad_norm is not None:
        # The expression of torch.nn.utils.clip_grad_norm_, so the coefficient is bitwise its.
        clip_coef = torch.clamp(config.clip_grad_norm / (grad_norm + 1e-6), max=1.0)
    else:
        clip_coef = torch.ones((), dtype=torch.float32, device=dev)

    one = torch.ones((), dtype=torch.float32, device=dev)
    new_tracker = None
    if scaler is not None:
        scale = scaler.scale
        new_scale, new_tracker, backoff, growth, floor_hit = next_scale(
            scale=scale,
            growth_tracker=scaler.growth_tracker,
            overflow=grad_bad,
            held=skip & ~grad_bad,
            state=scale_state,
            growth_factor=scaler.growth_factor,
            backoff_factor=scaler.backoff_factor,
            growth_interval=scaler.growth_interval,
            hysteresis=config.hysteresis,
            min_scale=config.min_scale,
            max_scale=config.max_scale,
        )
    else:
        scale = new_scale = one
        backoff = growth = floor_hit = false

    out = torch.stack(
        [
            skip.float(),
            reason.float(),
            loss.float(),
            grad_norm.float(),
            nonfinite_tensors.float(),
            loss_bad.float(),
            grad_bad.float(),
            grad_spike.float(),
            loss_spike.float(),
            clip_coef.float(),
            scale.float().reshape(()),
            new_scale.float().reshape(()),
            backoff.float(),
            growth.float(),
            floor_hit.float(),
        ]
    )
    if out.shape[0] != DECISION_K:  # pragma: no cover - layout invariant (see stats.Dec)
        raise AssertionError("decision vector layout out of date")
    return out, new_tracker
