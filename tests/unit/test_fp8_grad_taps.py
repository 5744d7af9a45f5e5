"""The grad_output casts taken through the taps by each layer's ``linear_mm_config`` (``ampguard.fp8._Taps.own``), with
no gradient hook on the layers' outputs in eager mode: the same statistics as the hooks' own measurement (a monitor
whose taps someone else's patch has taken out of the path), over torchao's recipes, gradient accumulation, a layer
called twice in one forward, a real NaN gradient, and the fallbacks where the taps cannot tell the layer."""

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
               nan: bool) -> torch.Tensor:
    monitor.begin_step(step)
    for x in batches:  # gradient accumulation where there are two
        y = model(x)
        loss = (y - y.detach()).abs().sqrt().sum() if nan else y.float().square().mean()  # NaN: 0 * inf at 0
        loss.backward()
    return monitor.collect()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("case", ["one", "accumulated", "twice", "nan"])
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
        rows.append(_collected(model, monitor, 0 if sampled else 1, batches, case == "nan"))
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


def test_layers_the_taps_cannot_tell_apart_keep_their_gradient_hooks():
    """Two layers sharing one ``linear_mm_config`` object, and a second monitor on a model the first already owns:
    neither is registered with the taps, their outputs get gradient hooks, and their grad_output casts are measured
    as the owning monitor's are. (Two monitors on one model still share one visit a forward: the last pre-forward
    hook's, so the first monitor's input and weight casts go unmeasured; only grad_output is compared there.)"""
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
    other = _model("tensorwise")
    owner = Fp8Monitor(other, numerics_every=10)
    second = Fp8Monitor(other, numerics_every=10)
    assert owner._owned == [True, True] and second._owned == [False, False]
    owner.begin_step(1)
    second.begin_step(1)
    other(x).square().mean().backward()
    grad = [2, 5]  # fc1.grad_output, fc2.grad_output
    c, d = owner.collect()[grad, 1:3], second.collect()[grad, 1:3]
    assert torch.equal(c, d) and torch.equal(c, b[grad, 1:3])
    for monitor in (shared, alone, owner, second):
        monitor.close()
    assert not any(m is owner for _, m, _ in _TAPS.owners.values())
