#!/usr/bin/env python
"""Host cost of the per-step calls a guarded step makes that scale with the parameter count, and of
the memory reading, on the machine it runs on (GPT-2 124M's 148 parameter tensors). Prints µs per
call, median of 7 repeats of 200 calls. Run: ``python benchmarks/host_probe.py``."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ampguard.pipeline import grad_marks
from ampguard.stats import grads_by_device_and_dtype, per_tensor_norms


def cost(fn, n: int = 200) -> float:
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = [torch.nn.Parameter(torch.zeros(64, device=dev)) for _ in range(148)]
    for p in params:
        p.grad = torch.zeros_like(p)
    groups = grads_by_device_and_dtype(params)
    rows = {
        "grad_marks(148)": lambda: grad_marks(params),
        "grads_by_device_and_dtype(148)": lambda: grads_by_device_and_dtype(params),
        "per_tensor_norms(148) launch": lambda: per_tensor_norms(groups, dev),
        "[p.grad for p in params]": lambda: [p.grad for p in params],
    }
    if dev.type == "cuda":
        rows["torch.cuda.memory_stats_as_nested_dict()"] = lambda: torch.cuda.memory_stats_as_nested_dict(dev)
        ev = torch.cuda.Event()
        ev.record()
        torch.cuda.synchronize()
        rows["Event.query() (done)"] = ev.query
        rows["Event.synchronize() (done)"] = ev.synchronize
    print(f"device {dev} {torch.cuda.get_device_name(0) if dev.type == 'cuda' else ''} torch {torch.__version__}")
    for name, fn in rows.items():
        print(f"{name:45s} {cost(fn):9.2f} us/call")
    if dev.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
