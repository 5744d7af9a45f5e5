"""Host time of the fp8 monitor's per-step pieces on this CPU (torchao float8, emulate=True), the best of 5 runs of
each, in microseconds: the hooks of one layer, the taps' pass-through, taking one amax, collect() of 144 casts.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop49/fp8_host.py
"""

from __future__ import annotations

import time

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from ampguard import fp8 as F

torch.set_num_threads(1)
model = convert_to_float8_training(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(48)]),
                                   config=Float8LinearConfig(emulate=True))
mon = F.Fp8Monitor(model, numerics_every=10**9)
mon.begin_step(1)
x = torch.randn(4, 16, requires_grad=True)
mod = mon.modules[0][1]
out = mod.weight.new_ones(4, 16, requires_grad=True) * 1


def bench(f, n=20000) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter_ns()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter_ns() - t) / n)
    return best / 1e3


pre, fwd, bwd = mon._pre_forward_hook(0), mon._forward_hook(0), mon._backward_hook(mod, 0)
a16, a32 = torch.tensor(3.0, dtype=torch.bfloat16), torch.tensor(3.0)
y = torch.randn(4, 16)
amax_orig, tap_amax = F._TAPS.originals[1], F._TAPS.wrappers[1]


def fill() -> None:
    mon.begin_step(1)
    for i in range(48):
        mon._took(i, "input", a16, y, None)
        mon._took(i, "weight", a32, y, None)
        mon._took(i, "grad_output", a16, y, None)


rows = {
    "pre-forward hook (one layer)": bench(lambda: pre(mod, (x,))),
    "forward hook + gradient hook registered (one layer)": bench(lambda: fwd(mod, (x,), out), 2000),
    "gradient hook (one layer)": bench(lambda: bwd(out)),
    "tensor_to_amax: torchao's": bench(lambda: amax_orig(y)),
    "tensor_to_amax: through the tap": bench(lambda: tap_amax(y)),
    "begin_step + 144 amaxes taken": bench(fill, 200),
}
fill()
rows["collect() of 144 casts (bf16 and fp32 amaxes)"] = bench(lambda: mon.collect(), 500)
collected = mon.collect()
rows["nonfinite()"] = bench(lambda: mon.nonfinite(collected), 2000)
for name, us in rows.items():
    print(f"{name:55s} {us:8.2f} us")
