#!/usr/bin/env python
"""Stop 68: the plain GradScaler loop, the guard of a base copy of the library (loaded as ``ampguard_base``) and the
guard of this tree, in one process: three mlp-small models alike (benchmarks/overhead.py, autocast off as
``table.py --cpu-autocast off``), AdamW fused or foreach, blocks of STEPS steps in each of the six orders in turn, the
thread time of ``step()`` (the plain loop: ``scaler.step(opt); scaler.update()``) and of the whole iteration. ``CFG``:
a ``GuardConfig`` keyword dict (a Python literal) for this tree's guard only; ``PATCH``: a file run with ``opt`` and
``lib`` (this tree's guard and library) after it is made. Run::

    git archive 9dc6c63 ampguard | tar -x -C /tmp/s68/base
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop68/ab.py fused|foreach BLOCKS STEPS \
        [/tmp/s68/base/ampguard]
"""
import ast
import importlib.util
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import overhead

import ampguard

optim, blocks, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
base_dir = sys.argv[4] if len(sys.argv) > 4 else "/tmp/s68/base/ampguard"
spec = importlib.util.spec_from_file_location("ampguard_base", base_dir + "/__init__.py",
                                              submodule_search_locations=[base_dir])
assert spec is not None and spec.loader is not None
base_lib = importlib.util.module_from_spec(spec)
sys.modules["ampguard_base"] = base_lib
spec.loader.exec_module(base_lib)

size = overhead.SIZES["mlp-small"]
cpu = torch.device("cpu")
clock = time.thread_time_ns
arms = {}
for name, lib in (("plain", None), ("base", base_lib), ("now", ampguard)):
    torch.manual_seed(0)
    model, batch = overhead.build_model(size, cpu), overhead.make_batch(size, cpu)
    kind = {"fused": True} if optim == "fused" else {"foreach": True}
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    if lib is None:
        def one(model=model, batch=batch, inner=inner, scaler=scaler) -> tuple[int, int]:
            t0 = clock()
            scaler.scale(overhead.compute_loss(model, batch)).backward()
            t1 = clock()
            scaler.step(inner)
            scaler.update()
            t2 = clock()
            inner.zero_grad(set_to_none=True)
            return t2 - t1, clock() - t0
    else:
        cfg = ast.literal_eval(os.environ.get("CFG", "{}")) if name == "now" else {}
        opt = lib.wrap(inner, model=model, scaler=scaler, precision="fp16", config=lib.GuardConfig(**cfg),
                       exporters=[])
        if name == "now" and os.environ.get("PATCH"):
            exec(Path(os.environ["PATCH"]).read_text(), {"opt": opt, "lib": lib, "torch": torch})

        def one(model=model, batch=batch, opt=opt) -> tuple[int, int]:
            t0 = clock()
            opt.backward(overhead.compute_loss(model, batch))
            t1 = clock()
            opt.step()
            t2 = clock()
            opt.zero_grad(set_to_none=True)
            return t2 - t1, clock() - t0
    arms[name] = one

step_us: dict[str, list[float]] = {n: [] for n in arms}
iter_us: dict[str, list[float]] = {n: [] for n in arms}
orders = list(itertools.permutations(arms))
for b in range(blocks + 2):
    for n in orders[b % len(orders)]:
        s = w = 0
        for _ in range(steps):
            a, c = arms[n]()
            s, w = s + a, w + c
        if b >= 2:  # the first two rounds warm up
            step_us[n].append(s / steps / 1e3)
            iter_us[n].append(w / steps / 1e3)


def q(xs: list[float], f: str = ".1f") -> str:
    p25, med, p75 = statistics.quantiles(xs, n=4)
    return f"{med:7{f}} (p25 {p25:{f}}, p75 {p75:{f}}) mean {statistics.fmean(xs):{f}}"


for n in arms:
    print(f"{n:6s} step {q(step_us[n])}   iteration {q(iter_us[n])}")
for x, y in (("now", "base"), ("base", "plain"), ("now", "plain")):
    d = [a - b for a, b in zip(step_us[x], step_us[y])]
    r = [a / b for a, b in zip(iter_us[x], iter_us[y])]
    print(f"{x}-{y}: step {q(d)} us; iteration ratio {q(r, '.4f')}")
