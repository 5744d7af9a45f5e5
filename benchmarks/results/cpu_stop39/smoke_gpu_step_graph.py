"""Stop 39: a smoke run of tests/gpu/test_gpu_step_graph.py's bitwise test on the CPU, before any device ran it:
``.cuda()`` as the identity, a CPU GradScaler for the test's "cuda" one, the tensor decision forced, reports
decoded lagged as on CUDA, the stand-in capture of tests/unit/test_step_graph.py, and the addresses kept steady as
CUDA's caching allocator keeps them (the kept loss in one buffer, gradients zeroed in place). It checks the test's
own logic (names, expectations), not the capture. Run: PYTHONPATH=$PWD python <this file>"""
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard.guard as guard_module
from ampguard import pipeline
from ampguard.stats import LossMeter
from tests.unit.test_step_graph import _Graphs, _state

torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


class _CPUScaler(torch.amp.GradScaler):
    def __init__(self, device: str = "cpu", **kwargs: object) -> None:
        super().__init__("cpu", **kwargs)  # type: ignore[arg-type]


pipeline_init = pipeline.StepPipeline.__init__


def _pipeline_init(self, **kwargs):  # type: ignore[no-untyped-def]
    pipeline_init(self, **kwargs)
    self.host_decision = False  # CUDA's tensor decision
    if self.step_graph.enabled:
        self.step_graph = _Graphs(_state(self))


guard_init = guard_module.GuardedOptimizer.__init__


def _guard_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    guard_init(self, *args, **kwargs)
    self._lagged_reports = True  # decoded two steps later, as on CUDA


pipeline.StepPipeline.__init__ = _pipeline_init  # type: ignore[method-assign]
guard_module.GuardedOptimizer.__init__ = _guard_init  # type: ignore[method-assign]
buffer = torch.zeros(())
LossMeter.kept = staticmethod(lambda loss: buffer.copy_(loss.detach().float().reshape(())))  # type: ignore[method-assign]

import tests.gpu.test_gpu_step_graph as gpu_test  # noqa: E402  (after the patches it reads at import)

gpu_test.torch = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
gpu_test.torch.amp = types.SimpleNamespace(GradScaler=_CPUScaler)


def _step(self, x, y, scale=1.0):  # type: ignore[no-untyped-def]
    with self.opt.autocast():
        loss = F.cross_entropy(self.model(x), y) * scale
    self.opt.backward(loss)
    self.opt.step()
    self.opt.zero_grad(set_to_none=False)  # the gradients keep their addresses
    return loss


gpu_test._Loop.step = _step  # type: ignore[method-assign]
for precision in ("fp16", "bf16"):  # fused (the foreach case needs GradScaler's found_inf at steady addresses)
    gpu_test.test_the_step_graph_run_is_the_run_without_it_bit_for_bit(precision, True)
    print(precision, "test_the_step_graph_run_is_the_run_without_it_bit_for_bit: passed on the CPU stand-in")
