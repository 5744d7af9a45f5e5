"""Detectors and the step decision, computed from the gathered statistics.

:func:`decide` turns the ``[world_size, LOCAL_K]`` matrix every rank gathered into the
decision vector (:class:`~ampguard.stats.Dec`). It is a pure function of that matrix and
of state every rank holds identically, so every rank takes the same decision without
talking again, and without the host reading a single value.

:func:`decide_host` is the same rule on host floats, for the CPU, where reading the matrix
costs nothing and ~60 tiny tensor ops cost more than the rule itself. Every float32 operation
of :func:`decide` is reproduced with one float32 rounding (:func:`ampguard.scaling.f32`), so
both give the same decision vector, bit for bit, and leave the same carried state
(``tests/unit/test_host_decision.py`` runs both on the same inputs).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .config import GuardConfig
from .scaling import ScalerView, ScaleState, clamp_f32, f32, next_scale, next_scale_host
from .stats import DECISION_K, Loc

__all__ = ["ScalerView", "SpikeState", "decide", "decide_host"]


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
            headroom=(g[:, Loc.HEADROOM].amin(0) if world > 1 else g[0, Loc.HEADROOM])  # NaN: not sampled
            if config.scale_policy == "headroom" else None,
            margin=config.headroom_margin_log2,
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


def decide_host(gathered: torch.Tensor, *, config: GuardConfig, spikes: SpikeState, scale_state: ScaleState,
                scaler: ScalerView | None, grads_sharded: bool) -> tuple[list[float], int | None]:
    """:func:`decide` on host floats, line for line: the same decision vector (as a list of
    floats, each a float32 value) and the same updates of ``spikes`` and ``scale_state``.
    Returns ``(decision, new_growth_tracker)``. For CPU tensors: it reads the gathered matrix and
    the carried state to the host (``.tolist()``/``.item()``, free on CPU, a sync elsewhere).

    Float32 arithmetic is reproduced by rounding after every operation (:func:`f32`), with the
    operands torch would use: a Python scalar next to a float32 tensor is rounded to float32
    first, ``c / t`` is ``t.reciprocal() * c`` (``Tensor.__rtruediv__``). The reductions across
    ranks (world > 1) stay torch's, so their summation order is the one :func:`decide` uses."""
    g = gathered
    world = g.shape[0]
    if world > 1:
        cmax, csum = g.amax(0).tolist(), g.sum(0).tolist()
    else:
        cmax = csum = g.tolist()[0]
    loss_bad = cmax[Loc.LOSS_NONFINITE] > 0
    loss = f32(csum[Loc.LOSS] / world)
    if grads_sharded and world > 1:
        grad_norm = torch.linalg.vector_norm(g[:, Loc.GRAD_NORM], 2.0).item()
    else:
        grad_norm = cmax[Loc.GRAD_NORM]
    nonfinite_tensors = csum[Loc.NONFINITE_TENSORS]
    grad_bad = nonfinite_tensors > 0 or cmax[Loc.FOUND_INF] > 0 or not math.isfinite(grad_norm)
    nonfinite = loss_bad or grad_bad
    no_grads = cmax[Loc.NO_GRADS] > 0

    grad_spike = loss_spike = False
    spikes_on = config.grad_spike_factor is not None or config.loss_spike_factor is not None
    if spikes_on:
        count = int(spikes.count.item())
        grad_ema, loss_ema = spikes.grad_ema.item(), spikes.loss_ema.item()
        warm = count >= config.spike_warmup and not nonfinite and not no_grads
        if config.grad_spike_factor is not None:
            grad_spike = warm and grad_norm > f32(f32(config.grad_spike_factor) * grad_ema)
        if config.loss_spike_factor is not None:
            loss_spike = warm and loss > f32(f32(config.loss_spike_factor) * loss_ema)
    spike = grad_spike or loss_spike
    skip = nonfinite or no_grads or spike if config.on_spike == "skip" else nonfinite or no_grads

    reason = (1.0 if loss_bad else 2.0 if grad_bad else 5.0 if no_grads else 3.0 if skip and grad_spike
              else 4.0 if skip and loss_spike else 0.0)

    if spikes_on and not nonfinite and not no_grads and not spike:  # healthy: fold it into the averages
        if count == 0:
            grad_ema, loss_ema = grad_norm, loss
        else:
            d, e = f32(config.spike_ema_decay), f32(1 - config.spike_ema_decay)
            grad_ema = f32(f32(d * grad_ema) + f32(e * grad_norm))
            loss_ema = f32(f32(d * loss_ema) + f32(e * loss))
        spikes.grad_ema.fill_(grad_ema)
        spikes.loss_ema.fill_(loss_ema)
        spikes.count.fill_(count + 1)

    if config.clip_grad_norm is not None:
        # clip_grad_norm_'s ``max_norm / (total_norm + 1e-6)``, clamped at 1 (NaN stays NaN)
        clip_coef = clamp_f32(f32(_reciprocal(f32(grad_norm + f32(1e-6))) * f32(config.clip_grad_norm)), None, 1.0)
    else:
        clip_coef = 1.0

    new_tracker = None
    if scaler is not None:
        scale, tracker = scaler.scale.item(), int(scaler.growth_tracker.item())
        run = int(scale_state.overflow_run.item())
        headroom = None
        if config.scale_policy == "headroom":  # the minimum over ranks, NaN-propagating as amin
            headroom = g[:, Loc.HEADROOM].amin(0).item() if world > 1 else cmax[Loc.HEADROOM]
        new_scale, new_tracker, backoff, growth, floor_hit, new_run = next_scale_host(
            scale, tracker, grad_bad, skip and not grad_bad, run, scaler=scaler, config=config, headroom=headroom)
        if new_run != run:
            scale_state.overflow_run.fill_(new_run)
    else:
        scale = new_scale = 1.0
        backoff = growth = floor_hit = False

    values = [loss, grad_norm, nonfinite_tensors, clip_coef, scale, new_scale, reason]
    flags = [skip, loss_bad, grad_bad, grad_spike, loss_spike, backoff, growth, floor_hit, no_grads]
    out = values + [1.0 if f else 0.0 for f in flags]
    if len(out) != DECISION_K:  # pragma: no cover - layout invariant (see stats.Dec)
        raise AssertionError("decision vector layout out of date")
    return out, new_tracker


def _reciprocal(x: float) -> float:
    """``torch.reciprocal`` of a float32 value, in float32 (1/0 is inf, not an exception)."""
    return f32(1.0 / x) if x != 0 else math.copysign(math.inf, x)
