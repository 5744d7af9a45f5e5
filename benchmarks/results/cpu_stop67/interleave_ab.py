#!/usr/bin/env python
"""Stop 67: the CPU norms-first step with each gradient unscaled right after its dot (``stats.cpu_norms``'s
``unscale_by``, the default now) against the norms then one ``_foreach_mul_`` (the path before, kept by passing
``unscale=False`` to ``StepPipeline._measure_scaled`` on that guard only), and the plain GradScaler loop, in one
process: three models alike, paired blocks in turn, the host (thread) time of ``step()`` (the plain loop:
``scaler.step(opt); scaler.update()``) after a backward. mlp-small (benchmarks/overhead.py), non-fused (foreach)
AdamW, fp16 autocast off (as ``table.py --cpu-autocast off``). Run::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop67/interleave_ab.py [BLOCKS] [STEPS]
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import overhead

import ampguard

blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 40
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
size = overhead.SIZES["mlp-small"]
cpu = torch.device("cpu")
arms = {}
for name in ("plain", "before", "now"):
    model, batch = overhead.build_model(size, cpu), overhead.make_batch(size, cpu)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if name == "plain":
        scaler = torch.amp.GradScaler("cpu")

        def one(model=model, batch=batch, inner=inner, scaler=scaler) -> int:
            scaler.scale(overhead.compute_loss(model, batch)).backward()
            t = time.thread_time_ns()
            scaler.step(inner)
            scaler.update()
            t = time.thread_time_ns() - t
            inner.zero_grad()
            return t
    else:
        opt = ampguard.wrap(inner, model=model, precision="fp16", exporters=[])
        assert opt._pipeline.norms_first
        if name == "before":
            pipe = opt._pipeline
            measure_scaled = pipe._measure_scaled
            pipe._measure_scaled = lambda *a, _m=measure_scaled, **k: _m(*a, **{**k, "unscale": False})

        def one(model=model, batch=batch, opt=opt) -> int:
            opt.backward(overhead.compute_loss(model, batch))
            t = time.thread_time_ns()
            opt.step()
            t = time.thread_time_ns() - t
            opt.zero_grad()
            return t
    arms[name] = one
times = {name: [] for name in arms}
for b in range(blocks + 2):
    order = list(arms) if b % 2 == 0 else list(reversed(arms))
    for name in order:
        for _ in range(steps):
            t = arms[name]()
            if b >= 2:  # two blocks of warm-up
                times[name].append(t)
q = {name: statistics.quantiles(ts, n=4) for name, ts in times.items()}
for name, (p25, med, p75) in q.items():
    print(f"{name:7s} step() median {med / 1e3:7.1f} us (p25 {p25 / 1e3:.1f}, p75 {p75 / 1e3:.1f}); "
          f"added over plain {(med - q['plain'][1]) / 1e3:+.1f} us")
print(f"now - before: {(q['now'][1] - q['before'][1]) / 1e3:+.1f} us (medians), {len(times['now'])} steps each")
