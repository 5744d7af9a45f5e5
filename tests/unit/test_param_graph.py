"""The parameter check (``GuardConfig.param_check_every``) replayed from a graph where the parameters lie
(``StepPipeline.param_graph``, ``GuardedOptimizer._param_amax``): on the CPU through the stand-in capture of
tests/unit/_graphs.py, the path CUDA takes. The parameters stay where they lay (an optimizer updates them in
place), so after the capture at the second check every check is a replay; it must see the values of its own
step (a bit flipped through an integer view after the capture is named on the next check), a dtype changed under
the same address must not replay the old graph, and parameters it cannot key (a subclass, an empty one) are
measured eagerly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard
from ampguard.integrity import amax_per_tensor

from ._graphs import StandInGraphs


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _guard(model: nn.Module, every: int = 2) -> tuple[ampguard.GuardedOptimizer, StandInGraphs]:
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, precision="bf16",
                        config=ampguard.GuardConfig(param_check_every=every))
    graph = opt._pipeline.param_graph = StandInGraphs()
    return opt, graph


def _train(opt: ampguard.GuardedOptimizer, model: nn.Module, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        with opt.autocast():
            loss = F.cross_entropy(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()


def test_checks_after_the_capture_are_replays_of_the_current_values() -> None:
    model = _model()
    opt, graph = _guard(model)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    measured = opt._param_amax

    def recording() -> torch.Tensor:
        out = measured()
        seen.append((out.clone(), amax_per_tensor(list(model.parameters()))))
        return out

    opt._param_amax = recording  # type: ignore[method-assign]
    _train(opt, model, 12)  # checks at steps 0, 2, ..., 10: a first sighting, the capture, four replays
    assert len(seen) == 6 and graph.captures == 1 and graph.replays == 5
    for got, eager in seen:
        assert torch.equal(got, eager)
    assert not torch.equal(seen[1][0], seen[-1][0])  # the weights moved between the capture and the last replay


def test_a_bit_flipped_after_the_capture_is_named_by_the_next_replayed_check() -> None:
    model = _model()
    opt, graph = _guard(model)
    _train(opt, model, 6)
    assert graph.replays >= 1
    with torch.no_grad():
        model[2].weight.view(torch.int32)[1, 4] = 0x7FC00000  # a NaN, written through the integer view
    replays = graph.replays
    with pytest.raises(ampguard.NonFiniteError):
        _train(opt, model, 2)  # step 6 is checked: the weights it updated hold the NaN
    assert graph.replays == replays + 1
    (anomaly,) = [a for a in opt.anomalies if a.kind == "nonfinite_params"]
    assert anomaly.step == 6 and anomaly.params == ("2.weight",)


def test_a_dtype_changed_at_the_same_address_is_not_replayed() -> None:
    model = _model()
    opt, graph = _guard(model)
    _train(opt, model, 4)  # checks at 0 (seen) and 2 (captured)
    assert graph.captures == 1
    weight = model[2].weight
    ptr = weight.data_ptr()
    weight.data = weight.data.view(torch.bfloat16)  # the same storage read as bfloat16: twice the elements
    assert weight.data_ptr() == ptr
    replays = graph.replays
    assert torch.equal(opt._param_amax(), amax_per_tensor(list(model.parameters())))
    assert graph.replays == replays  # eager: a key not seen (the float32 graph would read the bits as float32)


@pytest.mark.parametrize("odd", ["subclass", "empty"])
def test_parameters_it_cannot_key_are_measured_eagerly(odd: str) -> None:
    model = _model()
    if odd == "subclass":
        class Marked(nn.Parameter):
            pass

        model[0].bias = Marked(model[0].bias.detach().clone())
    else:
        model.register_parameter("empty", nn.Parameter(torch.zeros(0)))
    opt, graph = _guard(model)
    _train(opt, model, 8)
    assert graph.captures == 0 and graph.replays == 0
    assert not opt._pipeline.params_graphable()
