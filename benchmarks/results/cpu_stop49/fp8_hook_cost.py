"""Where the unsampled fp8 monitor's CPU wall time goes: the 48-layer float8 MLP of fp8_sampled_host.py, unmonitored,
monitored (unsampled), monitored with its forward hooks removed (the pre-forward hook's visits for the input and the
weight remain; no grad_output), and monitored with every hook removed (the taps in place, nothing taken). Paired
blocks of 20 steps, 30 rounds; the paired median of each arm minus the unmonitored one.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop49/fp8_hook_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from ampguard.fp8 import Fp8Monitor

torch.set_num_threads(1)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return convert_to_float8_training(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(48)]),
                                      config=Float8LinearConfig(emulate=True))


x = torch.randn(64, 16).bfloat16()
arms: dict[str, tuple] = {"plain": (model(), None)}
for name, keep in (("monitored", None), ("pre-forward hook only", slice(0, None, 2)), ("no hooks", slice(0, 0))):
    m = model()
    monitor = Fp8Monitor(m, numerics_every=10)
    if keep is not None:
        kept = monitor._handles[keep]
        for handle in monitor._handles:
            if handle not in kept:
                handle.remove()
    arms[name] = (m, monitor)


def block(arm: tuple, steps: int = 20) -> float:
    m, monitor = arm
    start = time.perf_counter()
    for _ in range(steps):
        if monitor is not None:
            monitor.begin_step(1)
        m(x).float().square().mean().backward()
        if monitor is not None:
            monitor.nonfinite(monitor.collect())
        m.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps * 1e6


for arm in arms.values():
    block(arm, 5)
times: dict[str, list[float]] = {k: [] for k in arms}
names = list(arms)
for b in range(30):
    for name in names[b % len(names):] + names[: b % len(names)]:
        times[name].append(block(arms[name]))
for name, ts in times.items():
    diff = [t - p for t, p in zip(ts, times["plain"])]
    print(f"{name:22s} median {statistics.median(ts):8.0f} us a step; minus plain (paired median) "
          f"{statistics.median(diff):+7.0f} us")
