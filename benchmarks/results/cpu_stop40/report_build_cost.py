"""Stop 40: what building a step's report costs in-step on the CPU (the backward and the fused step leave the caches
cold), and how much of it is the frozen ``StepReport``'s construction: perf_counter wrappers around
``Reporter.build``, its parts and ``StepReport``, 1000 guarded steps (after 300 untimed) of an 8x256 MLP, fp16
autocast, fused AdamW. Mean microseconds a step.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop40/report_build_cost.py
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import torch

import ampguard
import ampguard.reporter as reporter_module


def main() -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), model=model, precision="fp16")
    x = torch.randn(16, 256)
    spent: dict[str, float] = {}

    def timed(fn, name):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
            return out
        return wrapper

    rep = opt._reporter
    for name in ("build", "_anomalies", "_fp8_casts", "names", "record"):
        setattr(rep, name, timed(getattr(rep, name), name))
    reporter_module.StepReport = timed(reporter_module.StepReport, "StepReport")  # type: ignore[misc]
    for i in range(1300):
        if i == 300:
            spent.clear()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    print({k: round(v / 1000 * 1e6, 1) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])})
    record = opt.history[-1]
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    cls = type(record)
    t = time.perf_counter()
    for _ in range(20000):
        cls(**fields)
    print(f"StepReport(...) warm, in a loop: {(time.perf_counter() - t) / 20000 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
