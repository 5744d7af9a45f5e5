"""Stop 45: plain, guard, guard with AMPGUARD_REPORT_BATCH=0, in rotated blocks in one process (README.md here)."""

import os
import statistics
import sys
import time
import warnings
from unittest import mock

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")  # run from the repository root
import overhead as ov  # noqa: E402

import ampguard  # noqa: E402

size = ov.SIZES["mlp-small"]
dev = torch.device("cpu")
batch = ov.make_batch(size, dev)


def ac():
    return torch.autocast("cpu", dtype=torch.bfloat16)


fused = len(sys.argv) > 1 and sys.argv[1] == "fused"


def mk(kind):
    m = ov.build_model(size, dev)
    ps = list(m.parameters())
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, **({"fused": True} if fused else {"foreach": True}))
    sc = torch.amp.GradScaler("cpu", init_scale=4096)
    if kind.startswith("guard"):
        with mock.patch.dict(os.environ, {"AMPGUARD_REPORT_BATCH": "0" if kind == "guard-perstep" else "1"}):
            g = ampguard.wrap(opt, model=m, scaler=sc, precision="fp16")

        def step():
            with ac():
                loss = ov.compute_loss(m, batch)
            g.backward(loss)
            g.step()
            g.zero_grad(set_to_none=True)

        return step

    def step():
        with ac():
            loss = ov.compute_loss(m, batch)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        opt.zero_grad(set_to_none=True)

    return step


vs = {k: mk(k) for k in ("plain", "guard", "guard-perstep")}
for v in vs.values():
    for _ in range(20):
        v()
T = {k: [] for k in vs}
names = list(vs)
CLK = time.thread_time_ns if os.environ.get("CLOCK") == "thread" else time.perf_counter_ns
B = int(os.environ.get("BLOCKS", 300))
S = int(os.environ.get("STEPS", 4))
for b in range(B):
    order = names[b % 3 :] + names[: b % 3]
    for k in order:
        t0 = CLK()
        for _ in range(S):
            vs[k]()
        T[k].append(CLK() - t0)
for k in ("guard", "guard-perstep"):
    r = sorted(a / b for a, b in zip(T[k], T["plain"]))
    print(
        k,
        "ratio p25/med/p75",
        round(r[len(r) // 4], 4),
        round(statistics.median(r), 4),
        round(r[3 * len(r) // 4], 4),
        "sum ratio",
        round(sum(T[k]) / sum(T["plain"]), 4),
    )
print("plain ms/step", statistics.median(T["plain"]) / S / 1e6)
