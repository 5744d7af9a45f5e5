"""Stop 48's two host-cost figures on the CPU (indicative: the 2-core machine, one process).

- ``Schedules.step_ahead``'s snapshot (a LambdaLR's ``state_dict()`` and one param group's values) against the
  scheduler's own ``step()``, which the advance made ahead moves from the next ``step()`` to this one.
- ``ampguard.fp8.cast_stats`` of a 64x64 bfloat16 tensor (the kernels tiny: the host's time per sampled cast).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop48/host_costs.py
"""

import time
import warnings

import torch

from ampguard.fp8 import cast_stats
from ampguard.schedules import _saved


def per_call_us(fn, n: int) -> float:
    for _ in range(n // 10):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


warnings.simplefilter("ignore")
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.99**k)


def snapshot() -> None:
    _saved(sched)
    [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


print(f"step_ahead's snapshot: {per_call_us(snapshot, 20000):.1f} us; LambdaLR.step(): "
      f"{per_call_us(sched.step, 20000):.1f} us")
x = torch.randn(64, 64, dtype=torch.bfloat16)
for rowwise in (False, True):
    us = per_call_us(lambda r=rowwise: cast_stats(x, torch.float8_e4m3fn, rowwise=r, pow2=r, sample=1 << 20), 2000)
    print(f"cast_stats, {'rowwise' if rowwise else 'tensorwise'}: {us:.0f} us a cast")
