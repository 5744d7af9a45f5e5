"""Stop 63: a small tensor op right after a pass over the gradients costs several times what it costs warm (CPU).

mlp-small's eight gradients (0.7M floats) are written, then their norms taken as the guard takes them on the CPU
(eight ``dot``s), after a 64 MiB write that stands in for the forward and backward; then the same small ops are timed
twice in a row: the first of each kind pays for bringing the dispatcher's code and data back into the caches, the
second runs warm. Inside a guarded step, line by line (line_profiler), ``norms * inv_scale`` took ~45 µs and
``torch.zeros(())`` with GradScaler's record ~33 µs, against ~2.5 and ~3 µs in a warm loop. Run from the repository
root: OMP_NUM_THREADS=1 python THIS."""

from __future__ import annotations

import statistics
import time

import torch

SHAPES = [(512, 256), (512,), (512, 512), (512,), (512, 512), (512,), (100, 512), (100,)]


def main() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(s) for s in SHAPES]
    junk = torch.empty(64 * 1024 * 1024 // 4)
    t: dict[str, list[int]] = {k: [] for k in ("mul, first", "mul, second", "zeros, first", "zeros, second",
                                                "tolist, first", "tolist, second")}
    for _ in range(300):
        junk.fill_(1.0)
        for g in grads:
            g.fill_(0.5)  # as a backward leaves them: just written
        n = torch.stack([torch.dot(f, f) for f in [g.flatten() for g in grads]]).sqrt_()
        for kind, op in (("mul", lambda n=n: n * 0.25), ("zeros", lambda: torch.zeros(())),
                         ("tolist", lambda n=n: n.tolist())):
            for turn in ("first", "second"):
                t0 = time.perf_counter_ns()
                op()
                t[f"{kind}, {turn}"].append(time.perf_counter_ns() - t0)
    print(f"torch {torch.__version__}, 300 rounds, median µs")
    for k, v in t.items():
        print(f"  {k:<15} {statistics.median(v) / 1e3:7.2f}")


if __name__ == "__main__":
    main()
