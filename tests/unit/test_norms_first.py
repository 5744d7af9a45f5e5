"""Non-fused optimizers on the CPU (``StepPipeline.norms_first``): the guard reads the norms from the
still-scaled gradients fresh from the backward and unscales them with one multiply, instead of
GradScaler's check-and-unscale followed by a second read for the norms. A step whose scaled norms are
not all finite goes to GradScaler's element check (today's path). Held against the plain GradScaler
loop (``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``), bit for bit: parameters,
optimizer state, the loss-scale sequence and ``.grad`` after each step, across natural fp16 overflows
(growth_interval 3) and a real inf in the loss."""

from __future__ import annotations

import math
import os
from unittest import mock

import pytest
import torch

import ampguard

from ._models import NON_FUSED, assert_same, loss_of, make_data, make_model, one_step, snapshot

INF_STEPS = (5, 11)


def _run(kind: str, data, guarded: bool, *, fast: bool = True, host: bool = True):
    model = make_model()
    opt = NON_FUSED[kind](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    if guarded:
        with mock.patch.dict(os.environ, {"AMPGUARD_FUSED_FAST_PATH": "1" if fast else "0"}):  # read at wrap time
            opt = ampguard.wrap(opt, model=model, precision="fp16", scaler=scaler)
        opt._pipeline.host_decision = host  # False: the tensor decision path (GradScaler's own step), on CPU
    scales, grads = [], []
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, x, y)
        if i in INF_STEPS:
            loss = loss * math.inf
        scales.append(scaler.get_scale())
        if guarded:
            opt.backward(loss)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.zero_grad(set_to_none=True)
    return model, opt, scales, grads


@pytest.mark.parametrize("host", [True, False], ids=["host-decision", "tensor-decision"])
@pytest.mark.parametrize("kind", list(NON_FUSED))
def test_bitwise_the_plain_loop_and_one_unscale_pass_only_on_non_finite_steps(kind, host, unscale_calls):
    data = make_data(24)
    p_model, p_opt, p_scales, p_grads = _run(kind, data, guarded=False)
    plain_calls = len(unscale_calls)
    del unscale_calls[:]
    g_model, g_opt, g_scales, g_grads = _run(kind, data, guarded=True, host=host)
    assert_same(snapshot(p_model, p_opt), snapshot(g_model, g_opt.optimizer))
    assert g_scales == p_scales
    for step, (a, b) in enumerate(zip(p_grads, g_grads)):  # .grad as the plain loop leaves it, unscaled
        assert all(torch.equal(x, y) or (x.isnan().any() and torch.equal(x.isnan(), y.isnan()))
                   for x, y in zip(a, b)), step
    skipped = [r.step for r in g_opt.history if r.skipped]
    assert set(INF_STEPS) <= set(skipped) and len(skipped) < len(data)
    assert plain_calls == len(data)
    assert len(unscale_calls) == len(skipped)  # GradScaler's element check ran on the non-finite steps only


def test_switched_off_it_is_todays_path_with_the_same_result(unscale_calls):
    data = make_data(12)
    off_model, off_opt, off_scales, _ = _run("adamw", data, guarded=True, fast=False)
    assert not off_opt._pipeline.norms_first and len(unscale_calls) == len(data)
    on_model, on_opt, on_scales, _ = _run("adamw", data, guarded=True)
    assert on_opt._pipeline.norms_first
    assert_same(snapshot(off_model, off_opt.optimizer), snapshot(on_model, on_opt.optimizer))
    assert on_scales == off_scales
    # the reported norms too: scaled norms times 1/scale (a power of two) are the unscaled ones, bit for bit
    assert repr([r.grad_norm for r in on_opt.history]) == repr([r.grad_norm for r in off_opt.history])


def _overflowing_squares_run(kind: str, guarded: bool):
    """Gradients of ~1e16, finite, whose squares overflow float32 once scaled by 2**16 (~1e42; unscaled ~1e32 is
    finite): a real forward in float32 against targets of ~1e16, GradScaler on. The scaled norms come out infinite;
    the plain loop's element check finds every value finite and steps."""
    model = make_model()
    opt = NON_FUSED[kind](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    if guarded:
        opt = ampguard.wrap(opt, model=model, precision="fp16", scaler=scaler)
    g = torch.Generator().manual_seed(3)
    grads, big = [], []
    for _ in range(4):
        x, y = torch.randn(4, 8, generator=g), 1e16 * torch.randn(4, 1, generator=g)
        loss = loss_of(model, x, y)
        if guarded:
            opt.backward(loss)
            scaled = [p.grad.double().square().sum().item() for p in model.parameters()]
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaled = [p.grad.double().square().sum().item() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
        big.append(max(scaled) > torch.finfo(torch.float32).max)
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.zero_grad(set_to_none=True)
    return model, opt, grads, big


@pytest.mark.parametrize("kind", list(NON_FUSED))
def test_finite_gradients_whose_scaled_squares_overflow_are_stepped_on_as_in_the_plain_loop(kind, unscale_calls):
    """The norms read as each gradient is unscaled (stop 67, ``stats.cpu_norms``'s ``unscale_by``): a step whose
    scaled norms overflow goes to GradScaler's element check on the gradients unscaled already, which finds nothing,
    and the step is taken on the values the plain loop steps on (not unscaled twice)."""
    p_model, p_opt, p_grads, p_big = _overflowing_squares_run(kind, guarded=False)
    del unscale_calls[:]
    g_model, g_opt, g_grads, g_big = _overflowing_squares_run(kind, guarded=True)
    assert p_big == g_big and all(g_big)  # the case is real: every step's scaled squares overflow float32
    assert all(math.isfinite(r.grad_norm) and not r.skipped for r in g_opt.history)
    assert_same(snapshot(p_model, p_opt), snapshot(g_model, g_opt.optimizer))
    for a, b in zip(p_grads, g_grads):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len(unscale_calls) == len(g_grads)  # GradScaler's element check, once a step


def test_a_sparse_gradient_after_dense_ones_leaves_them_unscaled_once():
    """A dense gradient ahead of a sparse one (``nn.Embedding(sparse=True)`` after a ``Linear``, SGD): no norm kernel
    takes the sparse one, so the step goes to today's path; the dense gradients must not have been unscaled on the
    way there (stop 67: each gradient is unscaled right after its dot), or today's path unscales them twice. Held
    to the plain loop, bit for bit."""
    runs = []
    for guarded in (False, True):
        torch.manual_seed(0)
        lin, emb = torch.nn.Linear(3, 1), torch.nn.Embedding(4, 3, sparse=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        opt: torch.optim.Optimizer = torch.optim.SGD([*lin.parameters(), *emb.parameters()], lr=0.1)
        if guarded:
            opt = ampguard.wrap(opt, model=torch.nn.ModuleList([lin, emb]), precision="fp16", scaler=scaler)
        for _ in range(3):
            one_step(guarded, opt, scaler, lin(emb(torch.tensor([0, 1, 0, 3]))).sum())
            opt.zero_grad(set_to_none=True)
        runs.append([p.detach().clone() for p in (*lin.parameters(), *emb.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
