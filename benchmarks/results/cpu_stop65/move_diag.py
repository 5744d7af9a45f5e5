"""Why tests/gpu/test_gpu_step_graph.py::test_a_loss_and_gradients_that_move_are_measured_where_they_are replays once
(stop 64 and 65, an H100; it passed at stop 62, before 2d60f55 raised MeasureGraph's graphs kept, keys remembered and
capture credits): the test's guarded run step by step (the step graph's counters after each step, the gradients'
addresses, forensics armed), with MeasureGraph's limits as they are and as they were before 2d60f55. Stop 65 ran it
before the gradients were read ahead of zero_grad (its grads@ column was 0 throughout): the run as it is now is for
the next device call. Each run is the process's first or second: allocator states differ between them.
From the repository root, on CUDA: python benchmarks/results/cpu_stop65/move_diag.py"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ampguard.decision_graph import MeasureGraph
from ampguard.forensics.compile import _EagerWhileArmed
from tests.gpu import test_gpu_step_graph as t


def run(label: str) -> None:
    batches = t._batches(16)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    loop = t._Loop(True)
    kept: list[torch.Tensor] = []
    g = loop.opt._pipeline.step_graph
    print(f"== {label}: MAX_GRAPHS={g.MAX_GRAPHS} MAX_KEYS_SEEN={getattr(g, 'MAX_KEYS_SEEN', 16)} "
          f"MAX_CAPTURES={g.MAX_CAPTURES}")
    places: dict[tuple[int, ...], int] = {}
    for i, b in enumerate(batches):
        with loop.opt.autocast():  # _Loop.step, with the gradients' addresses read before zero_grad
            loss = t.F.cross_entropy(loop.model(b[0]), b[1]) * (50.0 if i == t.BAD else 1.0)
        loop.opt.backward(loss)
        grads = tuple(p.grad.data_ptr() if p.grad is not None else 0 for p in loop.model.parameters())
        loop.opt.step()
        loop.opt.zero_grad(set_to_none=True)
        if i >= 8:
            kept += [loss, *(p.grad for p in loop.model.parameters() if p.grad is not None)]
        print(f"step {i:2d}: replays {g.replays:2d} captures {g.captures:2d} misses {g.misses:2d} "
              f"graphs {len(g._graphs):2d} seen {len(g._seen):2d} credit {g.credit:5.2f} "
              f"rested {loop.opt._pipeline._step_graph_rested} armed {_EagerWhileArmed.armed} "
              f"grads@{places.setdefault(grads, len(places))} loss@{loss.data_ptr() % 100000}")
    loop.opt.flush()
    print("skipped:", [r.step for r in loop.opt.history if r.skipped],
          "scales:", [r.loss_scale for r in loop.opt.history][:10])
    loop.opt.close()


run("now")
saved = MeasureGraph.MAX_GRAPHS, MeasureGraph.MAX_KEYS_SEEN, MeasureGraph.MAX_CAPTURES
MeasureGraph.MAX_GRAPHS, MeasureGraph.MAX_KEYS_SEEN, MeasureGraph.MAX_CAPTURES = 4, 16, 8
run("before 2d60f55")
MeasureGraph.MAX_GRAPHS, MeasureGraph.MAX_KEYS_SEEN, MeasureGraph.MAX_CAPTURES = saved
