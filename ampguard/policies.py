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

__all__ = ["ScalerView", "SpikeState", "decide", "decide_host", "uses_clipping", "uses_grad_detector"]


@dataclasses.dataclass(slots=True)
class SpikeState:
    """Running statistics of the gradient norm and loss (float32, on device): the factor
    detector's averages of healthy steps, the z-score detector's mean and variance of the same
    steps (counted by ``count`` too), and ZClip's mean and variance of the clipped norms.

    No statistic locks itself out: the ``flag_*`` fields follow the current run of consecutive
    flagged steps (the spike detectors') and the ``clip_flag_*`` fields the current run of ZClip's
    outliers, their mean and population variance over the run. After ``Spikes.warmup`` consecutive
    flags (ZClip: ``ZClip.warmup``), the statistics are re-based on that run (:func:`_flag_run`)."""

    grad_ema: torch.Tensor
    loss_ema: torch.Tensor
    count: torch.Tensor  # healthy steps folded into the averages (int32)
    z_mean: torch.Tensor
    z_var: torch.Tensor
    clip_mean: torch.Tensor
    clip_var: torch.Tensor
    clip_count: torch.Tensor  # finite steps folded into ZClip's statistics (int32)
    flag_run: torch.Tensor  # consecutive flagged steps, not counting non-finite or gradient-less ones (int32)
    flag_norm_mean: torch.Tensor  # over the flagged run: mean and population variance of the norms,
    flag_norm_var: torch.Tensor
    flag_loss_mean: torch.Tensor  # and mean of the losses
    clip_run: torch.Tensor  # consecutive steps ZClip clipped, not counting non-finite or gradient-less ones (int32)
    clip_flag_mean: torch.Tensor  # over that run: mean and population variance of the raw norms
    clip_flag_var: torch.Tensor

    @classmethod
    def fresh(cls, device: torch.device) -> SpikeState:
        z = torch.zeros((), dtype=torch.float32, device=device)
        n = torch.zeros((), dtype=torch.int32, device=device)
        return cls(grad_ema=z.clone(), loss_ema=z.clone(), count=n.clone(), z_mean=z.clone(), z_var=z.clone(),
                   clip_mean=z.clone(), clip_var=z.clone(), clip_count=n.clone(), flag_run=n.clone(),
                   flag_norm_mean=z.clone(), flag_norm_var=z.clone(), flag_loss_mean=z.clone(),
                   clip_run=n.clone(), clip_flag_mean=z.clone(), clip_flag_var=z.clone())


ZCLIP_EPS = 1e-6
"""ZClip's ``eps`` in ``z = (norm - mean) / (std + eps)`` (the reference implementation's)."""


def uses_grad_detector(config: GuardConfig) -> bool:
    """Whether a gradient-norm spike detector runs: the factor (``Spikes.grad_factor``) or the z-score."""
    return config.spikes.grad_factor is not None or config.spikes.grad_zscore is not None


def uses_clipping(config: GuardConfig) -> bool:
    """Whether the decision's clip coefficient is applied: a fixed ``clip_grad_norm`` or ZClip."""
    return config.clip_grad_norm is not None or config.zclip is not None


def _window_weight(count: torch.Tensor, floor: float) -> torch.Tensor:
    """The weight of the newest sample: ``1/(n+1)`` (an exact running mean and variance) until
    it falls to ``floor``, the EMA's ``1 - decay``."""
    return torch.clamp(torch.reciprocal((count + 1).float()), min=floor)


def _fold(mean: torch.Tensor, var: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample into an exponentially weighted mean and variance (West 1979 / Finch 2009):
    ``mean += w*d``, ``var = (1-w)*(var + w*d*d)``, ``d = x - mean``. With ``w = 1/n`` this is the
    exact running mean and population variance of the n samples so far."""
    d = x - mean
    return mean + w * d, (1 - w) * (var + w * d * d)


def _fold_host(mean: float, var: float, x: float, w: float) -> tuple[float, float]:
    """:func:`_fold` on float32 host values, one rounding per operation."""
    d = f32(x - mean)
    wd = f32(w * d)
    return f32(mean + wd), f32(f32(1.0 - w) * f32(var + f32(wd * d)))


def _window_weight_host(count: int, floor: float) -> float:
    return clamp_f32(_reciprocal(f32(float(count + 1))), floor, None)


def _zscore_floor(config: GuardConfig) -> float:
    return 2.0 / (config.spikes.window + 1)


def _flag_run(run: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, x: torch.Tensor, flagged: torch.Tensor,
              ends: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of a run of consecutive flagged steps, and the re-baseline it may trigger.

    A flagged step extends the run and folds ``x`` into the run's mean and population variance
    (weight ``1/n``: exact over the run; the first flag starts them at ``x`` and 0); a step that
    ``ends`` the run (finite, not flagged) sets it to 0; any other step (non-finite, no gradients)
    leaves it as it is. When a flagged step brings the run to ``k``, ``rebase`` is true: the caller
    replaces its statistics with the run's mean and variance, and the run starts again from 0.
    ``mean``, ``var`` and ``x`` may be stacked (one run, several statistics). Returns
    ``(run, mean, var, rebase)``, the state after this step; nothing is written."""
    n = torch.where(flagged, run + 1, torch.where(ends, torch.zeros_like(run), run))
    m, v = _fold(mean, var, x, torch.reciprocal(n.float()))
    first = run == 0
    m = torch.where(flagged, torch.where(first, x, m), mean)
    v = torch.where(flagged, torch.where(first, torch.zeros_like(v), v), var)
    rebase = flagged & (n >= k)
    return torch.where(rebase, torch.zeros_like(n), n), m, v, rebase


def _flag_run_host(run: int, mean: list[float], var: list[float], x: list[float],
                   k: int) -> tuple[int, list[float], list[float], bool]:
    """:func:`_flag_run` of a flagged step, on float32 host values (one list entry per stacked
    statistic). The caller sets the run to 0 on a step that ends it and leaves it on any other."""
    n = run + 1
    if run == 0:
        mean, var = list(x), [0.0] * len(x)
    else:
        w = _reciprocal(f32(float(n)))
        mean, var = (list(t) for t in zip(*(_fold_host(m, v, xi, w) for m, v, xi in zip(mean, var, x))))
    return (0 if n >= k else n), mean, var, n >= k


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
    nan = torch.full((), math.nan, dtype=torch.float32, device=dev)
    grad_spike = loss_spike = rebase = clip_rebase = false
    spike_threshold = clip_threshold = nan
    zscore = config.spikes.grad_zscore  # the z-score detector's threshold (None: off)
    spikes_on = uses_grad_detector(config) or config.spikes.loss_factor is not None
    if spikes_on:
        warm = (spikes.count >= config.spikes.warmup) & ~nonfinite & ~no_grads
        if config.spikes.grad_factor is not None:
            spike_threshold = config.spikes.grad_factor * spikes.grad_ema
        elif zscore:  # mean + k * std over the window of healthy steps
            spike_threshold = spikes.z_mean + zscore * torch.sqrt(spikes.z_var)
        if uses_grad_detector(config):
            grad_spike = warm & (grad_norm > spike_threshold)
        if config.spikes.loss_factor is not None:
            loss_spike = warm & (loss > config.spikes.loss_factor * spikes.loss_ema)
    spike = grad_spike | loss_spike
    skip = (nonfinite | no_grads | spike) if config.spikes.action == "skip" else (nonfinite | no_grads)

    # Indices into stats.REASONS, in order of precedence.
    reason = torch.where(
        loss_bad,
        1.0,
        torch.where(grad_bad, 2.0, torch.where(no_grads, 5.0, torch.where(
            skip & grad_spike, 3.0, torch.where(skip & loss_spike, 4.0, 0.0)))),
    )

    if spikes_on:  # running averages of healthy steps (only kept when a detector needs them)
        healthy = ~nonfinite & ~no_grads & ~spike
        d = config.spikes.decay
        # A NaN loss on a step that is not loss_bad is a loss nobody gave (StepReport.loss None): the
        # loss statistics keep their value instead of turning NaN for ever (and unloadable).
        pair = torch.stack([grad_norm, torch.where(torch.isnan(loss), spikes.loss_ema, loss)])
        ema = torch.stack([spikes.grad_ema, spikes.loss_ema])
        new = torch.where(spikes.count == 0, pair, d * ema + (1 - d) * pair)
        new = torch.where(healthy, new, ema)
        # No lock-out: Spikes.warmup flags in a row re-base the statistics on those steps.
        run, run_mean, run_var, rebase = _flag_run(
            spikes.flag_run, torch.stack([spikes.flag_norm_mean, spikes.flag_loss_mean]),
            torch.stack([spikes.flag_norm_var, torch.zeros_like(spikes.flag_norm_var)]), pair, spike, healthy,
            config.spikes.warmup)
        new = torch.where(rebase, run_mean, new)
        spikes.grad_ema.copy_(new[0])
        spikes.loss_ema.copy_(new[1])
        if zscore:
            w = _window_weight(spikes.count, _zscore_floor(config))
            mean, var = _fold(spikes.z_mean, spikes.z_var, grad_norm, w)
            spikes.z_mean.copy_(torch.where(rebase, run_mean[0], torch.where(healthy, mean, spikes.z_mean)))
            spikes.z_var.copy_(torch.where(rebase, run_var[0], torch.where(healthy, var, spikes.z_var)))
        spikes.count.add_(healthy.int())
        spikes.flag_run.copy_(run)
        spikes.flag_norm_mean.copy_(run_mean[0])
        spikes.flag_loss_mean.copy_(run_mean[1])
        spikes.flag_norm_var.copy_(run_var[0])

    if config.clip_grad_norm is not None:
        # The expression of torch.nn.utils.clip_grad_norm_, so the coefficient is bitwise its.
        clip_coef = torch.clamp(config.clip_grad_norm / (grad_norm + 1e-6), max=1.0)
    elif config.zclip is not None:
        clip_coef, clip_threshold, clip_rebase = _zclip(grad_norm, nonfinite | no_grads, config, spikes)
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
    flags = torch.stack([skip, loss_bad, grad_bad, grad_spike, loss_spike, backoff, growth, floor_hit, no_grads,
                         rebase, clip_rebase])
    thresholds = torch.stack([spike_threshold.reshape(()), clip_threshold.reshape(())])
    out = torch.cat([values.float(), flags.float(), thresholds.float()])
    if out.shape[0] != DECISION_K:  # pragma: no cover - layout invariant (see stats.Dec)
        raise AssertionError("decision vector layout out of date")
    return out, new_tracker


def _zclip(grad_norm: torch.Tensor, bad: torch.Tensor, config: GuardConfig,
           spikes: SpikeState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ZClip (Kumar et al. 2025, "ZClip: Adaptive Spike Mitigation for LLM Pre-Training",
    arXiv:2504.02507; the reference code's default ``mode="zscore"``,
    ``clip_option="adaptive_scaling"``): once ``ZClip.warmup`` finite steps are folded in, a norm
    whose z-score ``z = (norm - mean) / (std + eps)`` exceeds ``ZClip.z`` is clipped to
    ``mean + ZClip.z**2 * std / z`` (the paper's reciprocal: the larger the outlier, the harder it
    is clipped); the norm the step let through (the threshold when clipped) is then folded into the
    EMA mean and variance (``ZClip.alpha``), as the paper updates them. Warm-up folds with weight
    ``1/n`` instead of keeping a buffer: at its end mean and variance are the warm-up norms' mean
    and population variance, as the paper's buffer gives them (up to float32 rounding).
    ``bad``: non-finite or gradient-less steps, which neither clip nor touch the statistics.
    Unlike the paper, the statistics cannot lock themselves out: after ``ZClip.warmup`` clipped
    steps in a row (a lasting shift of the norm's level: folding the thresholds would follow it
    only by ``ZClip.z**2 * std / z`` a step), mean and variance are re-based on the raw norms of
    that run (:func:`_flag_run`); that step is still clipped.
    Returns ``(clip_coef, ceiling, rebase)``: ``ceiling`` is the largest norm this step let through
    (the threshold when clipped, ``mean + ZClip.z * (std + eps)`` otherwise, inf during warm-up);
    ``rebase``: the statistics were re-based this step."""
    mean, var, count = spikes.clip_mean, spikes.clip_var, spikes.clip_count
    zc = config.zclip
    assert zc is not None  # internal: called with ZClip on
    zt = zc.z
    std = torch.sqrt(var)
    spread = std + ZCLIP_EPS
    z = (grad_norm - mean) / spread
    warm = count >= zc.warmup
    outlier = warm & ~bad & (z > zt)
    threshold = mean + (zt * zt) * std / z
    coef = torch.where(outlier, torch.clamp(threshold / (grad_norm + 1e-6), max=1.0), 1.0)
    inf = torch.full((), math.inf, dtype=torch.float32, device=grad_norm.device)
    ceiling = torch.where(warm, torch.where(outlier, threshold, mean + zt * spread), inf)
    # The paper's update after warm-up: mean = a*mean + (1-a)*x, var = a*var + (1-a)*(x - mean)^2 with
    # the new mean; during warm-up the exact running mean and population variance (weight 1/n).
    x = torch.where(outlier, threshold, grad_norm)
    w = torch.where(warm, 1 - zc.alpha, torch.reciprocal((count + 1).float()))
    new_mean, warmup_var = _fold(mean, var, x, w)
    e = x - new_mean
    new_var = torch.where(warm, (1 - w) * var + w * (e * e), warmup_var)
    run, run_mean, run_var, rebase = _flag_run(spikes.clip_run, spikes.clip_flag_mean, spikes.clip_flag_var,
                                               grad_norm, outlier, ~bad, zc.warmup)
    mean.copy_(torch.where(rebase, run_mean, torch.where(bad, mean, new_mean)))
    var.copy_(torch.where(rebase, run_var, torch.where(bad, var, new_var)))
    count.add_((~bad).int())
    spikes.clip_run.copy_(run)
    spikes.clip_flag_mean.copy_(run_mean)
    spikes.clip_flag_var.copy_(run_var)
    return coef, ceiling, rebase


def _zclip_host(grad_norm: float, bad: bool, config: GuardConfig,
                spikes: SpikeState) -> tuple[float, float, bool]:
    """:func:`_zclip` on float32 host values."""
    mean, var, count = spikes.clip_mean.item(), spikes.clip_var.item(), int(spikes.clip_count.item())
    zc = config.zclip
    assert zc is not None  # internal: called with ZClip on
    zt = f32(zc.z)
    rebase = False
    std = _sqrt(spikes.clip_var)
    spread = f32(std + f32(ZCLIP_EPS))
    z = _div(f32(grad_norm - mean), spread)
    warm = count >= zc.warmup
    outlier = warm and not bad and z > zt
    threshold = f32(mean + _div(f32(f32(zc.z * zc.z) * std), z))
    coef = clamp_f32(_div(threshold, f32(grad_norm + f32(1e-6))), None, 1.0) if outlier else 1.0
    ceiling = (threshold if outlier else f32(mean + f32(zt * spread))) if warm else math.inf
    if not bad:
        x = threshold if outlier else grad_norm
        w = f32(1 - zc.alpha) if warm else _reciprocal(f32(float(count + 1)))
        new_mean, new_var = _fold_host(mean, var, x, w)
        if warm:
            e = f32(x - new_mean)
            new_var = f32(f32(f32(1.0 - w) * var) + f32(w * f32(e * e)))
        run = int(spikes.clip_run.item())
        if outlier:
            flags = _flag_run_host(run, [spikes.clip_flag_mean.item()], [spikes.clip_flag_var.item()], [grad_norm],
                                   zc.warmup)
            run, rebase = flags[0], flags[3]
            spikes.clip_flag_mean.fill_(flags[1][0])
            spikes.clip_flag_var.fill_(flags[2][0])
            if rebase:
                new_mean, new_var = flags[1][0], flags[2][0]
            spikes.clip_run.fill_(run)
        elif run:
            spikes.clip_run.fill_(0)
        spikes.clip_mean.fill_(new_mean)
        spikes.clip_var.fill_(new_var)
        spikes.clip_count.fill_(count + 1)
    return coef, ceiling, rebase


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
    spike_threshold = clip_threshold = math.nan
    zscore = config.spikes.grad_zscore  # the z-score detector's threshold (None: off)
    spikes_on = uses_grad_detector(config) or config.spikes.loss_factor is not None
    if spikes_on:
        count = int(spikes.count.item())
        grad_ema, loss_ema = spikes.grad_ema.item(), spikes.loss_ema.item()
        known_loss = loss_ema if math.isnan(loss) else loss  # as decide(): a loss nobody gave moves nothing
        warm = count >= config.spikes.warmup and not nonfinite and not no_grads
        if config.spikes.grad_factor is not None:
            spike_threshold = f32(f32(config.spikes.grad_factor) * grad_ema)
        elif zscore:
            z_mean, z_var = spikes.z_mean.item(), spikes.z_var.item()
            spike_threshold = f32(z_mean + f32(f32(zscore) * _sqrt(spikes.z_var)))
        if uses_grad_detector(config):
            grad_spike = warm and grad_norm > spike_threshold
        if config.spikes.loss_factor is not None:
            loss_spike = warm and loss > f32(f32(config.spikes.loss_factor) * loss_ema)
    spike = grad_spike or loss_spike
    skip = nonfinite or no_grads or spike if config.spikes.action == "skip" else nonfinite or no_grads

    reason = (1.0 if loss_bad else 2.0 if grad_bad else 5.0 if no_grads else 3.0 if skip and grad_spike
              else 4.0 if skip and loss_spike else 0.0)

    rebase = clip_rebase = False
    healthy = not nonfinite and not no_grads and not spike
    if spikes_on and healthy:  # fold it into the averages
        if count == 0:
            grad_ema, loss_ema = grad_norm, known_loss
        else:
            d, e = f32(config.spikes.decay), f32(1 - config.spikes.decay)
            grad_ema = f32(f32(d * grad_ema) + f32(e * grad_norm))
            loss_ema = f32(f32(d * loss_ema) + f32(e * known_loss))
        spikes.grad_ema.fill_(grad_ema)
        spikes.loss_ema.fill_(loss_ema)
        if zscore:
            z_mean, z_var = _fold_host(z_mean, z_var, grad_norm, _window_weight_host(count, _zscore_floor(config)))
            spikes.z_mean.fill_(z_mean)
            spikes.z_var.fill_(z_var)
        spikes.count.fill_(count + 1)
    if spikes_on:  # no lock-out: Spikes.warmup flags in a row re-base the statistics on those steps
        run = int(spikes.flag_run.item())
        if spike:
            run, mean, var, rebase = _flag_run_host(
                run, [spikes.flag_norm_mean.item(), spikes.flag_loss_mean.item()], [spikes.flag_norm_var.item(), 0.0],
                [grad_norm, known_loss], config.spikes.warmup)
            spikes.flag_norm_mean.fill_(mean[0])
            spikes.flag_loss_mean.fill_(mean[1])
            spikes.flag_norm_var.fill_(var[0])
            spikes.flag_run.fill_(run)
            if rebase:
                spikes.grad_ema.fill_(mean[0])
                spikes.loss_ema.fill_(mean[1])
                if zscore:
                    spikes.z_mean.fill_(mean[0])
                    spikes.z_var.fill_(var[0])
        elif healthy and run:
            spikes.flag_run.fill_(0)

    if config.clip_grad_norm is not None:
        # clip_grad_norm_'s ``max_norm / (total_norm + 1e-6)``, clamped at 1 (NaN stays NaN)
        clip_coef = clamp_f32(f32(_reciprocal(f32(grad_norm + f32(1e-6))) * f32(config.clip_grad_norm)), None, 1.0)
    elif config.zclip is not None:
        clip_coef, clip_threshold, clip_rebase = _zclip_host(grad_norm, nonfinite or no_grads, config, spikes)
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
    flags = [skip, loss_bad, grad_bad, grad_spike, loss_spike, backoff, growth, floor_hit, no_grads, rebase,
             clip_rebase]
    out = values + [1.0 if f else 0.0 for f in flags] + [spike_threshold, clip_threshold]
    if len(out) != DECISION_K:  # pragma: no cover - layout invariant (see stats.Dec)
        raise AssertionError("decision vector layout out of date")
    return out, new_tracker


def _sqrt(x: torch.Tensor) -> float:
    """``torch.sqrt`` of a float32 0-d tensor, read to the host. torch's own kernel, not
    ``math.sqrt``: on CPU it is not always correctly rounded (1 ulp off seen, torch 2.13)."""
    return float(torch.sqrt(x).item())


def _div(a: float, b: float) -> float:
    """float32 ``a / b`` of float32 values, as torch divides (IEEE: x/0 is +-inf, 0/0 NaN)."""
    if b == 0:
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1.0, b)
    return f32(a / b)


def _reciprocal(x: float) -> float:
    """``torch.reciprocal`` of a float32 value, in float32 (1/0 is inf, not an exception)."""
    return f32(1.0 / x) if x != 0 else math.copysign(math.inf, x)
