"""Stop 45: plain GradScaler loop, a loop with the guard's kernels and none of its Python (8 dots, one _foreach_mul_,
AdamW), and the guard, mlp-small foreach, rotated 4-step blocks, wall time (README.md here).
Run from the repository root."""

import math
import statistics
import sys
import time
import warnings

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


def mk(kind):
    m = ov.build_model(size, dev)
    ps = list(m.parameters())
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=True)
    sc = torch.amp.GradScaler("cpu", init_scale=4096)
    if kind == "guard":
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
        if kind == "plain":
            sc.step(opt)
            sc.update()
        else:  # minimal: norms by dots, host check, unscale by mul, step, scale kept
            gs = [p.grad for p in ps]
            inv = 1.0 / sc._scale.item()
            norms = torch.stack([torch.dot(f, f) for f in [g.flatten() for g in gs]]).sqrt_().mul_(inv)
            vals = norms.tolist()
            if math.isfinite(sum(vals)):
                torch._foreach_mul_(gs, inv)
                opt.step()
        opt.zero_grad(set_to_none=True)

    return step


vs = {k: mk(k) for k in ("plain", "minimal", "guard")}
for v in vs.values():
    for _ in range(20):
        v()
T = {k: [] for k in vs}
names = list(vs)
for b in range(300):
    order = names[b % 3 :] + names[: b % 3]
    for k in order:
        t0 = time.perf_counter_ns()
        for _ in range(4):
            vs[k]()
        T[k].append(time.perf_counter_ns() - t0)
for k in ("minimal", "guard"):
    r = sorted(a / b for a, b in zip(T[k], T["plain"]))
    print(
        k, "ratio p25/med/p75", round(r[len(r) // 4], 4), round(statistics.median(r), 4), round(r[3 * len(r) // 4], 4)
    )
print("plain ms/step", statistics.median(T["plain"]) / 4e6)
