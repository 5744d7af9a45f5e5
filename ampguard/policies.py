"""Detectors and the step decision, computed from the gathered statistics: the rule, written once.

:func:`rule` turns the ``[world_size, LOCAL_K]`` matrix every rank gathered into the decision
vector (:class:`~ampguard.stats.Dec`). It is a pure function of that matrix and of state every
rank holds identically, so every rank takes the same decision without talking again. It runs
on either execution of :mod:`ampguard.ops`:

- :func:`decide`: on device tensors (fused optimizers off the CPU), without the host reading a
  single value; on CUDA, replayed from a CUDA graph.
- :func:`decide_host`: on host floats, for the CPU (where reading the matrix costs nothing and
  the rule's tens of tiny tensor ops cost far more than the rule) and for non-fused optimizers after one host copy.
  Every float32 operation is rounded once as torch rounds it, so both give the same decision
  vector, bit for bit, and leave the same carried state (``tests/unit/test_host_decision.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .config import GuardConfig
from .ops import HOST, Ops, TensorOps, Value, f32
from .scale_rule import ScalerView, ScaleState, next_scale
from .stats import DECISION_K, Loc

__all__ = ["ScalerView", "SpikeState", "decide", "decide_host", "rule", "uses_clipping", "uses_grad_detector"]


@dataclasses.dataclass(slots=True)
class SpikeState:
    """Running statistics of the gradient norm and loss (float32, on device): the factor
    detector's averages of healthy steps, the z-score detector's mean and variance of the same
    steps (counted by ``count`` too), and ZClip's mean and variance of the clipped norms.

    No statistic locks itself out: the ``flag_*`` fields follow the current run of consecutive
    flagged steps (the spike detectors') and the ``clip_flag_*`` fields the current run of ZClip's
    outliers, their mean and population variance over the run. After ``Spikes.warmup`` (ZClip:
    ``ZClip.warmup``) consecutive flags, the statistics are re-based on that run (:func:`_flag_run`).

    The factor detector's averages keep the field names ``grad_ema``/``loss_ema`` (the
    checkpoint's keys); they are exponentially weighted running means of healthy steps."""

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


_FLAGS = (Loc.LOSS_NONFINITE, Loc.NONFINITE_TENSORS, Loc.FOUND_INF, Loc.NO_GRADS, Loc.FP8_NONFINITE)
"""The local vector's columns :func:`rule` reads as flags (> 0 on some rank)."""


def uses_grad_detector(config: GuardConfig) -> bool:
    """Whether a gradient-norm spike detector runs: the factor (``Spikes.grad_factor``) or the
    z-score (``Spikes.grad_zscore``)."""
    return config.spikes.grad_factor is not None or config.spikes.grad_zscore is not None


def uses_clipping(config: GuardConfig) -> bool:
    """Whether the decision's clip coefficient is applied: a fixed ``clip_grad_norm`` or ZClip."""
    return config.clip_grad_norm is not None or config.zclip is not None


def _fold(o: Ops, mean: Value, var: Value | None, x: Value, w: Value) -> tuple[Value, Value]:
    """One sample into an exponentially weighted mean and variance (West 1979 / Finch 2009):
    ``mean += w*d``, ``var = (1-w)*(var + w*d*d)``, ``d = x - mean``. With ``w = 1/n`` this is the
    exact running mean and population variance of the n samples so far. ``var`` None: the mean only."""
    d = o.sub(x, mean)
    wd = o.mul(w, d)
    new_var = None if var is None else o.mul(o.sub(1.0, w), o.add(var, o.mul(wd, d)))
    return o.add(mean, wd), new_var


def _zscore_floor(config: GuardConfig) -> float:
    return 2.0 / (config.spikes.window + 1)


def _flag_run(o: Ops, run_t: torch.Tensor, stats: list[tuple[torch.Tensor, torch.Tensor | None, Value]],
              flagged: Value, ends: Value, k: int) -> tuple[Value, list[tuple[Value, Value]]]:
    """One step of a run of consecutive flagged steps, and the re-baseline it may trigger; stores
    the run (``run_t``, carried) and its statistics (each a carried mean and variance tensor).

    A flagged step extends the run and folds each statistic's ``x`` into the run's mean and
    population variance (weight ``1/n``: exact over the run; the first flag starts them at ``x``
    and 0); a step that ``ends`` the run (finite, not flagged) sets it to 0; any other step
    (non-finite, no gradients) leaves it as it is. When a flagged step brings the run to ``k``,
    ``rebase`` is true: the caller replaces its statistics with the run's mean and variance, and
    the run starts again from 0. ``stats``: ``(mean_t, var_t, x)`` per statistic (``var_t`` None:
    its mean only). Returns ``(rebase, [(mean, var)])``: the run's statistics after this step
    (None on the host for a step not flagged: ``rebase`` is then false, and they are not taken)."""
    run = o.value(run_t)
    n = o.where(flagged, run + 1, o.where(ends, 0, run))
    rebase = flagged & (n >= k)
    out: list[tuple[Value, Value]] = [(None, None)] * len(stats)
    if o.may(flagged):  # unflagged, every statistic stays as it is
        w = o.recip(o.to_float(n))
        first = run == 0
        for i, (mean_t, var_t, x) in enumerate(stats):
            mean = o.value(mean_t)
            var = None if var_t is None else o.value(var_t)
            m, v = _fold(o, mean, var, x, w)
            m = o.where(flagged, o.where(first, x, m), mean)
            o.store(mean_t, m, mean)
            if var_t is not None:
                v = o.where(flagged, o.where(first, 0.0, v), var)
                o.store(var_t, v, var)
            out[i] = (m, v)
    o.store(run_t, o.where(rebase, 0, n), run)  # last: on tensors ``run`` is the carried tensor itself
    return rebase, out


# Long (~100 lines) on purpose: the whole decision is one expression graph, captured as one CUDA
# graph and read top to bottom as the rule; split up, it reads worse and captures the same.
def rule(
    o: Ops,
    gathered: torch.Tensor,
    *,
    config: GuardConfig,
    spikes: SpikeState,
    scale_state: ScaleState,
    scaler: ScalerView | None,
    grads_sharded: bool,
    on_skip: Callable[[Any], None] | None = None,
) -> tuple[Value, Value | None]:
    """Decision vector from the gathered local vectors, on tensors or host values (``o``); stores
    the new ``spikes`` and ``scale_state`` in place. Returns ``(decision, new_growth_tracker)``
    (the tracker is None without a scaler). ``on_skip``: called with the step's skip flag as soon as it is made,
    before the reason, the statistics and the scale rule (the step graph's early flag: ``AMPGUARD_EARLY_SKIP``)."""
    g = gathered
    world = g.shape[0]
    cmax, csum = o.columns(g)
    # each flag column's maximum > 0 (on tensors: one comparison). no_grads on any rank: the step is skipped
    # everywhere. fp8_bad: an fp8 cast whose amax or scale was non-finite (or the scale 0) on any rank: its whole
    # tensor was poisoned (torchao's scale = max / amax), whatever the gradients show; skipped, the scale held.
    loss_bad, any_nonfinite, found_inf, no_grads, fp8_bad = o.positive(cmax, _FLAGS)
    loss = csum[Loc.LOSS] if world == 1 else o.div(csum[Loc.LOSS], world)  # x / 1 is x, bit for bit
    # Sharded gradients on several ranks: the global norm adds the squares. One rank, or replicated
    # gradients: equal everywhere when healthy, NaN/inf if any rank's is.
    grad_norm = o.norm(g[:, Loc.GRAD_NORM]) if grads_sharded and world > 1 else cmax[Loc.GRAD_NORM]
    nonfinite_tensors = csum[Loc.NONFINITE_TENSORS]
    if world > 1:  # the count summed over ranks (one rank: csum is cmax, compared above)
        any_nonfinite = nonfinite_tensors > 0
    grad_bad = any_nonfinite | found_inf | o.nonfinite(grad_norm)
    blocked = loss_bad | grad_bad | no_grads | fp8_bad  # skipped whatever the detectors say

    grad_spike = loss_spike = rebase = clip_rebase = o.false
    spike_threshold = clip_threshold = o.nan
    k_std = config.spikes.grad_zscore
    zscore = k_std is not None
    grad_on, loss_on = uses_grad_detector(config), config.spikes.loss_factor is not None
    spikes_on = grad_on or loss_on
    if spikes_on:
        count, grad_ema, loss_ema = o.value(spikes.count), o.value(spikes.grad_ema), o.value(spikes.loss_ema)
        if zscore:
            z_mean, z_var = o.value(spikes.z_mean), o.value(spikes.z_var)
        warm = (count >= config.spikes.warmup) & o.not_(blocked)
        if config.spikes.grad_factor is not None:
            spike_threshold = o.mul(f32(config.spikes.grad_factor), grad_ema)
        elif k_std is not None:  # mean + k * std over the window of healthy steps
            spike_threshold = o.add(z_mean, o.mul(f32(k_std), o.sqrt_of(spikes.z_var)))
        if grad_on:
            grad_spike = warm & (grad_norm > spike_threshold)
        if config.spikes.loss_factor is not None:  # loss_on (written out: mypy narrows the factor by it)
            loss_spike = warm & (loss > o.mul(f32(config.spikes.loss_factor), loss_ema))
    # A detector that is off costs no op: its flag stays o.false (on tensors, each op is a kernel of every step)
    spike = (grad_spike | loss_spike) if grad_on and loss_on else grad_spike if grad_on else loss_spike
    skip = (blocked | spike) if spikes_on and config.spikes.action == "skip" else blocked
    if on_skip is not None:
        on_skip(skip)

    # Indices into stats.REASONS, in order of precedence.
    cases = [(loss_bad, 1.0), (fp8_bad, 6.0), (grad_bad, 2.0), (no_grads, 5.0)]
    if grad_on:
        cases.append((skip & grad_spike, 3.0))
    if loss_on:
        cases.append((skip & loss_spike, 4.0))
    reason = o.first(cases, 0.0)

    if spikes_on:  # running averages of healthy steps (only kept when a detector needs them)
        healthy = o.not_(blocked | spike)
        # A NaN loss on a step that is not loss_bad is a loss nobody gave (StepReport.loss None): the
        # loss statistics keep their value instead of turning NaN for ever (and unloadable).
        known_loss = o.where(o.isnan(loss), loss_ema, loss)
        d, e, first = f32(config.spikes.decay), f32(1 - config.spikes.decay), count == 0
        grad_avg = o.where(healthy, o.where(first, grad_norm, o.add(o.mul(d, grad_ema), o.mul(e, grad_norm))),
                           grad_ema)
        loss_avg = o.where(healthy, o.where(first, known_loss, o.add(o.mul(d, loss_ema), o.mul(e, known_loss))),
                           loss_ema)
        # No lock-out: Spikes.warmup flags in a row re-base the statistics on those steps.
        rebase, ((norm_mean, norm_var), (loss_mean, _)) = _flag_run(
            o, spikes.flag_run, [(spikes.flag_norm_mean, spikes.flag_norm_var, grad_norm),
                                 (spikes.flag_loss_mean, None, known_loss)], spike, healthy, config.spikes.warmup)
        if zscore and (o.may(healthy) or o.may(rebase)):  # neither: mean and variance stay
            w = o.clamp(o.recip(o.to_float(count + 1)), f32(_zscore_floor(config)), None)
            mean, var = _fold(o, z_mean, z_var, grad_norm, w)
            o.store(spikes.z_mean, o.where(rebase, norm_mean, o.where(healthy, mean, z_mean)), z_mean)
            o.store(spikes.z_var, o.where(rebase, norm_var, o.where(healthy, var, z_var)), z_var)
        o.store(spikes.grad_ema, o.where(rebase, norm_mean, grad_avg), grad_ema)
        o.store(spikes.loss_ema, o.where(rebase, loss_mean, loss_avg), loss_ema)
        o.store(spikes.count, o.where(healthy, count + 1, count), count)

    if config.clip_grad_norm is not None:
        # The expression of torch.nn.utils.clip_grad_norm_ (c / t is t.reciprocal() * c), so the
        # coefficient is bitwise its.
        clip_coef = o.clamp(o.mul(o.recip(o.add(grad_norm, f32(1e-6))), f32(config.clip_grad_norm)), None, 1.0)
    elif config.zclip is not None:
        clip_coef, clip_threshold, clip_rebase = _zclip(o, grad_norm, blocked, config, spikes)
    else:
        clip_coef = o.one

    new_tracker = None
    if scaler is not None:
        scale, run = o.value(scaler.scale), o.value(scale_state.overflow_run)
        new_scale, new_tracker, backoff, growth, floor_hit, new_run = next_scale(
            o, scale=scale, growth_tracker=o.value(scaler.growth_tracker), overflow=grad_bad,
            held=skip & o.not_(grad_bad), overflow_run=run, growth_factor=scaler.growth_factor,
            backoff_factor=scaler.backoff_factor, growth_interval=scaler.growth_interval,
            hysteresis=config.hysteresis, min_scale=config.min_scale, max_scale=config.max_scale,
            margin=config.headroom_margin_log2,
            headroom=o.rank_min(g, Loc.HEADROOM, cmax) if config.scale_policy == "headroom" else None)  # NaN: unsampled
        o.store(scale_state.overflow_run, new_run, run)
    else:
        scale = new_scale = o.one
        backoff = growth = floor_hit = o.false

    out = o.vector([loss, grad_norm, nonfinite_tensors, clip_coef, scale, new_scale, reason],
                   [skip, loss_bad, grad_bad, grad_spike, loss_spike, backoff, growth, floor_hit, no_grads, rebase,
                    clip_rebase],
                   [spike_threshold, clip_threshold])
    if len(out) != DECISION_K:  # pragma: no cover - layout invariant (see stats.Dec)
        raise AssertionError("decision vector layout out of date")
    return out, new_tracker


def _zclip(o: Ops, grad_norm: Value, bad: Value, config: GuardConfig,
           spikes: SpikeState) -> tuple[Value, Value, Value]:
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
    only by ``z**2 * std / z`` a step), mean and variance are re-based on the raw norms of
    that run (:func:`_flag_run`); that step is still clipped.
    Returns ``(clip_coef, ceiling, rebase)``: ``ceiling`` is the largest norm this step let through
    (the threshold when clipped, ``mean + z * (std + eps)`` otherwise, inf during warm-up);
    ``rebase``: the statistics were re-based this step."""
    zc = config.zclip
    assert zc is not None  # internal: called only with ZClip on
    mean, var, count = o.value(spikes.clip_mean), o.value(spikes.clip_var), o.value(spikes.clip_count)
    zt = f32(zc.z)
    std = o.sqrt_of(spikes.clip_var)
    spread = o.add(std, f32(ZCLIP_EPS))
    z = o.div(o.sub(grad_norm, mean), spread)
    warm = count >= zc.warmup
    ok = o.not_(bad)
    outlier = warm & ok & (z > zt)
    threshold = coef = 1.0  # the threshold is taken only where outlier: the host skips it on other steps
    if o.may(outlier):
        threshold = o.add(mean, o.div(o.mul(f32(zc.z * zc.z), std), z))
        coef = o.where(outlier, o.clamp(o.div(threshold, o.add(grad_norm, f32(1e-6))), None, 1.0), 1.0)
    ceiling = o.where(warm, o.where(outlier, threshold, o.add(mean, o.mul(zt, spread))), o.inf)
    rebase, ((run_mean, run_var),) = _flag_run(o, spikes.clip_run, [(spikes.clip_flag_mean, spikes.clip_flag_var,
                                                                      grad_norm)], outlier, ok, zc.warmup)
    if o.may(ok):  # bad: nothing is folded, nothing counted
        # The paper's update after warm-up: mean = a*mean + (1-a)*x, var = a*var + (1-a)*(x - mean)^2
        # with the new mean; during warm-up the exact running mean and population variance (weight 1/n).
        x = o.where(outlier, threshold, grad_norm)
        w = o.where(warm, f32(1 - zc.alpha), o.recip(o.to_float(count + 1)))
        new_mean, warmup_var = _fold(o, mean, var, x, w)
        e = o.sub(x, new_mean)
        new_var = o.where(warm, o.add(o.mul(o.sub(1.0, w), var), o.mul(w, o.mul(e, e))), warmup_var)
        o.store(spikes.clip_mean, o.where(rebase, run_mean, o.where(bad, mean, new_mean)), mean)
        o.store(spikes.clip_var, o.where(rebase, run_var, o.where(bad, var, new_var)), var)
        o.store(spikes.clip_count, o.where(bad, count, count + 1), count)
    return coef, ceiling, rebase


def decide(gathered: torch.Tensor, *, config: GuardConfig, spikes: SpikeState, scale_state: ScaleState,
           scaler: ScalerView | None, grads_sharded: bool,
           on_skip: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`rule` on device tensors (``gathered``'s device). No sync."""
    return rule(TensorOps(gathered.device), gathered, config=config, spikes=spikes,
                scale_state=scale_state, scaler=scaler, grads_sharded=grads_sharded, on_skip=on_skip)


def decide_host(gathered: torch.Tensor, *, config: GuardConfig, spikes: SpikeState, scale_state: ScaleState,
                scaler: ScalerView | None, grads_sharded: bool) -> tuple[list[float], int | None]:
    """:func:`rule` on host floats: the decision vector as a list of float32 values, the new growth
    tracker an int. Reads ``gathered``, the carried state and the scaler's tensors to the host
    (``.tolist()``/``.item()``: free on CPU tensors, a sync elsewhere)."""
    return rule(HOST, gathered, config=config, spikes=spikes,
                scale_state=scale_state, scaler=scaler, grads_sharded=grads_sharded)
