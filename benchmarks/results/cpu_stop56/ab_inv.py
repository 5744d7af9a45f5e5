"""Stop 56: the non-fused CPU unscale by a 0-d tensor (StepPipeline._host_scalar) against by a Python float (the code
before), swapped by blocks of 10 steps in ONE process, one guard: wall time of step() and of its measure() stage
(perf_counter), mlp-small foreach, float32 forward (this host has no bf16 matmul units). Run from the repository root:
PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop56/ab_inv.py [blocks]"""

import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")
import overhead as ov  # noqa: E402

import ampguard  # noqa: E402
from ampguard.pipeline import StepPipeline  # noqa: E402

NEW = StepPipeline._host_scalar
MEASURE = StepPipeline.measure
M: list[float] = []


def timed_measure(self, *a, **k):  # the stage the change is in: the norms, then the unscale
    t0 = time.perf_counter_ns()
    try:
        return MEASURE(self, *a, **k)
    finally:
        M.append((time.perf_counter_ns() - t0) / 1e3)


StepPipeline.measure = timed_measure
ARMS = {"tensor": NEW, "float": lambda self, value: value}  # "float": the code before (the float itself)
size = ov.SIZES["mlp-small"]
batch = ov.make_batch(size, torch.device("cpu"))
m = ov.build_model(size, torch.device("cpu"))
opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
g = ampguard.wrap(opt, model=m, scaler=torch.amp.GradScaler("cpu", init_scale=4096), precision="fp16")
blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 200
T: dict[str, list[float]] = {k: [] for k in ARMS}
S: dict[str, list[float]] = {k: [] for k in ARMS}
for b in range(blocks + 5):
    arms = list(ARMS) if b % 2 == 0 else list(ARMS)[::-1]
    for arm in arms:
        StepPipeline._host_scalar = ARMS[arm]
        for _ in range(10):
            loss = ov.compute_loss(m, batch)
            g.backward(loss)
            t0 = time.perf_counter_ns()
            g.step()
            dt = time.perf_counter_ns() - t0
            g.zero_grad(set_to_none=True)
            if b >= 5:
                T[arm].append(dt / 1e3)
                S[arm].append(M[-1])
StepPipeline._host_scalar = NEW
for arm, xs in T.items():
    q = statistics.quantiles(xs, n=4)
    print(f"{arm:7s} step() us: p25 {q[0]:7.1f}  median {q[1]:7.1f}  p75 {q[2]:7.1f}  ({len(xs)} steps)")
d = statistics.median(T["tensor"]) - statistics.median(T["float"])
print(f"tensor - float, step() median: {d:+.1f} us")
for arm, xs in S.items():
    q = statistics.quantiles(xs, n=4)
    print(f"{arm:7s} measure() us: p25 {q[0]:7.1f}  median {q[1]:7.1f}  p75 {q[2]:7.1f}")
d = statistics.median(S["tensor"]) - statistics.median(S["float"])
print(f"tensor - float, measure() median: {d:+.1f} us")
