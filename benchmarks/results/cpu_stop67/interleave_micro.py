#!/usr/bin/env python
"""Stop 67: the CPU norms and the unscale over mlp-small's 8 gradients right after a backward, timed alone (thread
clock), in turn: ``a`` the dots then one ``_foreach_mul_`` by ``1/scale`` (the path before stop 67), ``b`` each
gradient multiplied right after its own dot (``stats.cpu_norms(grads, unscale_by=...)``, the path now), ``c`` the
multiply first, then the dots. 600 backwards, the first 30 untimed. Run::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop67/interleave_micro.py
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import overhead

from ampguard.stats import cpu_norms

size = overhead.SIZES["mlp-small"]
model, batch = overhead.build_model(size, torch.device("cpu")), overhead.make_batch(size, torch.device("cpu"))
inner = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
inv = torch.full((), 2.0**-16)


def before(grads: list[torch.Tensor]) -> None:
    cpu_norms(grads)
    torch._foreach_mul_(grads, inv)


def now(grads: list[torch.Tensor]) -> None:
    cpu_norms(grads, unscale_by=inv)


def mul_first(grads: list[torch.Tensor]) -> None:
    torch._foreach_mul_(grads, inv)
    cpu_norms(grads)


arms = {"a (dots, then the multiply)": before, "b (each multiplied after its dot)": now,
        "c (the multiply, then the dots)": mul_first}
times: dict[str, list[int]] = {name: [] for name in arms}
names = list(arms)
for i in range(600):
    name = names[i % len(names)]
    loss = overhead.compute_loss(model, batch)
    (loss * 65536.0).backward()
    grads = [p.grad for p in model.parameters()]
    t = time.thread_time_ns()
    arms[name](grads)
    t = time.thread_time_ns() - t
    if i >= 30:
        times[name].append(t)
    inner.step()
    inner.zero_grad()
for name, ts in times.items():
    p25, med, p75 = statistics.quantiles(ts, n=4)
    print(f"{name}: median {med / 1e3:.1f} us (p25 {p25 / 1e3:.1f}, p75 {p75 / 1e3:.1f})")
