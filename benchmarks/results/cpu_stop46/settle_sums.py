"""Stop 46: the thread time a step of ``Outcome.settle``, ``Reporter.decode`` and ``Reporter.quiet`` (summed over N
guarded steps, so a batch's decode counts in the mean), and the whole step's mean and median, for one of
``benchmarks/host_time.py``'s models on the CPU. One process per ``AMPGUARD_REPORT_BATCH`` value (README.md here).

    AMPGUARD_REPORT_BATCH=1 OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop46/settle_sums.py gpt2-deep fused
"""

import os
import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")  # run from the repository root
import host_time as ht  # noqa: E402

import ampguard  # noqa: E402
import ampguard.outcome as outcome  # noqa: E402
import ampguard.reporter as reporter  # noqa: E402

ACC: dict[str, list[int]] = {}


def timed(cls, meth, label):
    fn = getattr(cls, meth)
    acc = ACC.setdefault(label, [0, 0])

    def wrapper(*a, **k):
        t0 = time.thread_time_ns()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += time.thread_time_ns() - t0
            acc[1] += 1

    setattr(cls, meth, wrapper)


timed(outcome.Outcome, "settle", "settle")
timed(reporter.Reporter, "decode", "decode")
timed(reporter.Reporter, "quiet", "quiet")

name, optim = sys.argv[1], sys.argv[2]
model, loss_fn = ht.build(name, torch.device("cpu"))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if optim == "fused" else {"foreach": True}))
g = ampguard.wrap(opt, model=model, scaler=torch.amp.GradScaler("cpu", init_scale=1024), precision="fp16")
N = int(os.environ.get("N", 1500))
steps = []
for i in range(N + 100):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn()
    g.backward(loss)
    if i == 100:  # the first 100 steps warm up
        for a in ACC.values():
            a[0] = a[1] = 0
    t0 = time.thread_time_ns()
    g.step()
    if i >= 100:
        steps.append(time.thread_time_ns() - t0)
    g.zero_grad(set_to_none=True)
print({k: round(v[0] / N / 1e3, 1) for k, v in ACC.items()}, "us a step")
print(f"AMPGUARD_REPORT_BATCH={os.environ.get('AMPGUARD_REPORT_BATCH', '1')} {name} {optim}: step mean "
      f"{statistics.fmean(steps) / 1e3:.1f} median {statistics.median(steps) / 1e3:.1f} us")
