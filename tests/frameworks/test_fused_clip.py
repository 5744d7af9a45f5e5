"""``GuardedOptimizer.clip_grad_norm_`` (issue 26): the framework's clip folded into the fused fast
path (CPU fused AdamW takes ``grad_scale``/``found_inf`` like CUDA's), against the plain GradScaler
loop ``scaler.unscale_`` + ``torch.nn.utils.clip_grad_norm_`` + ``scaler.step``. Real models, real
GradScaler, real accelerate; nothing mocked."""

from __future__ import annotations

import math

import pytest
import torch

import ampguard
from ampguard.integrations.accelerate import GuardedAcceleratedOptimizer

from ..unit._models import loss_of, make_data, make_model
from .test_accelerate import _fresh_accelerate_state, _prepared, _train  # noqa: F401  (the fixture)

pytestmark = pytest.mark.frameworks

CLIP = 0.05  # below the tiny model's gradient norms: the clip bites on every step


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)


def _inner(model: torch.nn.Module, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else False)


def _plain(fused: bool, clips: tuple[float, ...] = (CLIP,), steps: int = 6):
    """The plain loop: per step unscale_, each clip in ``clips``, scaler.step, update. Weights and
    the first clip's returned norms."""
    model = make_model(0)
    opt, scaler, norms = _inner(model, fused), _scaler(), []
    for x, y in make_data(steps):
        scaler.scale(loss_of(model, x, y)).backward()
        scaler.unscale_(opt)
        got = [torch.nn.utils.clip_grad_norm_(model.parameters(), c) for c in clips]
        norms.append(float(got[0]))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


def _guarded(fused: bool, clips: tuple[float, ...] = (CLIP,), steps: int = 6):
    model = make_model(0)
    opt = ampguard.wrap(_inner(model, fused), precision="fp16", scaler=_scaler(), model=model)
    norms, scaled = [], []
    for x, y in make_data(steps):
        opt.backward(loss_of(model, x, y))
        got = [opt.clip_grad_norm_(c) for c in clips]
        scaled.append(opt._measured.scaled)
        norms.append(float(got[0]))
        opt.step()
        opt.zero_grad()
    opt.flush()
    return [p.detach().clone() for p in model.parameters()], norms, opt, scaled


def test_folded_clip_matches_the_plain_loop_with_no_unscale():
    want, want_norms = _plain(fused=True)
    got, norms, opt, scaled = _guarded(fused=True)
    assert all(scaled)  # folded: the gradients were not unscaled by the clip
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert norms == pytest.approx(want_norms, rel=1e-5)
    coefs = [r.clip_coef for r in opt.history]
    assert coefs == pytest.approx([min(1.0, CLIP / (n + 1e-6)) for n in norms], rel=1e-5)
    assert all(c < 1.0 for c in coefs)  # the report's coefficient is the folded clip's


@pytest.mark.parametrize("clips", [(math.inf,), (math.inf, CLIP)], ids=["inf", "inf_then_clip"])
def test_an_inf_clip_is_the_norm_alone_folded_with_no_unscale(clips):
    """``clip_grad_norm_(inf)`` is torch's norm with no clip; transformers 5 asks for it every step with
    ``max_grad_norm=0``, to log the norm, and accelerate's answer unscales, takes the norm and multiplies every
    gradient by 1 (three passes). On the fused path the guard answers with its own measurement: nothing is unscaled,
    the update is the plain loop's, the report's coefficient stays 1. A clip after it in the step is torch's, on
    unscaled gradients, as the plain loop's. Refused (``ValueError``) before."""
    want, want_norms = _plain(fused=True, clips=clips)
    got, norms, opt, scaled = _guarded(fused=True, clips=clips)
    assert all(scaled) if len(clips) == 1 else not any(scaled)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert norms == pytest.approx(want_norms, rel=1e-5)
    assert all(r.clip_coef == 1.0 for r in opt.history)  # the first call's: no clip


def test_fallback_non_fused_is_bitwise_the_plain_loop():
    want, want_norms = _plain(fused=False)
    got, norms, opt, scaled = _guarded(fused=False)
    assert not any(scaled)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert norms == want_norms
    assert all(r.clip_coef < 1.0 for r in opt.history)


def test_a_second_clip_in_the_step_applies_the_first_then_clips_again():
    clips = (0.2, CLIP)
    want, want_norms = _plain(fused=True, clips=clips)
    got, norms, _, scaled = _guarded(fused=True, clips=clips)
    assert not any(scaled)  # the second call unscaled (and applied the first clip)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert norms == pytest.approx(want_norms, rel=1e-5)


def test_a_parameter_subset_falls_back_to_torch():
    model = make_model(0)
    opt = ampguard.wrap(_inner(model, True), precision="fp16", scaler=_scaler(), model=model)
    x, y = make_data(1)[0]
    opt.backward(loss_of(model, x, y))
    first = list(model.parameters())[:2]
    want = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in first])) / 256.0
    norm = opt.clip_grad_norm_(CLIP, parameters=first)
    assert not opt._measured.scaled
    torch.testing.assert_close(norm, want)
    opt.step()


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, -math.inf])
def test_bad_max_norm_is_refused_and_changes_nothing(bad):
    model = make_model(0)
    opt = ampguard.wrap(_inner(model, True), precision="fp16", scaler=_scaler(), model=model)
    x, y = make_data(1)[0]
    opt.backward(loss_of(model, x, y))
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm_(bad)
    assert opt._measured is None
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    opt.step()  # the step is still whole
    opt.flush()
    assert opt.history[0].clip_coef == 1.0


@pytest.mark.parametrize("max_norm", [CLIP, math.inf], ids=["clip", "norm_only"])
def test_accelerate_clip_routes_into_the_guard(max_norm):
    """``norm_only``: transformers 5's ``accelerator.clip_grad_norm_(params, inf)`` (``max_grad_norm=0``) is the guard's
    measurement too; it was accelerate's (an unscale, the norm, a multiply by 1)."""
    steps = {}
    for guarded in (False, True):
        acc, model, opt, sched = _prepared("fp16")
        inner = opt.optimizer
        inner.defaults["fused"] = True
        for group in inner.param_groups:
            group["fused"] = True
        inner._step_supports_amp_scaling = True
        if guarded:
            opt = ampguard.wrap(opt, accelerator=acc, model=model)
            assert isinstance(opt, GuardedAcceleratedOptimizer)
            seen = []
            clip = acc.clip_grad_norm_

            def spy(parameters, max_norm, norm_type=2, _clip=clip, _seen=seen, _guard=opt.guard):  # which clip ran
                out = _clip(parameters, max_norm, norm_type)
                _seen.append(_guard._measured.scaled)
                return out

            acc.clip_grad_norm_ = spy
        steps[guarded] = _train(acc, model, opt, sched, make_data(4), clip=max_norm)
        if guarded:
            assert seen and all(seen)  # the guard's folded clip: accelerate's unscale_ never ran
            assert all(r.clip_coef < 1.0 if max_norm == CLIP else r.clip_coef == 1.0 for r in opt.history)
    for (s0, lr0, _, n0), (s1, lr1, _, n1) in zip(steps[False], steps[True]):
        assert (s0, lr0) == (s1, lr1)
        assert n1 == pytest.approx(n0, rel=1e-5)


def test_which_clips_fold_follows_frozen_parameters_and_added_groups():
    """The fold's test (the given parameters, frozen ones aside, are the guarded ones) against what the
    parameters are at each call: a guarded parameter frozen, then unfrozen; a group added after the wrap
    (the cached ids of the guarded parameters made again). Each unfolded call is torch's clip on unscaled
    gradients, as the plain loop's."""
    model = make_model(0)
    opt = ampguard.wrap(_inner(model, True), precision="fp16", scaler=_scaler(), model=model)
    first = next(model.parameters())
    data = iter(make_data(6))

    def folded(**kwargs) -> bool:
        x, y = next(data)
        opt.backward(loss_of(model, x, y))
        opt.clip_grad_norm_(CLIP, **kwargs)
        scaled = opt._measured.scaled
        opt.step()
        opt.zero_grad()
        return scaled

    assert folded() and folded(parameters=model.parameters())
    first.requires_grad_(False)  # still guarded, no longer trained: not the guarded set any more
    assert not folded() and not folded(parameters=model.parameters())
    first.requires_grad_(True)
    extra = torch.nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra]})  # a guarded parameter outside the model: the model's are a subset
    assert not folded(parameters=model.parameters())
    assert folded(parameters=[*model.parameters(), extra])
