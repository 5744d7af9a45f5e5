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
from .scaling import ScalerView, ScaleState, next_scale
from .stats import DECISION_K, Loc

__all__ = ["ScalerView", "SpikeState", "decide"]


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


# Long (~90 lines) on purpose: the whole decision is one device-side expression graph, captured as
# one CUDA graph and read top to bottom as the rule; split up, it reads worse and captures the same.
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
    world = g.shape[0]
    cmax = g.amax(0) if world > 1 else g[0]  # NaN propagates: a NaN norm on any rank is NaN here
    csum = g.sum(0) if world > 1 else g[0]
    loss_bad = cmax[Loc.LOSS_NONFINITE] > 0
    loss = csum[Loc.LOSS] / world
    if grads_sharded and world > 1:  # each rank holds a shard: the global norm adds the squares
        grad_norm = torch.linalg.vector_norm(g[:, Loc.GRAD_NORM], 2.0)
    else:  # one rank, or replicated gradients: equal everywhere when healthy, NaN/inf if any rank's is
        grad_norm = cmax[Loc.GRAD_NORM]
    nonfinite_tensors = csum[Loc.NONFINITE_TENSORS]
    grad_bad = (nonfinite_tensors > 0) | (cmax[Loc.FOUND_INF] > 0) | ~torch.isfinite(grad_norm)
    nonfinite = loss_bad | grad_bad
    no_grads = cmax[Loc.NO_GRADS] > 0  # on any rank: the step is skipped everywhere

    false = torch.zeros((), dtype=torch.bool, device=dev)
    grad_spike = loss_spike = false
    spikes_on = config.grad_spike_factor is not None or config.loss_spike_factor is not None
    if spikes_on:
        warm = (spikes.count >= config.spike_warmup) & ~nonfinite & ~no_grads
        if config.grad_spike_factor is not None:
            grad_spike = warm & (grad_norm > config.grad_spike_factor * spikes.grad_ema)
        if config.loss_spike_factor is not None:
            loss_spike = warm & (loss > config.loss_spike_factor * spikes.loss_ema)
    spike = grad_spike | loss_spike
    skip = (nonfinite | no_grads | spike) if config.on_spike == "skip" else (nonfinite | no_grads)

    # Indices into stats.REASONS, in order of precedence.
    reason = torch.where(
        loss_bad,
        1.0,
        torch.where(grad_bad, 2.0, torch.where(no_grads, 5.0, torch.where(
            skip & grad_spike, 3.0, torch.where(skip & loss_spike, 4.0, 0.0)))),
    )

    if spikes_on:  # running averages of healthy steps (only kept when a detector needs them)
        healthy = ~nonfinite & ~no_grads & ~spike
        d = config.spike_ema_decay
        pair = torch.stack([grad_norm, loss])
        ema = torch.stack([spikes.grad_ema, spikes.loss_ema])
        new = torch.where(spikes.count == 0, pair, d * ema + (1 - d) * pair)
        new = torch.where(healthy, new, ema)
        spikes.grad_ema.copy_(new[0])
        spikes.loss_ema.copy_(new[1])
        spikes.count.add_(healthy.int())

    if config.clip_grad_norm is not None:
        # The expression of torch.nn.utils.clip_grad_norm_, so the coefficient is bitwise its.
        clip_coef = torch.clamp(config.clip_grad_norm / (grad_norm + 1e-6), max=1.0)
    else:
        clip_coef = torch.ones((), dtype=torch.float32, device=dev)

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
        scale = new_scale = torch.ones((), dtype=torch.float32, device=dev)
        backoff = growth = floor_hit = false

    values = torch.stack([loss, grad_norm, nonfinite_tensors, clip_coef, scale.reshape(()), new_scale.reshape(()),
                          reason])
    flags = torch.stack([skip, loss_bad, grad_bad, grad_spike, loss_spike, backoff, growth, floor_hit, no_grads])
    out = torch.cat([values.float(), flags.float()])
    if out.shape[0] != DECISION_K:  # pragma: no cover - layout invariant (see stats.Dec)
        raise AssertionError("decision vector layout out of date")
    return out, new_tracker
