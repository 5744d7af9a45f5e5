"""The fused fast path (issue 16): with a GradScaler and a fused optimizer the guard measures the
still-scaled gradients (one read), derives ``found_inf`` from their norms, and hands the fused
optimizer ``grad_scale = scale / clip_coef`` and ``found_inf = skip``: no unscale pass, no clip
pass. Against the plain fused GradScaler loop: bitwise without clipping, within a stated
tolerance with clipping; the same skips and the same scale trajectory; unscaled norms reported.

CPU, fused AdamW, ``GradScaler("cpu")``; autocast in fp16 and in bf16 (a GradScaler under bf16
autocast is unusual but legal: the gradients are fp32 parameters' either way). Every scale here
is a power of two (GradScaler's defaults), where ``norm(g) * (1/scale)`` is exact.
"""

from __future__ import annotations

import math
import os
from typing import Any
from unittest import mock

import pytest
import torch

import ampguard
from ampguard.stats import cpu_norms

from ._models import assert_same, guarded_steps, loss_of, make_data, make_model, snapshot

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SCALER_KW = {"init_scale": 2.0**16, "growth_interval": 3}  # grows, and overflows fp16 naturally
INF_STEPS = (5, 11)  # a real inf in the loss (so in the gradients) on these steps


def fused(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _steps(opt: torch.optim.Optimizer) -> int:
    """The fused optimizer's step count (it does not advance on a step its kernel skipped)."""
    st = opt.state[opt.param_groups[0]["params"][0]]
    return int(st["step"].item()) if "step" in st else 0


def plain_loop(data, dtype: torch.dtype, *, clip: float | None = None, inf_steps=INF_STEPS):
    """``scaler.scale(loss).backward(); [unscale_; clip_grad_norm_;] scaler.step; scaler.update``."""
    model = make_model()
    opt = fused(model)
    scaler = torch.amp.GradScaler("cpu", **SCALER_KW)
    scales, skipped, norms = [], [], []
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_of(model, x, y)
        if i in inf_steps:
            loss = loss * math.inf
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        before = _steps(opt)
        scaler.step(opt)
        skipped.append(_steps(opt) == before)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model, opt, scales, skipped, norms


def unscaled_reference(model: torch.nn.Module, scale: float, clip: float | None) -> tuple[float, list[float]]:
    """What ``clip_grad_norm_`` returns on the unscaled gradients, and their per-tensor norms by
    the guard's CPU norm kernel (``stats.cpu_norms``), computed on copies (the guard's own
    gradients are untouched). ``scale`` a power of two: the multiply by ``1/scale`` is
    GradScaler's unscale, exactly."""
    ghosts = []
    for p in model.parameters():
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.detach().clone() * (1.0 / scale)
        ghosts.append(q)
    per = cpu_norms([q.grad for q in ghosts]).tolist()
    total = torch.nn.utils.clip_grad_norm_(ghosts, clip if clip is not None else math.inf)
    return float(total), per


def same_floats(a, b) -> bool:
    """Bitwise-equal Python floats, any NaN equal to any NaN."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


NORM_RTOL = 1e-4
"""The guard's CPU norms (``sqrt(dot(g, g))``, ``stats.cpu_norms``) against ``clip_grad_norm_``'s
(``vector_norm``): both sum float32 squares, in different orders; each is within 1e-5 and 4e-5 of
a float64 norm on these models (measured, torch 2.13 CPU), so 1e-4 apart at most. Off the CPU
the guard uses clip_grad_norm_'s own kernel and the norms are bitwise (tests/gpu)."""


def close_floats(a, b, rel: float = NORM_RTOL) -> bool:
    """Python floats within ``rel`` of each other; non-finite ones equal (NaN to NaN, inf to inf)."""
    return len(a) == len(b) and all(
        (x == y) or (math.isnan(x) and math.isnan(y)) or (math.isfinite(y) and abs(x - y) <= rel * abs(y))
        for x, y in zip(a, b))


def guarded_loop(data, dtype: torch.dtype, *, clip: float | None = None, inf_steps=INF_STEPS, fast: bool = True,
                 user_unscale: bool = False, host: bool = True, **cfg: Any):
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", **SCALER_KW)
    with mock.patch.dict(os.environ, {"AMPGUARD_FUSED_FAST_PATH": "1" if fast else "0"}):  # read at wrap time
        opt = ampguard.wrap(fused(model), model=model, precision="fp16", scaler=scaler,
                            config={"clip_grad_norm": clip, "param_norms_every": 1, **cfg})
    opt._pipeline.host_decision = host  # False: the tensor (CUDA) decision path, run on CPU
    refs = []
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_of(model, x, y)
        if i in inf_steps:
            loss = loss * math.inf
        opt.backward(loss)
        if user_unscale:
            scaler.unscale_(opt)  # the guard's unscale_(): today's path from here on
        refs.append(unscaled_reference(model, 1.0 if user_unscale else scaler.get_scale(), clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.flush()
    return model, opt, refs


def _fast_steps(opt: ampguard.GuardedOptimizer) -> list[bool]:
    """Spy on the pipeline: whether each step's measurement took the fast path."""
    taken: list[bool] = []
    pipe = opt._pipeline
    measure = pipe.measure

    def spy(guard, **kw):
        m = measure(guard, **kw)
        taken.append(m.scaled)
        return m

    pipe.measure = spy  # type: ignore[method-assign]
    return taken


# ---------------------------------------------------------------------------------- 1. bitwise, no clipping
@pytest.mark.parametrize("host", [True, False], ids=["host-decision", "tensor-decision"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_without_clipping_bitwise_the_plain_fused_loop(precision, host, unscale_calls):
    """Parameters and optimizer state after 24 steps are bitwise the plain fused GradScaler
    loop's, across natural fp16 overflows (growth_interval 3) and injected infs, with the same
    loss-scale sequence; and no unscale pass ran."""
    dtype = DTYPES[precision]
    data = make_data(24)
    ref_model, ref_opt, ref_scales, ref_skipped, _ = plain_loop(data, dtype)
    plain_unscales = len(unscale_calls)
    assert plain_unscales == len(data)  # the plain loop's _check_inf_per_device, once a step
    model, opt, refs = guarded_loop(data, dtype, host=host)
    assert len(unscale_calls) == plain_unscales  # the guard ran no unscale/inf-check pass at all
    assert_same(snapshot(ref_model, ref_opt), snapshot(model, opt))
    assert [r.loss_scale for r in opt.history] == ref_scales
    assert opt.get_scale() == opt.scaler.get_scale()
    assert [r.skipped for r in opt.history] == ref_skipped
    assert any(ref_skipped) and not all(ref_skipped)
    # the reported norm is clip_grad_norm_'s on the unscaled gradients (to float32 rounding on the CPU)
    for r, (total, _) in zip(opt.history, refs):
        assert close_floats([r.grad_norm], [total]) or r.skipped


# ---------------------------------------------------------------------------------- 2. clipping
# Tolerance: the plain loop rounds twice per gradient element, ``(g * 1/scale) * coef`` (the first
# exact for a power-of-two scale); the fast path rounds ``scale / coef`` once and the kernel's
# ``g / grad_scale`` once. So each clipped unscaled gradient element differs by a few float32 ulp
# (relative ~1e-7), and Adam carries that into its moments and the update (lr 1e-2). Observed over
# these 24 steps (torch 2.13 CPU): max |difference| 3.0e-8 in any parameter or state element,
# max relative 6.6e-6 (on elements near zero, of the moments); 4-6 of the 16 tensors bitwise equal.
# Hence atol 1e-6 (33x the observed absolute difference) and rtol 1e-5. The scale trajectory and
# the skips must match exactly: they do not depend on the clipped values.
CLIP_RTOL, CLIP_ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("host", [True, False], ids=["host-decision", "tensor-decision"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_with_clipping_within_tolerance_of_unscale_plus_clip_grad_norm(precision, host, unscale_calls):
    dtype = DTYPES[precision]
    data = make_data(24)
    clip = 0.05
    ref_model, ref_opt, ref_scales, ref_skipped, ref_norms = plain_loop(data, dtype, clip=clip)
    n_plain = len(unscale_calls)
    model, opt, refs = guarded_loop(data, dtype, clip=clip, host=host)
    assert len(unscale_calls) == n_plain  # no unscale pass, no clip pass: folded into grad_scale
    assert [r.loss_scale for r in opt.history] == ref_scales
    assert [r.skipped for r in opt.history] == ref_skipped
    clipped = [r for r in opt.history if not r.skipped and r.clip_coef < 1.0]
    assert clipped, "max_norm 0.05 should clip some steps"
    a, b = snapshot(ref_model, ref_opt), snapshot(model, opt)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=CLIP_RTOL, atol=CLIP_ATOL, msg=k)
    # The reported grad norm: clip_grad_norm_'s return on the same (unscaled) gradients, every
    # step (to float32 rounding: NORM_RTOL); on step 0, where both runs hold the same gradients,
    # the plain loop's; the coefficient is the one that norm gives.
    for r, (total, _) in zip(opt.history, refs):
        if math.isfinite(total):
            assert close_floats([r.grad_norm], [total]), (r.step, r.grad_norm, total)
            assert r.clip_coef == pytest.approx(min(1.0, clip / (r.grad_norm + 1e-6)), rel=1e-6)
    assert close_floats([opt.history[0].grad_norm], [ref_norms[0]])


# ---------------------------------------------------------------------------------- 3. skips and backoff
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_same_steps_are_skipped_and_the_scale_backs_off_the_same(precision):
    dtype = DTYPES[precision]
    data = make_data(16)
    inf_steps = (2, 3, 9)
    _, _, ref_scales, ref_skipped, _ = plain_loop(data, dtype, inf_steps=inf_steps)
    _, opt, _ = guarded_loop(data, dtype, inf_steps=inf_steps)
    hist = list(opt.history)
    assert [r.skipped for r in hist] == ref_skipped
    assert {s for s in inf_steps} <= {r.step for r in hist if r.skipped}
    assert [r.loss_scale for r in hist] == ref_scales
    for r in hist:
        if r.skipped:
            assert r.reason in ("nonfinite_grad", "nonfinite_loss")
            assert r.next_loss_scale == r.loss_scale / 2  # backed off, as GradScaler does


# ---------------------------------------------------------------------------------- 4. taken, and not taken
def test_the_fast_path_is_taken_and_leaves_a_skipped_steps_gradients_scaled(unscale_calls):
    """Taken on every step (spy, and no unscale kernel ran). On a stepped step the fused kernel
    writes the unscaled gradients back into ``.grad`` (torch's fused Adam does, in the plain fused
    loop too); on a skipped step it returns first: ``.grad`` stays scaled, as in the plain loop."""
    data = make_data(4)
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = ampguard.wrap(fused(model), model=model, precision="fp16", scaler=scaler)
    taken = _fast_steps(opt)
    for i, (x, y) in enumerate(data):
        with opt.autocast():
            loss = loss_of(model, x, y)
        scaler.scale(loss).backward()
        if i == 2:  # a non-finite loss with finite gradients: skipped, the scale held
            opt.observe_loss(torch.tensor(math.nan))
        scale = scaler.get_scale()
        scaled = [p.grad.clone() for p in model.parameters()]
        opt.step()
        if i == 2:
            assert opt.step_was_skipped and opt.last_report.reason == "nonfinite_loss"
            for p, g in zip(model.parameters(), scaled):
                assert torch.equal(p.grad, g)  # still scaled, untouched
        else:
            assert not opt.step_was_skipped
            for p, g in zip(model.parameters(), scaled):
                assert torch.equal(p.grad, g / scale)  # unscaled by the kernel (power-of-two scale: exact)
        opt.zero_grad()
    assert taken == [True] * len(data)
    assert unscale_calls == []


@pytest.mark.parametrize("clip", [None, 0.05])
def test_not_taken_after_the_users_unscale_and_then_todays_path(clip, unscale_calls):
    """``scaler.unscale_(opt)`` before ``step()`` (the user's own clipping, accelerate's
    ``clip_grad_norm_``): the gradients are unscaled already, so the step takes today's path;
    the result is bitwise that of ``AMPGUARD_FUSED_FAST_PATH=0`` with or without the user's call."""
    data = make_data(12)
    dtype = torch.float16
    model, opt, _ = guarded_loop(data, dtype, clip=clip, user_unscale=True)
    assert len(unscale_calls) == len(data)  # the user's unscale_, once a step, and no other
    del unscale_calls[:]
    old_model, old_opt, _ = guarded_loop(data, dtype, clip=clip, fast=False)
    assert len(unscale_calls) == len(data)  # today's path: the guard's own unscale_
    assert_same(snapshot(old_model, old_opt), snapshot(model, opt))
    assert [r.loss_scale for r in opt.history] == [r.loss_scale for r in old_opt.history]
    assert same_floats([r.grad_norm for r in opt.history], [r.grad_norm for r in old_opt.history])


def test_not_taken_when_switched_off_or_not_applicable():
    model = make_model()
    assert ampguard.wrap(fused(model), model=model, precision="fp16")._pipeline.fast_capable
    with mock.patch.dict(os.environ, {"AMPGUARD_FUSED_FAST_PATH": "0"}):
        off = ampguard.wrap(fused(model), model=model, precision="fp16")
    assert not off._pipeline.fast_capable
    unfused = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, precision="fp16")
    assert not unfused._pipeline.fast_capable
    no_scaler = ampguard.wrap(fused(model), model=model, precision="bf16")
    assert not no_scaler._pipeline.fast_capable
    taken = _fast_steps(off)
    guarded_steps(off, model, make_data(2))
    assert taken == [False, False]


def test_fp16_gradients_take_todays_path_and_its_error():
    """GradScaler refuses to unscale float16 gradients; the fast path does not take them either
    (their scaled norms would overflow float16): today's path raises GradScaler's own error."""
    model = make_model().half()
    opt = ampguard.wrap(fused(model), model=model, precision="fp16")
    x, y = make_data(1)[0]
    opt.backward(loss_of(model, x.half(), y))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        opt.step()


@pytest.mark.parametrize("value", ["yes", "2", "off"])
def test_the_switch_is_validated(value):
    model = make_model()
    with (mock.patch.dict(os.environ, {"AMPGUARD_FUSED_FAST_PATH": value}),
          pytest.raises(ValueError, match=rf"AMPGUARD_FUSED_FAST_PATH='{value}'; allowed: '0' \(off\) or '1'")):
        ampguard.wrap(fused(model), model=model, precision="fp16")


# ---------------------------------------------------------------------------------- 5. per-parameter norms
@pytest.mark.parametrize("clip", [None, 0.05])
def test_per_parameter_norms_on_the_report_are_the_unscaled_ones(clip):
    data = make_data(10)
    _, opt, refs = guarded_loop(data, torch.float16, clip=clip, inf_steps=(4,))
    seen = 0
    for r, (_, per) in zip(opt.history, refs):
        assert r.param_norms is not None
        if r.skipped:  # step 4, and natural fp16 overflows: non-finite norms name the parameters
            assert not all(math.isfinite(n) for n in r.param_norms)
            assert not all(math.isfinite(n) for n in per)
            continue
        assert list(r.param_norms) == per  # bitwise: norm(g) * 2**-k == norm(g * 2**-k), same kernel
        seen += 1
    assert seen >= len(data) // 2
    # and they are not the scaled norms
    assert max(opt.history[0].param_norms) < 100.0


# ---------------------------------------------------------------------------------- GradScaler's bookkeeping
@pytest.mark.parametrize("bad", [False, True])
def test_grad_scalers_own_update_finds_the_inf_check_recorded(bad):
    """The fast path records its found_inf as GradScaler's inf check for the inner optimizer (what
    GradScaler's fused step records), so GradScaler's own ``update()`` works on it: no "No inf
    checks were recorded", and it backs off exactly when the norms were non-finite."""
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = ampguard.wrap(fused(model), model=model, precision="fp16", scaler=scaler)
    x, y = make_data(1)[0]
    with opt.autocast():
        loss = loss_of(model, x, y)
    opt.backward(loss * math.inf if bad else loss)
    measured = opt._pipeline.measure(opt, fast=True)
    assert measured.scaled
    recorded = scaler._per_optimizer_states[id(opt.optimizer)]["found_inf_per_device"]
    assert [float(t) for t in recorded.values()] == [1.0 if bad else 0.0]
    torch.amp.GradScaler.update(scaler)  # GradScaler's own, not the guard's refusal
    assert scaler.get_scale() == (512.0 if bad else 1024.0)


# ---------------------------------------------------------------------------------- the conservative rule
@pytest.mark.parametrize("fast", [True, False])
def test_a_norm_that_overflows_float32_on_finite_scaled_gradients_skips_on_the_fast_path(fast):
    """Conservative, and documented: torch's norm kernels sum the squares in float32, so a norm
    above sqrt(float32 max) ~ 1.8e19 is inf even where every element is finite. The fast path takes
    the norm of the *scaled* gradients: here each scaled element is 1e19 (norm 1.1e20: inf), so the
    step is skipped and the scale backed off. Today's path unscales first (1e19 / 1024, norm 1.1e17:
    finite) and steps, as the plain GradScaler loop (an element check) would."""
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with mock.patch.dict(os.environ, {"AMPGUARD_FUSED_FAST_PATH": "1" if fast else "0"}):
        opt = ampguard.wrap(fused(model), model=model, precision="fp16", scaler=scaler)
    x, y = make_data(1)[0]
    with opt.autocast():
        loss = loss_of(model, x, y)
    opt.backward(loss)
    model[0].weight.grad.fill_(1e19)  # finite, scaled; norm 1e19 * sqrt(128) > 1.8e19
    assert torch.isfinite(model[0].weight.grad).all()
    opt.step()
    r = opt.last_report
    if fast:
        assert r.skipped and r.reason == "nonfinite_grad" and r.nonfinite_grads == 1
        assert opt.get_scale() == 512.0
    else:
        assert not r.skipped and math.isfinite(r.grad_norm)
        assert opt.get_scale() == 1024.0
