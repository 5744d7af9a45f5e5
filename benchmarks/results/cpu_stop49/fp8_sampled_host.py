"""What the fp8 monitor adds to a step on this CPU, sampled and not: a 48-layer torchao float8 MLP (16 wide,
tensorwise, emulate=True, bfloat16 input as CUDA's autocast feeds it: 144 casts, as GPT-2 124M), forward + backward
(+ collect() and nonfinite() where monitored), paired blocks of 20 steps in rotated order; per-step medians and the
paired median of the difference to the unmonitored step. The library is the one on sys.path first:

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop49/fp8_sampled_host.py [BLOCKS]

``model``, ``block`` and ``paired`` also serve ``fp8_hook_cost.py``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from ampguard.fp8 import Fp8Monitor

torch.set_num_threads(1)
X = torch.randn(64, 16).bfloat16()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return convert_to_float8_training(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(48)]),
                                      config=Float8LinearConfig(emulate=True))


def block(arm: tuple, steps: int = 20) -> float:
    """Microseconds a step over ``steps`` steps of ``arm``: ``(model, monitor or None, step number)``."""
    m, monitor, step = arm
    start = time.perf_counter()
    for _ in range(steps):
        if monitor is not None:
            monitor.begin_step(step)
        m(X).float().square().mean().backward()
        if monitor is not None:
            monitor.nonfinite(monitor.collect())
        m.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps * 1e6


def paired(arms: dict[str, tuple], rounds: int) -> None:
    """Warm each arm, time ``rounds`` rounds of one block per arm in rotated order, print each arm's median and its
    paired median difference to the first arm (the unmonitored one)."""
    for arm in arms.values():
        block(arm, 5)
    times: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for b in range(rounds):
        for name in names[b % len(names):] + names[: b % len(names)]:
            times[name].append(block(arms[name]))
    for name, ts in times.items():
        diff = [t - p for t, p in zip(ts, times[names[0]])]
        print(f"{name:22s} median {statistics.median(ts):8.0f} us a step; minus plain (paired median) "
              f"{statistics.median(diff):+7.0f} us")


if __name__ == "__main__":
    arms: dict[str, tuple] = {"plain": (model(), None, 1)}
    for name, step in (("unsampled", 1), ("sampled", 0)):
        m = model()
        arms[name] = (m, Fp8Monitor(m, numerics_every=10), step)
    paired(arms, int(sys.argv[1]) if len(sys.argv) > 1 else 40)
