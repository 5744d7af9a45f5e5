"""PyTorch's own GradScaler tests, ported onto the guard (device-generic, on the CPU).

Each test mirrors one upstream test of ``test/test_torch.py`` / ``test/test_cuda.py`` (pytorch/pytorch:
``test_grad_scaling_*`` with the helpers ``_create_scaling_case``, ``_create_scaling_models_optimizers``
and ``_run_scaling_case``) and is named after it. Upstream compares a GradScaler loop against an
unscaled fp32 control; here the same loop runs three times: the control, torch's own GradScaler
loop, and the guarded loop (``ampguard.wrap(opt, scaler=...)``, the user's calls replaced by
``opt.backward`` / ``opt.step``). The guarded run must give torch's result: parameters, gradients
and optimizer state bit for bit, the same final scale; and, as upstream asserts, the control's
within upstream's tolerance. ``GradScaler("cpu")``, fp16 autocast where upstream autocasts.
Upstream tests that do not apply on one CPU device are listed in docs/design.md ("Stated
differences": GradScaler), with the reason.
"""

from __future__ import annotations

import copy
import itertools
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ampguard

SGD, ADAM, ADAMW = torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW
APIS = ("control", "torch", "guard")


def _create_scaling_models_optimizers(optimizer_ctor: Any = SGD, optimizer_kwargs: dict | None = None,
                                      copies: int = 3) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    """Upstream's ``_create_scaling_models_optimizers``: ``Sequential(Linear(8, 8), Linear(8, 8))``,
    lr 1.0, here in three identical copies (control, torch, guard)."""
    first = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    mods = [first] + [copy.deepcopy(first) for _ in range(copies - 1)]
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return mods, [optimizer_ctor(m.parameters(), **kwargs) for m in mods]


def _create_scaling_case(optimizer_ctor: Any = SGD, optimizer_kwargs: dict | None = None) -> tuple[Any, ...]:
    """Upstream's ``_create_scaling_case``: four (8, 8) batches, MSELoss, the inf on iteration 2."""
    torch.manual_seed(0)
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    mods, opts = _create_scaling_models_optimizers(optimizer_ctor, optimizer_kwargs)
    return mods, opts, data, torch.nn.MSELoss(), 2


def _scaler(enabled: bool = True, **kw: Any) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **{"init_scale": 128.0, "growth_factor": 2.0, "growth_interval": 1,
                                          "enabled": enabled, **kw})


def _guard(opt: torch.optim.Optimizer, model: Any, scaler: torch.amp.GradScaler) -> Any:
    return ampguard.wrap(opt, model=model, scaler=scaler, precision="fp16")


def _same(a: torch.nn.Module, b: torch.nn.Module, oa: Any, ob: Any) -> None:
    """Bit for bit: parameters, gradients, optimizer state."""
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
        assert (pa.grad is None) == (pb.grad is None)
        if pa.grad is not None:
            assert torch.equal(pa.grad, pb.grad)
        sa, sb = oa.state[pa], ob.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k


def _close(a: torch.nn.Module, b: torch.nn.Module, atol: float) -> None:
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=1e-5)


Run = Callable[..., Any]


def _run_scaling_case(run: Run, unskipped: int, skipped: int, atol: float = 1e-7, optimizer_ctor: Any = SGD,
                      optimizer_kwargs: dict | None = None, check_control: bool = True) -> None:
    """Upstream's ``_run_scaling_case``: for a scaler enabled and disabled (the loop unchanged),
    the scale moved ``unskipped`` times by the growth factor and ``skipped`` times by the backoff;
    the scaled run matches the control. Plus: the guarded run is torch's, bit for bit."""
    for enabled in (True, False):
        mods, opts, data, loss_fn, skip_iter = _create_scaling_case(optimizer_ctor, optimizer_kwargs)
        scalers = [_scaler(enabled) for _ in APIS]
        guard = _guard(opts[2], mods[2], scalers[2])
        for api, mod, opt, scaler in zip(APIS, mods, (opts[0], opts[1], guard), scalers):
            run(data, mod, opt, scaler, loss_fn, skip_iter, api)
        expected = 128.0 * 2.0**unskipped * 0.5**skipped if enabled else 1.0
        assert scalers[1].get_scale() == expected
        assert guard.get_scale() == expected
        _same(mods[1], mods[2], opts[1], opts[2])
        if check_control:
            _close(mods[0], mods[2], atol)
        assert guard.skipped_steps == (skipped if enabled else 0)
        guard.close()


def _backward(api: str, opt: Any, scaler: torch.amp.GradScaler, loss: torch.Tensor, **kw: Any) -> None:
    if api == "guard":
        opt.backward(loss, **kw)
    elif api == "torch":
        scaler.scale(loss).backward(**kw)
    else:
        loss.backward(**kw)


def _step(api: str, opt: Any, scaler: torch.amp.GradScaler, i: int, skip_iter: int) -> None:
    if api == "guard":
        opt.step()
    elif api == "torch":
        scaler.step(opt)
        scaler.update()
    elif not scaler.is_enabled() or i != skip_iter:
        opt.step()


def _inject(api: str, model: Any, scaler: torch.amp.GradScaler, i: int, skip_iter: int) -> None:
    if api != "control" and i == skip_iter and scaler.is_enabled():
        with torch.no_grad():
            model[1].weight.grad.fill_(float("inf"))


# ---------------------------------------------------------------------------- autocast


def _grad_scaling_autocast_test(optimizer_ctor: Any, optimizer_kwargs: dict | None = None) -> None:
    """Upstream's ``_grad_scaling_autocast_test``: fp32 control against scaling + autocast (fp16
    here); upstream expects Adam/AdamW to miss the control's atol (it asserts they fail), so the
    control is compared for SGD only. Its ``try_pickle`` round trip: the guarded scaler pickles."""

    def run(data, model, opt, scaler, loss_fn, skip_iter, api):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=api != "control"):
                loss = loss_fn(model(x), y)
            _backward(api, opt, scaler, loss)
            _inject(api, model, scaler, i, skip_iter)
            _step(api, opt, scaler, i, skip_iter)
            if api == "guard":  # try_pickle: the scaler's state travels; the copy is a plain GradScaler
                back = pickle.loads(pickle.dumps(scaler))
                assert back.state_dict() == scaler.state_dict() and not {"step", "update"} & set(vars(back))

    _run_scaling_case(run, unskipped=3, skipped=1, atol=1e-3, optimizer_ctor=optimizer_ctor,
                      optimizer_kwargs=optimizer_kwargs, check_control=optimizer_ctor is SGD)


@pytest.mark.parametrize("optimizer_ctor", [SGD, ADAM, ADAMW])
def test_grad_scaling_autocast(optimizer_ctor: Any) -> None:
    """Mirrors ``test_grad_scaling_autocast``."""
    _grad_scaling_autocast_test(optimizer_ctor)


@pytest.mark.parametrize("optimizer_ctor", [SGD, ADAM, ADAMW])
def test_grad_scaling_autocast_foreach(optimizer_ctor: Any) -> None:
    """Mirrors ``test_grad_scaling_autocast_foreach``."""
    _grad_scaling_autocast_test(optimizer_ctor, {"foreach": True})


@pytest.mark.parametrize("optimizer_ctor", [ADAM, ADAMW])
def test_grad_scaling_autocast_fused(optimizer_ctor: Any) -> None:
    """Mirrors ``test_grad_scaling_autocast_fused`` (the guard's fused fast path)."""
    _grad_scaling_autocast_test(optimizer_ctor, {"fused": True})


@pytest.mark.parametrize(("optimizer_ctor", "amsgrad", "separate_unscale"),
                         list(itertools.product((ADAM, ADAMW), (False, True), (False, True))))
def test_grad_scaling_autocast_fused_optimizers(optimizer_ctor: Any, amsgrad: bool, separate_unscale: bool) -> None:
    """Mirrors ``test_grad_scaling_autocast_fused_optimizers``: a fused optimizer (which unscales in
    its kernel) against the same non-fused one, both under GradScaler(init_scale=128); with and
    without a separate ``unscale_``. Here: the guarded fused run against torch's non-fused loop."""
    kwargs = {"fused": True, "amsgrad": amsgrad}
    mods, opts, data, loss_fn, _ = _create_scaling_case(optimizer_ctor, kwargs)
    control = optimizer_ctor(mods[1].parameters(), lr=1.0, amsgrad=amsgrad, fused=False)
    s_control, s_guard = _scaler(growth_interval=2000), _scaler(growth_interval=2000)
    guard = _guard(opts[2], mods[2], s_guard)
    for x, y in data:
        control.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss_control = loss_fn(mods[1](x), y)
        s_control.scale(loss_control).backward()
        s_control.step(control)
        s_control.update()

        guard.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss_guard = loss_fn(mods[2](x), y)
        guard.backward(loss_guard)
        if separate_unscale:
            s_guard.unscale_(guard)
        guard.step()
        torch.testing.assert_close(loss_control, loss_guard)
        for pc, pg in zip(mods[1].parameters(), mods[2].parameters()):
            torch.testing.assert_close(pc.grad, pg.grad)
            torch.testing.assert_close(pc, pg)
            for k, v in control.state[pc].items():
                torch.testing.assert_close(torch.as_tensor(v).squeeze(), torch.as_tensor(guard.state[pg][k]).squeeze())
    assert s_control.get_scale() == guard.get_scale()
    guard.close()


@pytest.mark.parametrize(("optimizer_ctor", "optimizer_kwargs"), list(itertools.product(
    (ADAM, ADAMW), ({"foreach": False, "fused": False}, {"foreach": True, "fused": False},
                    {"foreach": False, "fused": True}))))
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(optimizer_ctor: Any,
                                                                          optimizer_kwargs: dict) -> None:
    """Mirrors ``test_params_invalidated_with_grads_invalidated_between_unscale_and_step``: gradients
    broken (inf/NaN) after ``unscale_`` are not checked again by ``step``, in torch's loop; the
    guard checks the gradients once too, when they are unscaled (``unscale_`` is where the caller
    says they are final), so both step on them and the parameters become non-finite alike."""
    mods, opts, data, loss_fn, _ = _create_scaling_case(optimizer_ctor, optimizer_kwargs)
    scalers = [_scaler(growth_interval=2000) for _ in APIS]
    # The guard's parameter check (GuardConfig.param_check_every) would stop this run at its first
    # non-finite update (tests/unit/test_integrity.py); off here, to mirror torch's loop, which goes on.
    guard = ampguard.wrap(opts[2], model=mods[2], scaler=scalers[2], precision="fp16",
                          config=ampguard.GuardConfig(param_check_every=None))
    for api, model, opt, scaler in zip(APIS[1:], mods[1:], (opts[1], guard), scalers[1:]):
        for x, y in data:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            _backward(api, opt, scaler, loss)
            scaler.unscale_(opt)
            for j, p in enumerate(model.parameters()):
                p.grad.copy_(torch.full_like(p.grad, torch.inf if j % 2 else torch.nan))
            _step(api, opt, scaler, 0, -1)
        assert all(p.isnan().any() or p.isinf().any() for p in model.parameters())
    assert scalers[1].get_scale() == guard.get_scale()
    guard.close()


def test_grad_scale_will_not_overflow() -> None:
    """Mirrors ``test_grad_scale_will_not_overflow``: growth from 1e38 by 16 would leave float32;
    the scale stays finite (and is torch's)."""
    scales = []
    for api in APIS[1:]:
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 1)
        opt: Any = ADAM(model.parameters())
        scaler = torch.amp.GradScaler("cpu", growth_interval=1, growth_factor=2**4, init_scale=1e38)
        if api == "guard":
            opt = _guard(opt, model, scaler)
        opt.zero_grad()
        x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
        _backward(api, opt, scaler, ((model(x) - y) ** 2).mean())
        _step(api, opt, scaler, 0, -1)
        scale = scaler._scale
        assert scale is not None and torch.isfinite(scale).all()
        scales.append(scaler.get_scale())
    assert scales[0] == scales[1]


# ---------------------------------------------------------------------------- clipping, penalty, accumulation


def _clipping_run(separate_unscale: bool) -> Run:
    """Upstream's clipping loops, max_norm 0.2: ``clip_grad_norm_(params, max_norm * scale)`` on the
    still-scaled gradients; or (``separate_unscale``) ``scaler.unscale_(opt)`` first (the guard's
    ``unscale_``), then ``clip_grad_norm_(max_norm, error_if_nonfinite=False)``."""

    def run(data, model, opt, scaler, loss_fn, skip_iter, api):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            _backward(api, opt, scaler, loss_fn(model(x), y))
            if separate_unscale:
                _inject(api, model, scaler, i, skip_iter)
                if api != "control":
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2, error_if_nonfinite=False)
            else:
                factor = scaler.get_scale() if api != "control" else 1.0
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2 * factor)
                _inject(api, model, scaler, i, skip_iter)
            _step(api, opt, scaler, i, skip_iter)

    return run


def test_grad_scaling_clipping() -> None:
    """Mirrors ``test_grad_scaling_clipping``: the clip on the still-scaled gradients, then the step
    (the guard unscales after the user's clip)."""
    _run_scaling_case(_clipping_run(separate_unscale=False), unskipped=3, skipped=1, atol=1e-5)


def test_grad_scaling_clipping_separate_unscale() -> None:
    """Mirrors ``test_grad_scaling_clipping_separate_unscale``."""
    _run_scaling_case(_clipping_run(separate_unscale=True), unskipped=3, skipped=1)


def test_grad_scaling_clipping_by_the_guard() -> None:
    """``test_grad_scaling_clipping`` with the guard's own clipping (``GuardConfig.clip_grad_norm``)
    instead of the user's clip_grad_norm_ on scaled gradients: torch's loop within float32 rounding
    (the coefficient comes from the unscaled norm, not from ``max_norm * scale`` over the scaled one)."""
    mods, opts, data, loss_fn, skip_iter = _create_scaling_case()
    s_torch, s_guard = _scaler(), _scaler()
    guard = ampguard.wrap(opts[2], model=mods[2], scaler=s_guard, config={"clip_grad_norm": 0.2})
    for i, (x, y) in enumerate(data):
        for api, model, opt, scaler in (("torch", mods[1], opts[1], s_torch), ("guard", mods[2], guard, s_guard)):
            opt.zero_grad()
            _backward(api, opt, scaler, loss_fn(model(x), y))
            if api == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2 * scaler.get_scale())
            _inject(api, model, scaler, i, skip_iter)
            _step(api, opt, scaler, i, skip_iter)
    assert s_torch.get_scale() == guard.get_scale() == 128.0 * 2**3 * 0.5
    _close(mods[1], mods[2], atol=1e-6)
    guard.close()


def test_grad_scaling_penalty() -> None:
    """Mirrors ``test_grad_scaling_penalty``: a gradient penalty from ``autograd.grad`` of the scaled
    loss (``create_graph=True``), unscaled by hand, added to the loss."""

    def run(data, model, opt, scaler, loss_fn, skip_iter, api):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            if api != "control":
                grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
                inv = 1.0 / scaler.get_scale()
                grads = tuple(g * inv for g in grads)
            else:
                grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()  # type: ignore[union-attr]
            _backward(api, opt, scaler, loss)
            _inject(api, model, scaler, i, skip_iter)
            _step(api, opt, scaler, i, skip_iter)

    _run_scaling_case(run, unskipped=3, skipped=1)


def test_grad_scaling_accumulation() -> None:
    """Mirrors ``test_grad_scaling_accumulation``: two backward passes per step, loss / 2."""

    def run(data, model, opt, scaler, loss_fn, skip_iter, api):
        for i, (x, y) in enumerate(data):
            _backward(api, opt, scaler, loss_fn(model(x), y) / 2)
            if (i + 1) % 2 == 0:
                _step(api, opt, scaler, i, -1)
                opt.zero_grad()

    _run_scaling_case(run, unskipped=2, skipped=0)


# ---------------------------------------------------------------------------- several optimizers, one scaler


@pytest.mark.parametrize("enabled", [True, False])
def test_grad_scaling_multiple(enabled: bool) -> None:
    """Mirrors ``test_grad_scaling_multiple``: two models and two optimizers on one GradScaler, both
    receiving gradients from two losses; ``scaler.unscale_(optimizer0)`` as a stress test; the inf in
    model 1 on iteration 2. torch's ``scaler.step(opt0); scaler.step(opt1); scaler.update()``
    becomes ``opt0.step(); opt1.step()`` with one guard per optimizer on the shared scaler: one
    scale update per iteration after the last of them, each optimizer skipped on its own
    gradients. Scale: 128 * 2**3 * 0.5 (torch's), parameters bit for bit torch's."""
    m0, o0, data, loss_fn, skip_iter = _create_scaling_case()
    m1, o1 = _create_scaling_models_optimizers()
    s_torch, s_guard = _scaler(enabled), _scaler(enabled)
    g0, g1 = _guard(o0[2], m0[2], s_guard), _guard(o1[2], m1[2], s_guard)
    runs = (("control", m0[0], m1[0], o0[0], o1[0], s_torch), ("torch", m0[1], m1[1], o0[1], o1[1], s_torch),
            ("guard", m0[2], m1[2], g0, g1, s_guard))
    for api, model0, model1, opt0, opt1, scaler in runs:
        for i, (x, y) in enumerate(data):
            opt0.zero_grad()
            opt1.zero_grad()
            out0, out1 = model0(x), model1(x)
            loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
            loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
            if api == "control":
                loss0.backward(retain_graph=True)
                loss1.backward()
                opt0.step()
                if not enabled or i != skip_iter:
                    opt1.step()
                continue
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            _inject(api, model1, scaler, i, skip_iter)
            scaler.unscale_(opt0)
            if api == "torch":
                scaler.step(opt0)
                scaler.step(opt1)
                scaler.update()
            else:
                opt0.step()
                opt1.step()
    expected = 128.0 * 2.0**3 * 0.5 if enabled else 1.0
    assert s_torch.get_scale() == expected and g0.get_scale() == expected
    for a, b in ((m0[1], m0[2]), (m1[1], m1[2])):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for a, b in ((m0[0], m0[2]), (m1[0], m1[2])):
        _close(a, b, atol=1e-7)
    assert [r.skipped for r in g1.history] == ([False, False, True, False] if enabled else [False] * 4)
    assert not any(r.skipped for r in g0.history)
    if enabled:  # every report gives the scale its gradients were unscaled with: torch's trajectory
        assert [r.loss_scale for r in g1.history] == [128.0, 256.0, 512.0, 256.0]
        assert [r.loss_scale for r in g0.history] == [128.0, 256.0, 512.0, 256.0]
    g0.close()
    g1.close()


# ---------------------------------------------------------------------------- the scaler itself


@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(lazy_init_scale: bool) -> None:
    """Mirrors ``test_grad_scaling_state_dict``: a guarded scaler loads another's state (the guard
    initialises the scale at wrap(), so the scale tensor exists either way) and the guard then
    runs at it; the guard's state_dict carries it."""
    s0 = torch.amp.GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = torch.amp.GradScaler("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7
    if lazy_init_scale:
        s1.scale(torch.full((1,), 4.0))
    model = torch.nn.Linear(2, 2)
    opt = _guard(SGD(model.parameters(), lr=0.1), model, s1)
    s1.load_state_dict(s0.state_dict())
    assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval(),
            s1._init_growth_tracker) == (3.0, 4.0, 0.5, 2, 0)
    opt.backward(model(torch.ones(1, 2)).sum())
    opt.step()
    assert opt.last_report.loss_scale == 3.0
    assert opt.state_dict()["scaler"] == s1.state_dict()
    opt.close()


def test_grad_scaling_scale() -> None:
    """Mirrors ``test_grad_scaling_scale`` (one device here): a guarded scaler scales nested
    iterables of tensors as GradScaler does."""
    model = torch.nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    opt = _guard(SGD(model.parameters(), lr=0.1), model, scaler)
    t0, t1 = torch.full((1,), 4.0), torch.full((1,), 4.0)
    outputs = scaler.scale((t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())]))
    assert all(t.item() == 8.0 for t in (outputs[0], *outputs[1], outputs[2][0], *outputs[2][1]))
    assert scaler._scale is not None and scaler._scale.device == t1.device
    opt.close()


def test_grad_scaling_update_scale() -> None:
    """Mirrors ``test_grad_scaling_update_scale`` (growth 2, backoff 0.25, interval 2, scale 4:
    two clean iterations grow it to 8, an overflow backs it off to 2), through real steps: the
    guard's trajectory and growth tracker are torch's."""
    trajectories = []
    for api in APIS[1:]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt: Any = SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_factor=2.0, backoff_factor=0.25,
                                      growth_interval=2)
        if api == "guard":
            opt = _guard(opt, model, scaler)
        seen = []
        for factor in (1.0, 1.0, float("inf")):  # the third loss is a real inf: every gradient overflows
            opt.zero_grad()
            _backward(api, opt, scaler, model(torch.ones(2, 3)).sum() * factor)
            _step(api, opt, scaler, 0, -1)
            seen.append((scaler.get_scale(), scaler._get_growth_tracker()))
        trajectories.append(seen)
    assert trajectories[0] == trajectories[1] == [(4.0, 1), (8.0, 0), (2.0, 0)]


def test_grad_scaling_unscale() -> None:
    """Mirrors ``test_grad_scaling_unscale`` through the public call (upstream also drives the
    private ``_amp_foreach_non_finite_check_and_unscale_`` kernel, not the guard's to port):
    ``scaler.unscale_(opt)`` on a guarded optimizer divides by the scale, once, and finds an inf."""
    for bad in (False, True):
        model = torch.nn.Linear(4, 2)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        opt = _guard(SGD(model.parameters(), lr=0.1), model, scaler)
        opt.backward(model(torch.ones(1, 4)).sum())
        if bad:
            with torch.no_grad():
                model.bias.grad[0] = float("inf")
        scaled = [p.grad.clone() for p in model.parameters()]
        scaler.unscale_(opt)
        for before, p in zip(scaled, model.parameters()):
            assert torch.equal(p.grad, before * 0.25)
        opt.step()
        assert opt.step_was_skipped is bad
        assert opt.get_scale() == (2.0 if bad else 4.0)
        opt.close()


def _sparse_run(api: str, values: list[torch.Tensor]) -> tuple[torch.nn.Embedding, torch.amp.GradScaler, Any]:
    """Embedding(sparse=True) (gradient rows: ``w`` times how often an index occurs, here
    duplicates, so uncoalesced) under GradScaler(init_scale=4) with SGD; one step per ``w``."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(3, 3, sparse=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    opt: Any = SGD(emb.parameters(), lr=0.1)
    if api == "guard":
        opt = _guard(opt, emb, scaler)
    for w in values:
        opt.zero_grad()
        _backward(api, opt, scaler, (emb(torch.tensor([0, 1, 0, 2])) * w).sum())
        _step(api, opt, scaler, 0, -1)
    return emb, scaler, opt


@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_grad_scaling_unscale_sparse(bad: float | None) -> None:
    """Mirrors ``test_grad_scaling_unscale_sparse``: sparse gradients, finite, with an inf, with a
    NaN, come out as GradScaler leaves them (unscaled; a step skipped and the scale backed off on a
    non-finite one). Here from a real ``nn.Embedding(sparse=True)``; the guard measures the
    coalesced values (the norm of the sparse gradient). Upstream's float16 case reaches GradScaler's
    private ``_unscale_grads_(allow_fp16=True)``; its public ``unscale_`` refuses float16 gradients."""
    w = torch.tensor([16.0, 32.0, 64.0])
    third = w.clone() if bad is None else torch.tensor([16.0, 32.0, bad])
    values = [w, w * 0.5, third, w]
    e_torch, s_torch, _ = _sparse_run("torch", values)
    e_guard, s_guard, opt = _sparse_run("guard", values)
    assert torch.equal(e_torch.weight, e_guard.weight)
    assert s_torch.get_scale() == s_guard.get_scale() == (64.0 if bad is None else 16.0)
    assert [r.skipped for r in opt.history] == [False, False, bad is not None, False]
    grad = e_guard.weight.grad
    assert grad is not None and grad.is_sparse
    dense = grad.to_dense()  # the last step's gradient, unscaled: w per occurrence (index 0 twice)
    assert torch.equal(dense, torch.stack([2 * w, w, w]))
    assert opt.history[0].grad_norm == pytest.approx(float(torch.stack([2 * w, w, w]).norm()), rel=1e-6)
    opt.close()
