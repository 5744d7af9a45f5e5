"""The grad_output casts taken through the taps by each layer's ``linear_mm_config`` (``ampguard.fp8._Taps.own``), with
no gradient hook on the layers' outputs in eager mode: the same statistics as the hooks' own measurement (a monitor
whose taps someone else's patch has taken out of the path), over torchao's recipes, gradient accumulation, a layer
called twice in one forward, a real NaN gradient, activation checkpointing, the fallback where the taps cannot tell
the layer, and two monitors of one model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")
from torchao import float8 as torchao_float8

from ampguard.fp8 import _TAPS, Fp8Monitor
from tests.unit.test_fp8 import spy_over_the_taps


class _Twice(torch.nn.Module):
    """fc1, then fc2 applied twice (one weight, two casts of each role a step)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        return self.fc2(torch.tanh(self.fc2(h)))


def _model(recipe: str, twice: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if twice:
        model: torch.nn.Module = _Twice()
    else:
        model = torch.nn.Sequential()
        model.add_module("fc1", torch.nn.Linear(16, 32))
        model.add_module("act", torch.nn.ReLU())
        model.add_module("fc2", torch.nn.Linear(32, 16))
    if recipe == "tensorwise":
        config = torchao_float8.Float8LinearConfig(emulate=True)
    else:
        config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
        config = torchao_float8.Float8LinearConfig(**{**vars(config), "emulate": True})
    return torchao_float8.convert_to_float8_training(model, config=config)


def _collected(model: torch.nn.Module, monitor: Fp8Monitor, step: int, batches: list[torch.Tensor],
               nan: bool, checkpointed: bool = False) -> torch.Tensor:
    monitor.begin_step(step)
    for x in batches:  # gradient accumulation where there are two
        if checkpointed:  # activation checkpointing: the forward runs again inside the backward
            y = torch.utils.checkpoint.checkpoint(model, x.requires_grad_(), use_reentrant=False)
        else:
            y = model(x)
        loss = (y - y.detach()).abs().sqrt().sum() if nan else y.float().square().mean()  # NaN: 0 * inf at 0
        loss.backward()
    return monitor.collect()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("case", ["one", "accumulated", "twice", "nan", "checkpointed"])
@pytest.mark.parametrize("sampled", [False, True])
def test_grad_output_through_the_taps_is_the_hooks_own_measurement(monkeypatch, recipe, case, sampled):
    """Taps (no gradient hook) against hooks (the taps patched over): order, amax and scale bitwise, the sampled
    underflow and range to float32 rounding, for every cast of the step; the grad_output casts ran in both."""
    torch.manual_seed(1)
    batches = [torch.randn(8, 16) * 4 for _ in range(2 if case == "accumulated" else 1)]
    rows = []
    for spied in (False, True):
        model = _model(recipe, twice=case == "twice")
        monitor = Fp8Monitor(model, numerics_every=10)
        if spied:
            spy_over_the_taps(monkeypatch)
        else:
            assert _TAPS.ready() and all(monitor._owned)
        rows.append(_collected(model, monitor, 0 if sampled else 1, [x.clone() for x in batches], case == "nan",
                               checkpointed=case == "checkpointed"))
        monitor.close()
        monkeypatch.undo()
    taps, hooks = rows
    names = [f"{m}.{r}" for m, r in monitor.names]
    grad = [i for i, n in enumerate(names) if n.endswith("grad_output")]
    assert not taps[grad, 0].isnan().any(), "every grad_output cast ran and was taken"
    assert torch.equal(taps[:, :3].nan_to_num(-1.0), hooks[:, :3].nan_to_num(-1.0)), (names, taps, hooks)
    assert torch.allclose(taps[:, 3:], hooks[:, 3:], rtol=1e-6, atol=0, equal_nan=True)
    if case == "nan":  # the NaN gradient enters at the last layer's grad_output: named there, on the step itself
        assert taps[grad, 1].isnan().any() and monitor.nonfinite(taps).item() == 1.0


def test_an_eager_monitored_forward_puts_no_gradient_hook_on_a_layers_output():
    """The gradient hook on each layer's output (what told the monitor a grad_output cast was its layer's) cost ~17 us
    a layer on this CPU, more than all the rest of the unsampled monitor: with the taps in place there is none, and the
    grad_output casts are still measured."""
    model = _model("tensorwise")
    monitor = Fp8Monitor(model, numerics_every=10)
    outputs: list[torch.Tensor] = []
    for _, module in monitor.modules:  # after the monitor's own forward hooks: they have run when these do
        module.register_forward_hook(lambda m, a, out: outputs.append(out))
    monitor.begin_step(1)
    model(torch.randn(8, 16)).square().mean().backward()
    collected = monitor.collect()
    assert len(outputs) == 2 and all(not out._backward_hooks for out in outputs)
    roles = [c.role for c in monitor.decode(collected.tolist())]
    assert roles.count("grad_output") == 2
    monitor.close()


@pytest.mark.parametrize("sampled", [False, True])
def test_a_role_the_taps_did_not_list_is_told_by_its_value(sampled):
    """The taps tell a cast's role by the identity of torchao's ``GemmInputRole`` members, listed at install (stop 53:
    an enum's ``.value`` is a Python descriptor, a call a cast). A role object they did not list (a torchao whose
    ``float8_linear`` exports no ``GemmInputRole``, or a member made anew) falls back to its ``.value``: the same
    statistics as with the list, every role of every layer taken."""
    x = torch.randn(8, 16) * 4
    rows = []
    for listed in (True, False):
        model = _model("tensorwise")
        monitor = Fp8Monitor(model, numerics_every=10)
        assert _TAPS.ready() and len(_TAPS.roles) == 4  # None and torchao 0.18's three members
        listing = dict(_TAPS.roles)
        if not listed:
            _TAPS.roles.clear()  # in place: the wrapper holds this dict
        try:
            rows.append(_collected(model, monitor, 0 if sampled else 1, [x.clone()], False))
        finally:  # put back: the taps (and this dict) outlive the monitor where another monitor still uses them
            _TAPS.roles.update(listing)
            monitor.close()
    listed_rows, fallback_rows = rows
    assert not fallback_rows[:, 0].isnan().any(), "every cast of every layer was taken"
    assert torch.equal(listed_rows.nan_to_num(-1.0), fallback_rows.nan_to_num(-1.0))


def test_layers_sharing_one_config_keep_their_gradient_hooks():
    """Two layers sharing one ``linear_mm_config`` object: the taps cannot tell their grad_output casts apart, so
    neither is registered with them, their outputs get gradient hooks, and the casts are measured as a monitor of
    the same model without the sharing measures them."""
    x = torch.randn(8, 16)
    model = _model("tensorwise")
    model.fc2.linear_mm_config = model.fc1.linear_mm_config  # torchao makes one a layer; somebody shared it
    shared = Fp8Monitor(model, numerics_every=10)
    reference = _model("tensorwise")
    alone = Fp8Monitor(reference, numerics_every=10)
    assert shared._owned == [False, False] and alone._owned == [True, True]
    a, b = (_collected(m, mon, 1, [x], False) for m, mon in ((model, shared), (reference, alone)))
    # the same weights and input: the same casts
    assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0)) and not a[:, 0].isnan().any()
    for monitor in (shared, alone):
        monitor.close()


@pytest.mark.parametrize("sampled", [False, True])
def test_two_monitors_of_one_model_each_measure_every_cast(sampled):
    """Two guards given the same model (two optimizers over its parameters) make two monitors of its layers: each
    measures every cast, as one monitor alone does. Until stop 50 the layer's second pre-forward hook replaced the
    first's visit, and the first monitor's input and weight casts went unmeasured (order NaN, amax 0)."""
    x = torch.randn(8, 16) * 3
    step = 0 if sampled else 1
    reference = _model("tensorwise")
    alone = Fp8Monitor(reference, numerics_every=10)
    expected = _collected(reference, alone, step, [x], False)
    alone.close()
    model = _model("tensorwise")
    first, second = Fp8Monitor(model, numerics_every=10), Fp8Monitor(model, numerics_every=10)
    assert first._owned == second._owned == [True, True]
    first.begin_step(step)
    second.begin_step(step)
    model(x).float().square().mean().backward()
    for monitor in (first, second):
        got = monitor.collect()
        assert torch.equal(got.nan_to_num(-1.0), expected.nan_to_num(-1.0)), (got, expected)
    first.close()
    assert not any(m is first for _, takers in _TAPS.owners.values() for m, _ in takers)
    second.begin_step(step)  # the first closed: the second alone, as before
    model(x).float().square().mean().backward()
    assert torch.equal(second.collect().nan_to_num(-1.0), expected.nan_to_num(-1.0))
    second.close()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_two_guards_given_one_fp8_model_each_report_every_cast():
    """The usage: one model, two optimizers over its parameters, each wrapped with ``model=``; each guard's sampled
    report names all six casts, as one guard's does (before stop 50 the first guard's report held the two
    grad_output casts only)."""
    import ampguard

    def reports(n_guards: int) -> list[list[tuple[str, str, float]]]:
        model = _model("tensorwise")
        params = list(model.parameters())
        parts = [params] if n_guards == 1 else [params[:2], params[2:]]
        guards = [ampguard.wrap(torch.optim.AdamW(p), model=model, precision="bf16", fp8=True) for p in parts]
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 16)).float().square().mean()
        loss.backward()
        for guard in guards:
            guard.step()  # step 0: sampled, its report carries the casts
        out = [[(c.module, c.role, c.amax) for c in guard.last_report.fp8] for guard in guards]
        for guard in guards:
            guard.close()
        return out

    (alone,) = reports(1)
    assert len(alone) == 6
    assert reports(2) == [alone, alone]


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_real_llama_measures_the_same_casts_through_the_taps_as_through_the_hooks(monkeypatch, checkpointing,
                                                                                   sampled):
    """transformers' Llama at a tiny size (2 layers, 14 Float8Linear, 42 casts), with and without its own gradient
    checkpointing: every cast of the step, order, amax and scale bitwise, underflow and range to float32 rounding,
    through the taps (no gradient hook) and through the hooks."""
    transformers = pytest.importorskip("transformers")
    rows = []
    for spied in (False, True):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(config)
        model = torchao_float8.convert_to_float8_training(model, config=torchao_float8.Float8LinearConfig(emulate=True),
                                                          module_filter_fn=lambda m, fqn: fqn != "lm_head")
        if checkpointing:  # the name transformers 5.24 prefers, or the older one
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        monitor = Fp8Monitor(model, numerics_every=10)
        assert len(monitor.modules) == 14
        if spied:
            spy_over_the_taps(monkeypatch)
        monitor.begin_step(0 if sampled else 1)
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        rows.append(monitor.collect())
        monitor.close()
        monkeypatch.undo()
    taps, hooks = rows
    assert not taps[:, 0].isnan().any(), "every cast ran and was measured"
    assert torch.equal(taps[:, :3], hooks[:, :3])
    assert torch.allclose(taps[:, 3:], hooks[:, 3:], rtol=1e-6, atol=0, equal_nan=True)


def test_a_guard_dropped_without_close_takes_its_fp8_monitor_off_the_model():
    """A guard the user drops without ``close()`` (a notebook cell run again, a guard rebuilt after loading a
    checkpoint) is collected; its fp8 monitor must go with it: no hook left on the model, no registration with the
    taps, torchao's functions back once no monitor is left. Before stop 50 the monitor lived on in its hooks and went
    on taking every cast of every step for nobody, one more set a guard rebuilt."""
    import gc
    import weakref

    from torchao.float8 import float8_linear

    import ampguard

    model = _model("tensorwise")
    guard = ampguard.wrap(torch.optim.AdamW(model.parameters()), model=model, precision="bf16", fp8=True)
    monitor = weakref.ref(guard._fp8)
    users = _TAPS.users
    del guard
    gc.collect()
    assert monitor() is None
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in (model.fc1, model.fc2))
    assert id(model.fc1.linear_mm_config) not in _TAPS.owners and _TAPS.users == users - 1
    if _TAPS.users == 0:  # no other test's monitor left open in this process
        assert not getattr(float8_linear.hp_tensor_to_float8_dynamic, "_ampguard_tap", False)
