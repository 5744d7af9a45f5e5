#!/usr/bin/env python
"""Stop 66: does the fused rule's compiled tail hold in the step graph's captures through a long run of the default
configuration (GradScaler, a 4-layer MLP, fused AdamW, no overflow), or does a capture miss it
(``StepPipeline.fused_rule_capture_misses``)? On the CPU, with tests/unit/_graphs.py's stand-in capture, the tensor
decision forced and the CPU added to ``FUSED_RULE_DEVICES``, as tests/unit/test_fused_rule.py does. A CPU foreach
optimizer measures norms first and takes no step graph, so only the fused one is asked. From the repository root::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop66/rule_misses.py 60
"""

import os
import sys
from typing import Any
from unittest import mock

import torch
from torch._dynamo.utils import counters

import ampguard
from ampguard import pipeline
from ampguard.stats import LossMeter
from tests.unit._graphs import StandInGraphs
from tests.unit.test_step_graph import _state

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
pipeline.FUSED_RULE_DEVICES = ("cuda", "cpu")  # type: ignore[misc]
torch.manual_seed(0)
layers: list[torch.nn.Module] = []
for _ in range(3):
    layers += [torch.nn.Linear(16, 16), torch.nn.GELU()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 4))
x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
with mock.patch.dict(os.environ, {"AMPGUARD_STEP_GRAPH": "1", "AMPGUARD_FUSED_RULE": "1"}):
    opt = ampguard.wrap(inner, model=model, precision="fp16", scaler=torch.amp.GradScaler("cpu"), exporters=[])
pipe = opt._pipeline
pipe.host_decision = False  # the tensor decision, as CUDA takes it
opt._lagged_reports = True
inside = [False]


class Graphs(StandInGraphs):
    def _capture(self, fn: Any, device: torch.device) -> tuple[Any, Any]:
        inside[0] = True
        before = counters["stats"]["unique_graphs"]
        try:
            return super()._capture(fn, device)
        finally:
            inside[0] = False
            print(f"  capture at step {opt.step_count}: {counters['stats']['unique_graphs'] - before} compiled "
                  f"inside it, {pipe.fused_rule_capture_misses} misses so far")


graphs = pipe.step_graph = Graphs(False, "step graph", "AMPGUARD_STEP_GRAPH=0", state=_state(pipe))
pipeline.capturing = lambda device: inside[0]  # type: ignore[assignment]
buf = torch.zeros(())  # the loss kept in one place, as CUDA's caching allocator keeps a steady loop's
with mock.patch.object(LossMeter, "kept", staticmethod(lambda loss: buf.copy_(loss.detach().reshape(())))):
    for _ in range(steps):
        with opt.autocast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=False)
opt.flush()
print(f"{steps} steps: {graphs.replays} replays, {pipe.fused_rule_capture_misses} capture misses, compile failed "
      f"{pipe._compile_failed}, {counters['stats']['unique_graphs']} graphs compiled, "
      f"{sum(r.skipped for r in opt.history)} skipped")
