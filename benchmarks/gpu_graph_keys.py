#!/usr/bin/env python
"""On CUDA: why a graph keyed by addresses replays or misses. Trains the GPU step-graph test's model
(``tests/gpu/test_gpu_step_graph.py``: 64-256-256-10, batch 32, the loss times 50 at step 15) for 24 steps in each
precision and optimizer, and logs every ``MeasureGraph.run`` call of the guard's graphs: which graph, the place of
the gradients (a letter per distinct tuple of their addresses), and what the call did (``e``: a first sighting, run
eagerly; ``C``: captured; ``R``: replayed; ``-``: off). Variants, each a fresh guard in the same process:

- ``as-is``: the code as it is;
- ``empty-cache``: each capture preceded by ``torch.cuda.synchronize()`` and ``torch.cuda.empty_cache()``, what
  ``torch.cuda.graph`` did before stop 40's ``captured()`` (to tell whether handing the cached blocks back made
  the gradients' places steadier);
- ``set-to-none=False``: the loop zeroes the gradients in place (their places cannot move);
- ``overflows``: GradScaler's scale starts at 2**24, so the first steps overflow for real (as the GPU tests' runs);
- ``stages``: the step graph off (``AMPGUARD_STEP_GRAPH=0``), the last report read after every step (as
  ``tests/gpu/test_gpu_measure_graph.py`` does): the measurement's own graph.

Run: ``PYTHONPATH=$PWD python benchmarks/gpu_graph_keys.py``. Diagnosis only: nothing here is asserted.
"""

from __future__ import annotations

import os
import string
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ampguard
from ampguard import decision_graph

CONFIG = {"spikes": {"grad_zscore": 3.0, "warmup": 4, "action": "skip"}, "zclip": {"warmup": 4}, "param_norms_every": 1}


def run(precision: str, fused: bool, variant: str, steps: int = 24) -> str:
    init_scale = 2.0**24 if variant == "overflows" else 2.0**10
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)).cuda()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1,
                              **({"fused": True} if fused else {"foreach": True}))
    with mock.patch.dict(os.environ, {"AMPGUARD_CUDA_GRAPH": "1", "AMPGUARD_STEP_GRAPH": "0" if variant == "stages"
                                      else "1"}):
        scaler = torch.amp.GradScaler("cuda", init_scale=init_scale) if precision == "fp16" else None
        opt = ampguard.wrap(inner, model=model, precision=precision, scaler=scaler, config=CONFIG)
    places: dict[tuple[int, ...], str] = {}
    log: list[str] = []
    graphs = {"step": opt._pipeline.step_graph, "measure": opt._pipeline.measure_graph}
    originals = {name: g.run for name, g in graphs.items()}

    def logged(name: str, g: Any) -> Any:
        def call(kind: Any, fn: Any, grads: Any, scale: Any = None) -> Any:
            before = (g.captures, g.replays)
            out = originals[name](kind, fn, grads, scale)
            ptrs = tuple(t.data_ptr() for t in grads)
            letter = places.setdefault(ptrs, string.ascii_letters[len(places) % 52])
            what = "C" if g.captures > before[0] else "R" if g.replays > before[1] else "e"
            log.append(f"{name[0]}{letter}{what}")
            return out
        return call

    for name, g in graphs.items():
        g.run = logged(name, g)  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 64, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda())
               for _ in range(steps)]
    capture = decision_graph.captured

    def emptied(fn: Any, stream: Any = None) -> Any:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return capture(fn, stream)

    with mock.patch.object(decision_graph, "captured", emptied if variant == "empty-cache" else capture):
        for i, (x, y) in enumerate(batches):
            n = len(log)
            with opt.autocast():
                loss = F.cross_entropy(model(x), y) * (50.0 if i == 15 else 1.0)
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=variant != "set-to-none=False")
            if variant == "stages":
                assert opt.last_report is not None
            if len(log) == n:
                log.append("-")
            log[-1] += " "
    opt.flush()
    sg, mg = graphs["step"], graphs["measure"]
    skipped = [r.step for r in opt.history if r.skipped]
    return (f"{precision} {'fused' if fused else 'foreach'} {variant}: step graph (C {sg.captures}, R {sg.replays}, "
            f"misses {sg.misses}, failed {sg.failed}), measure graph (C {mg.captures}, R {mg.replays}, misses "
            f"{mg.misses}); "
            f"{len(places)} places; skipped {skipped}\n  " + "".join(log))


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name())
    for precision in ("fp16", "bf16"):
        for fused in (True, False):
            for variant in ("as-is", "overflows", "stages"):
                try:
                    print(run(precision, fused, variant), flush=True)
                except Exception as exc:  # diagnosis: go on to the next
                    print(f"{precision} {fused} {variant}: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
