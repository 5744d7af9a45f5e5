#!/usr/bin/env python
"""Stop 66: each CPU pass over gradients of mlp-small's shapes (``overhead.SIZES``: 8 tensors, 0.7M floats), warm and
alone, median of 2000 calls: GradScaler's unscale, the guard's unscale (``_foreach_mul_`` by a 0-d tensor and by a
float), the guard's CPU norms (``stats.cpu_norms``, its dots) and ``_foreach_norm``. From the repository root::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop66/norm_micro.py
"""

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ampguard.stats import cpu_norms

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: the CPU row's model
import overhead

torch.set_num_threads(1)
model = overhead.build_model(overhead.SIZES["mlp-small"], torch.device("cpu"))
g = [torch.randn_like(p) for p in model.parameters()]  # gradients of its shapes
inv, found = torch.tensor(1 / 65536.0), torch.zeros(1)


def t(f: Callable[[], object], n: int = 2000) -> float:
    ts = []
    for _ in range(n):
        a = time.perf_counter()
        f()
        ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e6


PASSES: list[tuple[str, Callable[[], object]]] = [
    ("GradScaler's unscale (_amp_foreach_non_finite_check_and_unscale_)",
     lambda: torch._amp_foreach_non_finite_check_and_unscale_(g, found, inv)),
    ("_foreach_mul_ by a 0-d tensor", lambda: torch._foreach_mul_(g, inv)),
    ("_foreach_mul_ by a float", lambda: torch._foreach_mul_(g, 1 / 65536.0)),
    ("cpu_norms' dots", lambda: cpu_norms(g)),
    ("_foreach_norm", lambda: torch.stack(torch._foreach_norm(g, 2.0))),
]
print(f"{sum(x.numel() for x in g)} floats in {len(g)} tensors")
for label, fn in PASSES:
    print(f"{label:<66} {t(fn):.1f} us")
