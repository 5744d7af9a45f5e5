"""``torch.save(model)`` (the whole module pickled, PyTorch's "save the entire model") while a guard watches the model.

The hooks ampguard puts on a user's modules were closures, which pickle cannot take: the save raised ``Can't pickle
local object`` whenever one was on the model: with ``GuardConfig.sentinel`` always, after any non-finite step for
``forensics_window`` clean steps (the localizer's hooks), with fp8 monitoring always. A run whose checkpoint code saves
the whole model died on the first NaN the guard had just survived. Now they pickle as inert hooks
(``ampguard.module_hooks``): the loaded model computes the same, watched by nothing, and the guard goes on."""

from __future__ import annotations

import io

import pytest
import torch

import ampguard
from ampguard.module_hooks import Inert


class _Net(torch.nn.Module):
    """A LayerNorm with ``eps=0``: a constant row of the input normalises as 0/0, a genuine NaN in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8, eps=0.0)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x) * 0 + x))  # the constant row reaches the norm as it is


def _hooks(model: torch.nn.Module) -> list[object]:
    return [h for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values()]


def _step(opt: ampguard.GuardedOptimizer, model: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    opt.backward(loss)
    opt.step()
    opt.zero_grad()


def _saved_and_loaded(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)  # raised AttributeError: Can't pickle local object ... before stop 51
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_torch_save_of_the_whole_model_with_the_sentinel_and_armed_forensics():
    torch.manual_seed(0)
    model = _Net()
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.01), model=model, precision="bf16",
                        config={"sentinel": "top"})
    healthy = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    poisoned = healthy.clone()
    poisoned[0] = 3.0  # a constant row: its variance is 0, the norm divides 0 by 0
    _step(opt, model, healthy)
    _step(opt, model, poisoned)
    assert opt.skipped_steps == 1 and opt.anomalies[-1].module == "norm"  # the sentinel named it on the step
    assert opt._forensics.armed and len(_hooks(model)) > 4  # the localizer's hooks beside the sentinel's

    loaded = _saved_and_loaded(model)
    hooks = _hooks(loaded)
    assert len(hooks) == len(_hooks(model)) and all(isinstance(h, Inert) for h in hooks)
    with torch.no_grad():
        assert torch.equal(loaded(healthy), model(healthy))

    _step(opt, model, poisoned)  # the guard's own hooks were not disturbed by the save
    assert opt.skipped_steps == 2 and opt.anomalies[-1].module == "norm"
    opt.close()


def test_torch_save_of_a_float8_model_the_fp8_monitor_watches():
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.01), model=model, precision="bf16", fp8=True,
                        config={"numerics_every": 1})
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    _step(opt, model, x)
    loaded = _saved_and_loaded(model)
    assert _hooks(loaded) and all(isinstance(h, Inert) for h in _hooks(loaded))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(loaded(x), model(x))
    _step(opt, model, x)
    assert len(opt.last_report.fp8) == 6  # the monitor still measures each layer's three casts (every step sampled)
    opt.close()
