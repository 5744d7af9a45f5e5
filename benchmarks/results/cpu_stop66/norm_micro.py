#!/usr/bin/env python
"""Stop 66: each CPU pass over mlp-small's 8 gradient shapes (0.7M floats), warm and alone, median of 2000 calls:
GradScaler's unscale, the guard's unscale (``_foreach_mul_`` by a 0-d tensor and by a float), the guard's CPU norms
(``stats.cpu_norms``'s dots) and ``_foreach_norm``. From the repository root::

    OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop66/norm_micro.py
"""

import itertools
import statistics
import time
from collections.abc import Callable

import torch

torch.set_num_threads(1)
dims = [256, 512, 512, 512]
shapes: list[tuple[int, ...]] = []
for a, b in itertools.pairwise(dims):
    shapes += [(b, a), (b,)]
shapes += [(100, 512), (100,)]
g = [torch.randn(s) for s in shapes]
inv, found = torch.tensor(1 / 65536.0), torch.zeros(1)


def t(f: Callable[[], object], n: int = 2000) -> float:
    ts = []
    for _ in range(n):
        a = time.perf_counter()
        f()
        ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e6


print(f"{sum(x.numel() for x in g)} floats in {len(g)} tensors")
print(f"GradScaler's unscale (_amp_foreach_non_finite_check_and_unscale_) {t(lambda: torch._amp_foreach_non_finite_check_and_unscale_(g, found, inv)):.1f} us")  # noqa: E501
print(f"_foreach_mul_ by a 0-d tensor                                      {t(lambda: torch._foreach_mul_(g, inv)):.1f} us")  # noqa: E501
print(f"_foreach_mul_ by a float                                           {t(lambda: torch._foreach_mul_(g, 1 / 65536.0)):.1f} us")  # noqa: E501
print(f"cpu_norms' dots                                                    {t(lambda: torch.stack([torch.dot(f, f) for f in [x.flatten() for x in g]]).sqrt_()):.1f} us")  # noqa: E501
print(f"_foreach_norm                                                      {t(lambda: torch.stack(torch._foreach_norm(g, 2.0))):.1f} us")  # noqa: E501
