"""Stop 56: the non-fused CPU measurement's two passes over the gradients, right after a real backward (cold
gradients), as the guard runs them (all dots, then one _foreach_mul_ by a 0-d tensor) against interleaved per
gradient (its dot, then its mul_, while it is in cache), mlp-small, float32 forward; the arms alternate step by step.
Run from the repository root: OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop56/interleave.py [steps]"""

import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")  # run from the repository root
import overhead as ov  # noqa: E402

size = ov.SIZES["mlp-small"]
batch = ov.make_batch(size, torch.device("cpu"))
m = ov.build_model(size, torch.device("cpu"))
params = list(m.parameters())
inv = torch.full((), 2.0**-12)


def passes(gs):
    norms = torch.stack([torch.dot(f, f) for f in [g.flatten() for g in gs]]).sqrt_()
    torch._foreach_mul_(gs, inv)
    return norms


def interleaved(gs):
    ds = []
    for g in gs:
        f = g.flatten()
        ds.append(torch.dot(f, f))
        g.mul_(inv)
    return torch.stack(ds).sqrt_()


def check_unscale(gs):  # the plain loop's one pass (GradScaler.unscale_'s kernel)
    torch._amp_foreach_non_finite_check_and_unscale_(gs, torch.zeros(()), inv)


ARMS = {"passes": passes, "interleaved": interleaved, "check_unscale": check_unscale}
T = {k: [] for k in ARMS}
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 600
for i in range(steps + 30):
    arm = list(ARMS)[i % 3]
    for p in params:
        p.grad = None
    (ov.compute_loss(m, batch) * 4096).backward()
    gs = [p.grad for p in params]
    t0 = time.perf_counter_ns()
    ARMS[arm](gs)
    if i >= 30:
        T[arm].append((time.perf_counter_ns() - t0) / 1e3)
for k, xs in T.items():
    q = statistics.quantiles(xs, n=4)
    print(f"{k:14s} us: p25 {q[0]:6.1f}  median {q[1]:6.1f}  p75 {q[2]:6.1f}  ({len(xs)} steps)")
