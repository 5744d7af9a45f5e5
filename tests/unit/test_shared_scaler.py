"""torch's GradScaler patterns on the guard: several optimizers on one scaler, pickling and
deepcopy of a guarded scaler, sparse gradients, and a disabled scaler. Each against torch's own
loop on the same inputs (CPU, ``GradScaler("cpu")``)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

import ampguard

from ._models import one_step

PATCHES = {"step", "unscale_", "update", "scale", "__getstate__"}


def _pair(seed: int, big: float = 1.0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    with torch.no_grad():
        b.weight.mul_(big)
    return a, b


def _data(n: int) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(4, 8) for _ in range(n)]



def _losses(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.float16):
        return a(x).pow(2).mean(), b(x).pow(2).mean()


@pytest.mark.parametrize("decisions", ["host", "tensor", "mixed"])
def test_two_guards_on_one_scaler_give_torchs_multi_optimizer_loop_under_real_fp16_overflow(decisions: str) -> None:
    """torch's ``scaler.step(opt0); scaler.step(opt1); scaler.update()`` against one guard per
    optimizer on the shared scaler. Model 1's weights are large, so its fp16 backward overflows
    at the higher scales (no value injected) while model 0's does only at the first: optimizer 1
    is skipped alone on the others, the scale backs off once per overflowing iteration and grows
    after two clean ones. Old code: the first guard updated the scale and the second unscaled
    with the new one. ``decisions``: the guards decide on the host (CPU's), on device tensors
    (CUDA's fused optimizers: the shared update from device flags), or one of each."""
    data = _data(12)
    scale_kw = {"init_scale": 2.0**16, "growth_interval": 2}
    a_t, b_t = _pair(0, big=20.0)
    s_t = torch.amp.GradScaler("cpu", **scale_kw)
    o0_t, o1_t = torch.optim.SGD(a_t.parameters(), lr=1e-3), torch.optim.SGD(b_t.parameters(), lr=1e-6)
    torch_scales, torch_stepped0, torch_stepped1 = [], [], []
    for x in data:
        o0_t.zero_grad()
        o1_t.zero_grad()
        l0, l1 = _losses(a_t, b_t, x)
        torch_scales.append(s_t.get_scale())
        s_t.scale(l0 + l1).backward()
        before0, before1 = a_t.weight.detach().clone(), b_t.weight.detach().clone()
        s_t.step(o0_t)
        s_t.step(o1_t)
        s_t.update()
        torch_stepped0.append(not torch.equal(before0, a_t.weight))
        torch_stepped1.append(not torch.equal(before1, b_t.weight))

    a_g, b_g = _pair(0, big=20.0)
    s_g = torch.amp.GradScaler("cpu", **scale_kw)
    g0 = ampguard.wrap(torch.optim.SGD(a_g.parameters(), lr=1e-3), model=a_g, scaler=s_g, precision="fp16")
    g1 = ampguard.wrap(torch.optim.SGD(b_g.parameters(), lr=1e-6), model=b_g, scaler=s_g, precision="fp16")
    for g in {"host": (), "tensor": (g0, g1), "mixed": (g1,)}[decisions]:
        g._pipeline.host_decision = False  # the tensor decision (CUDA's), no host floats
    for x in data:
        g0.zero_grad()
        g1.zero_grad()
        l0, l1 = _losses(a_g, b_g, x)
        s_g.scale(l0 + l1).backward()
        g0.step()
        g1.step()
    # the fixture: optimizer 1 skipped alone on some iterations, both on the first
    assert torch_stepped0.count(False) == 1 and torch_stepped1.count(False) > 2
    assert [not r.skipped for r in g0.history] == torch_stepped0
    assert [not r.skipped for r in g1.history] == torch_stepped1
    assert [r.loss_scale for r in g0.history] == [r.loss_scale for r in g1.history] == torch_scales
    assert s_g.get_scale() == s_t.get_scale()
    for p, q in zip([*a_t.parameters(), *b_t.parameters()], [*a_g.parameters(), *b_g.parameters()]):
        assert torch.equal(p, q)
    g0.close()
    g1.close()
    assert not PATCHES & set(vars(s_g))


def test_shared_scaler_partial_iteration_ends_with_scaler_update_and_a_second_step_is_refused() -> None:
    """A GAN-style loop where only one of two guards steps in some iterations: ``scaler.update()``
    ends that iteration, as in torch's loop (same scales); stepping it again without that is
    refused before anything changes."""
    data = _data(4)
    runs = {}
    for api in ("torch", "guard"):
        a, b = _pair(0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        o0: Any = torch.optim.SGD(a.parameters(), lr=1e-2)
        o1: Any = torch.optim.SGD(b.parameters(), lr=1e-2)
        if api == "guard":
            o0 = ampguard.wrap(o0, model=a, scaler=scaler, precision="fp16")
            o1 = ampguard.wrap(o1, model=b, scaler=scaler, precision="fp16")
        scales = []
        for i, x in enumerate(data):
            o0.zero_grad()
            o1.zero_grad()
            l0, l1 = _losses(a, b, x)
            scaler.scale(l0 + (l1 if i % 2 == 0 else 0 * l1)).backward()
            opts = (o0, o1) if i % 2 == 0 else (o0,)
            for o in opts:
                o.step() if api == "guard" else scaler.step(o)
            if api == "torch" or i % 2:
                scaler.update()  # the guards updated on their own where both stepped
            scales.append(scaler.get_scale())
        runs[api] = (scales, [p.detach().clone() for p in [*a.parameters(), *b.parameters()]])
        if api == "guard":
            o0.zero_grad()
            o0.backward(_losses(a, b, data[0])[0])
            o0.step()
            o0.zero_grad()
            o0.backward(_losses(a, b, data[0])[0])
            weights = [p.detach().clone() for p in a.parameters()]
            with pytest.raises(ampguard.GuardStateError, match=r"already stepped.*scaler.update\(\)"):
                o0.step()
            assert all(torch.equal(w, p) for w, p in zip(weights, a.parameters()))
            assert o0.step_count == 5
            o0.close()
            o1.close()
    assert runs["torch"][0] == runs["guard"][0]
    assert all(torch.equal(p, q) for p, q in zip(runs["torch"][1], runs["guard"][1]))


def test_a_second_guard_with_another_scale_rule_is_refused_at_wrap_before_anything_changes() -> None:
    a, b = _pair(0)
    scaler = torch.amp.GradScaler("cpu")
    g0 = ampguard.wrap(torch.optim.SGD(a.parameters(), lr=0.1), model=a, scaler=scaler)
    patched = dict(vars(scaler))
    inner = torch.optim.SGD(b.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"hysteresis=\[2, 1\].*GradScaler of its own"):
        ampguard.wrap(inner, model=b, scaler=scaler, config={"hysteresis": 2})
    with pytest.raises(ValueError, match=r"min_scale=\[8.0, 1.0\]"):
        ampguard.wrap(inner, model=b, scaler=scaler, config={"min_scale": 8.0})
    with pytest.raises(ampguard.GuardStateError, match="already guarded"):
        ampguard.wrap(g0.optimizer, model=a, scaler=scaler)
    assert vars(scaler) == patched
    g0.backward(a(torch.ones(2, 8)).sum())
    g0.step()  # the lone guard: its own update, as before
    assert g0.step_count == 1 and not g0.step_was_skipped
    g0.close()


def test_a_guarded_scaler_pickles_and_deep_copies_as_a_plain_gradscaler() -> None:
    """A guarded GradScaler pickles and deep-copies, as a plain one does; the copy is a plain
    GradScaler (no guard patches) with the scaler's state, and drives torch's own loop."""
    model = torch.nn.Linear(4, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, scaler=scaler)
    opt.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    for twin in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler), copy.copy(scaler)):
        assert type(twin) is torch.amp.GradScaler
        assert not PATCHES & set(vars(twin))
        assert twin.state_dict() == scaler.state_dict()
        other = torch.nn.Linear(4, 2)
        before = other.weight.detach().clone()
        plain = torch.optim.SGD(other.parameters(), lr=0.1)
        twin.scale(other(torch.ones(2, 4)).sum()).backward()
        twin.step(plain)
        twin.update()
        assert not torch.equal(before, other.weight)
        assert twin.state_dict()["_growth_tracker"] == 2
    assert scaler.state_dict()["_growth_tracker"] == 1  # the original is the guard's still
    with pytest.raises(ampguard.GuardStateError, match=r"scaler.step\(opt\)"):
        scaler.step(opt)
    opt.close()


@pytest.mark.parametrize("numerics_every", [None, 1])
def test_sparse_gradients_are_measured_and_clipped_as_their_coalesced_values(numerics_every: int | None) -> None:
    """``nn.Embedding(sparse=True)`` with repeated indices (an uncoalesced gradient) and the
    guard's clipping: the norm is the sparse gradient's, the clip scales it, and a real overflow
    (a loss scale of 2**125: the scaled gradient values leave float32) is skipped and backed off,
    the weights untouched."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 3, sparse=True)
    start = emb.weight.detach().clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**125)
    opt = ampguard.wrap(torch.optim.SGD(emb.parameters(), lr=0.5), model=emb, scaler=scaler, precision="fp16",
                        config={"clip_grad_norm": 1.0, "numerics_every": numerics_every})
    idx = torch.tensor([1, 3, 1, 1])
    w = torch.tensor([3.0, -4.0, 12.0])
    opt.backward((emb(idx) * w).sum())  # scaled by 2**125: 12 * 2**125 overflows float32
    opt.step()
    assert opt.step_was_skipped and opt.get_scale() == 2.0**124 and torch.equal(emb.weight, start)
    opt.zero_grad()
    opt.backward((emb(idx) * w).sum())
    opt.step()
    dense = torch.zeros(5, 3)
    dense[1], dense[3] = 3 * w, w
    norm = float(dense.norm())
    assert not opt.step_was_skipped and opt.last_report.grad_norm == pytest.approx(norm, rel=1e-6)
    expected = start - 0.5 * dense * (1.0 / (norm + 1e-6))
    torch.testing.assert_close(emb.weight.detach(), expected)
    opt.close()


def test_a_disabled_scaler_is_a_pass_through_as_in_torchs_enabled_use_amp_idiom() -> None:
    """``GradScaler(enabled=False)`` with precision="fp16" (torch's ``enabled=use_amp``): accepted;
    no loss scaling, as that scaler does; torch's calls on it still work (its ``step(opt)`` calls
    ``opt.step()``, which is the guarded step). Bit for bit the plain disabled-scaler loop."""
    data = _data(3)
    weights = []
    for api in ("torch", "guard", "guard-via-scaler"):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.1)
        if api != "torch":
            opt = ampguard.wrap(opt, model=model, scaler=scaler, precision="fp16")
            assert opt.scaler is None and opt.get_scale() == 1.0 and opt.precision == "fp16"
        for x in data:
            opt.zero_grad()
            one_step(api == "guard", opt, scaler, model(x).pow(2).mean())
        if api != "torch":
            assert opt.step_count == 3 and opt.last_report.loss_scale == 1.0
            opt.close()
        weights.append(model.weight.detach().clone())
    assert torch.equal(weights[0], weights[1]) and torch.equal(weights[0], weights[2])


def test_sparse_gradients_with_a_fused_optimizer_raise_torchs_own_error() -> None:
    """No fused kernel takes sparse gradients: the guard's fused fast path hands them to today's
    path, and the user sees what torch's own loop says, not a norm kernel's complaint."""
    messages = []
    for api in ("torch", "guard"):
        emb = torch.nn.Embedding(4, 2, sparse=True)
        scaler = torch.amp.GradScaler("cpu")
        opt: Any = torch.optim.Adam(emb.parameters(), lr=0.1, fused=True)
        if api == "guard":
            opt = ampguard.wrap(opt, model=emb, scaler=scaler)
        loss = emb(torch.tensor([1, 1])).sum()
        with pytest.raises(RuntimeError) as err:
            one_step(api == "guard", opt, scaler, loss)
        messages.append(str(err.value))
    assert "does not support sparse" in messages[0] and messages[0] == messages[1]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_iterations_one_update_runs_where_the_scale_lives(device: str) -> None:
    """``SharedScaler.flush`` after host decisions (bool flags): on a CPU scaler the rule runs on
    host values; on any other device it runs on the scale's own tensors, reading nothing to the
    host (before, it read the scale and growth tracker with ``.item()``: a wait on CUDA; the meta
    device stands in for CUDA here, where ``.item()`` raises)."""
    from ampguard.config import GuardConfig
    from ampguard.scale_rule import ScalerView
    from ampguard.shared_scaler import SharedScaler

    applied: list[tuple[Any, Any]] = []

    class Member:
        config = GuardConfig(min_scale=1.0)

        @staticmethod
        def view() -> ScalerView:
            tracker = torch.full((), 1, dtype=torch.int32, device=device)
            return ScalerView(torch.full((), 1024.0, device=device), tracker, 2.0, 0.5, 2)

        @staticmethod
        def _apply(scale: Any, tracker: Any) -> None:
            applied.append((scale, tracker))

    hub = SharedScaler(torch.amp.GradScaler("cpu"))
    hub.members = [Member(), Member()]  # type: ignore[list-item]
    hub.pending = {1: (False, False), 2: (False, True)}  # held: one guard skipped without an overflow
    hub.flush()
    hub.pending = {1: (False, False), 2: (False, False)}  # clean: the tracker reaches the interval
    hub.flush()
    hub.pending = {1: (True, True), 2: (False, False)}  # an overflow backs off
    hub.flush()
    if device == "cpu":
        assert applied == [(1024.0, 1), (2048.0, 0), (512.0, 0)]
    else:
        assert all(s.device.type == t.device.type == device for s, t in applied)
        assert [s.shape for s, _ in applied] == [torch.Size([])] * 3
