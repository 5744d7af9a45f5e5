"""Stop 40: what a gradient mark costs on the host, per step, for 292 gradients (GPT-2 350M's count):
``(id(g), version)`` ints (ampguard's marks) against ``(weakref.ref(g), version)`` (tried in 5bbefd3, reverted
in 0e275b5), on gradients made fresh by autograd each step (``zero_grad(set_to_none=True)``), as in training;
and the GC collections each brings about in 400 steps.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop40/marks_cost.py
"""

from __future__ import annotations

import gc
import statistics
import time
import weakref

import torch


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(146)])  # 292 parameters
    params = list(model.parameters())
    kinds = {"id": lambda gs: [(id(g), g._version) for g in gs],
             "weakref": lambda gs: [(weakref.ref(g), g._version) for g in gs]}
    for run in (1, 2):
        for name, mark in kinds.items():
            times, kept = [], None
            collections = sum(s["collections"] for s in gc.get_stats())
            for _ in range(400):
                model.zero_grad(set_to_none=True)
                model(torch.randn(2, 4)).sum().backward()
                grads = [p.grad for p in params]
                t = time.perf_counter()
                kept = mark(grads)  # held until the next step's, as the guard holds its marks
                times.append((time.perf_counter() - t) * 1e6)
            collections = sum(s["collections"] for s in gc.get_stats()) - collections
            q = statistics.quantiles(times[50:], n=4)
            print(f"run {run} {name:8s} p25 {q[0]:6.1f}  median {q[1]:6.1f}  p75 {q[2]:6.1f} us; "
                  f"GC collections in 400 steps: {collections}")
            del kept


if __name__ == "__main__":
    main()
