"""Stop 56: warm-loop kernel times over mlp-small's 8 gradients (after one float32 backward, scaled by 4096), the arms
rotated: _foreach_mul_ by a Python float against by a 0-d float32 tensor, GradScaler's check-and-unscale kernel, the
guard's CPU norms (dots) and _foreach_norm; then whether the float and the tensor multiply give the same bits.
Run from the repository root: OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop56/mul_scalar.py"""

import statistics
import struct
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
(ov.compute_loss(m, batch) * 4096).backward()
gs = [p.grad for p in m.parameters()]
inv_t, inv_f, found = torch.full((), 1 / 4096.0), 1 / 4096.0, torch.zeros(())
ARMS = {
    "mul_float": lambda: torch._foreach_mul_(gs, inv_f),
    "mul_tensor": lambda: torch._foreach_mul_(gs, inv_t),
    "check_unscale": lambda: torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv_t),
    "dots": lambda: torch.stack([torch.dot(f, f) for f in [g.flatten() for g in gs]]).sqrt_(),
    "foreach_norm": lambda: torch.stack(torch._foreach_norm(gs)),
}
T: dict[str, list[int]] = {k: [] for k in ARMS}
names = list(ARMS)
for r in range(400):
    for k in names[r % 5:] + names[: r % 5]:
        t0 = time.perf_counter_ns()
        ARMS[k]()
        T[k].append(time.perf_counter_ns() - t0)
for k, xs in T.items():
    q = statistics.quantiles(xs[50:], n=4)
    print(f"{k:14s} us: p25 {q[0] / 1e3:6.1f}  median {q[1] / 1e3:6.1f}  p75 {q[2] / 1e3:6.1f}")
x = struct.unpack("f", struct.pack("f", 1 / 3.0))[0]  # a float32 value that is not a power of two
a, b = [g.clone() for g in gs], [g.clone() for g in gs]
torch._foreach_mul_(a, x)
torch._foreach_mul_(b, torch.full((), x))
print("same bits, float and tensor multiply:", all(torch.equal(p, q) for p, q in zip(a, b)))
