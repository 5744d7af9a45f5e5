"""Stop 52: what one pass over mlp-small's gradients costs on this CPU (benchmarks/table.py's model: 8 tensors,
0.7M floats), to weigh issue 26's CPU target (1.05 on a ~2.9 ms step: 145 us). GradScaler's check-and-unscale
(read and write) against the guard's norms (a read: ``stats.cpu_norms``' dots; ``_foreach_norm``; per-tensor
``vector_norm``), each timed after the gradients were written, with a 16 MB write between runs to push them out of
the core's caches. p25 / median / p75 of 300 runs. Run: OMP_NUM_THREADS=1 python
benchmarks/results/cpu_stop52/grad_passes.py"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

SHAPES = [(512, 256), (512,), (512, 512), (512,), (512, 512), (512,), (100, 512), (100,)]


def main() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(s) for s in SHAPES]
    flat = [g.flatten() for g in grads]
    found, inv = torch.zeros(()), torch.full((), 1 / 1024)
    arms: dict[str, Callable[[], object]] = {
        "GradScaler check and unscale": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv),
        "foreach_mul_ (the norms-first unscale)": lambda: torch._foreach_mul_(grads, 1.0),
        "dots (stats.cpu_norms)": lambda: [torch.dot(f, f) for f in flat],
        "_foreach_norm": lambda: torch._foreach_norm(grads),
        "vector_norm per tensor": lambda: [torch.linalg.vector_norm(f) for f in flat],
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    evict = torch.empty(4 * 1024 * 1024)
    for _ in range(300):
        for name, arm in arms.items():
            evict.fill_(1.0)
            for g in grads:
                g.mul_(1.0)  # written, as a backward leaves them
            t = time.perf_counter()
            arm()
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        ts.sort()
        n = len(ts)
        p25, median, p75 = (ts[i] * 1e6 for i in (n // 4, n // 2, 3 * n // 4))
        print(f"{name:40s} p25 {p25:6.1f}  median {median:6.1f}  p75 {p75:6.1f} us")


if __name__ == "__main__":
    main()
