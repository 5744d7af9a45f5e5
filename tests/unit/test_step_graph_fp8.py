"""fp8 monitoring on the step graph (issues 28 and 26): the fp8 monitor's non-finite flag is copied into the step
graph's own buffer and the replay puts it in the local vector, where every fp8-monitored step used to take the
stages apart (the measurement's graph, then the local vector and the decision eagerly: ~0.3 ms more host a step on
an H100's MLP). On the CPU with the stand-in capture (tests/unit/_graphs.py, as tests/unit/test_step_graph.py): a
guarded torchao float8 run (``emulate=True``) through the step graph is the run without it, bit for bit, through
real fp8 faults: fp16 grad_output casts that overflow at too high a loss scale (the step's reason is the fp8 cast),
and bf16 activations that overflow into the next layer's rowwise cast."""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import pytest
import torch

import ampguard
from ampguard.stats import LossMeter
from ampguard.vocab import SkipReason

torchao_float8 = pytest.importorskip("torchao.float8")

from tests.unit.test_fp8 import _model as _mlp  # noqa: E402  (16 -> 32 -> 16, float8)
from tests.unit.test_step_graph import _count_through, _Graphs, _reports, _state, _SteadyScaler  # noqa: E402

_OVERFLOW_ROW_STEPS = {5, 11}  # bf16: a batch row of 3e38, whose fc1 output overflows into fc2's rowwise cast


def _run(step_graph: bool, fp16: bool, fused: bool = True, steps: int = 16) -> tuple[list[torch.Tensor], Any, Any]:
    """A guarded float8 run: fp16 with a GradScaler whose first scale (2**40) overflows fc2's grad_output cast and
    whose growth every 3 steps overflows it again, or bf16 (rowwise) with batch rows that overflow at
    _OVERFLOW_ROW_STEPS. The loss is kept in one buffer (on the CPU a tensor's address is malloc's; CUDA's
    allocator gives a steady loop's loss back where it lay), as tests/unit/test_step_graph.py does. ``fused``:
    fused AdamW and the tensor decision; else foreach AdamW and the host decision as CUDA takes it (its step graph
    ends in the host copy's vector; fp16 with test_step_graph's ``_SteadyScaler``, whose ``found_inf`` stays put)."""
    model = _mlp("rowwise" if not fp16 else "tensorwise")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused else {"foreach": True}))
    scaler = ((torch.amp.GradScaler if fused else _SteadyScaler)("cpu", init_scale=2.0**40, growth_interval=3)
              if fp16 else None)
    with mock.patch.dict(os.environ, {"AMPGUARD_STEP_GRAPH": "1" if step_graph else "0"}):  # read at wrap time
        opt = ampguard.wrap(inner, model=model, precision="fp16" if fp16 else "bf16", scaler=scaler,
                            config={"numerics_every": 4})
    assert opt._fp8 is not None
    pipe = opt._pipeline
    if fused:
        pipe.host_decision = False  # the tensor decision, as on CUDA
    else:
        pipe.host_copies = True  # the host decision as CUDA takes it: the local vector on device, one copy
    opt._lagged_reports = True
    graphs = None
    if step_graph:
        graphs = pipe.step_graph = _Graphs(_state(pipe))
        _count_through(pipe, graphs)
    buffer = torch.zeros(())
    gen = torch.Generator().manual_seed(3)
    with mock.patch.object(LossMeter, "kept", staticmethod(lambda loss: buffer.copy_(loss.detach().reshape(())))):
        for i in range(steps):
            x = torch.randn(8, 16, generator=gen)
            if not fp16 and i in _OVERFLOW_ROW_STEPS:
                x[2] = 3e38
            with opt.autocast():
                loss = model(x).float().square().mean()
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=False)  # the gradients kept where they lie, as CUDA's allocator gives them back
    opt.flush()
    weights = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return weights, opt, graphs


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("fp16", [True, False], ids=["fp16", "bf16"])
def test_an_fp8_monitored_run_through_the_step_graph_is_the_run_without_it_bit_for_bit(fp16: bool,
                                                                                       fused: bool) -> None:
    """The foreach case is the host decision's step graph, whose vector dropped the fp8 flag in 4676bd1 (an H100's
    tests/gpu/test_gpu_fp8.py: no fp8 anomaly on an SGD run whose fp16 overflow made an fp8 cast Inf)."""
    want, plain, _ = _run(step_graph=False, fp16=fp16, fused=fused)
    got, guarded, graphs = _run(step_graph=True, fp16=fp16, fused=fused)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)
    # the fp8 steps went through the step graph (all but the sampled numerics steps, 0, 4, 8, 12: stages apart)
    assert graphs.taken >= 10 and graphs.replays >= 8, (graphs.taken, graphs.replays, graphs.captures)
    reports = guarded.history
    skipped = {r.step: r.reason for r in reports if r.skipped}
    if fp16:  # the first scale overflows fc2's grad_output cast; a growth overflows it again later
        assert skipped.get(0) == SkipReason.NONFINITE_FP8 and len(skipped) >= 2
        through = [s for s, r in skipped.items() if s % 4 and r == SkipReason.NONFINITE_FP8]
        assert through, skipped  # an fp8 skip on a step the step graph decided
    else:
        assert set(skipped) == _OVERFLOW_ROW_STEPS
    assert any(not c.finite for r in reports if r.skipped for c in (r.fp8 or ()))
