"""Where a guarded step's host time goes, function by function, timed inside a training loop (stop 57).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop57/breakdown.py mlp-small [STEPS]
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop57/breakdown.py mlp --sim [STEPS]

Each function below is wrapped by a thread-clock timer (benchmarks/host_time.py's Timers, deeper), and each step's
forward and backward run between the steps as in training, so what a function costs is what it costs right after the
backward and the optimizer swept the caches: on this 2-core CPU several times its cost in a warm timeit loop
(Reporter.enqueue: 3.8 us warm, 22-32 us here). ``--sim``: the CUDA host path (simcuda.py: the tensor decision, the
step graph "replayed" with no kernel), the part of issue 26's CUDA host time a CPU can show. Nested functions are
inside their callers' figures. AdamW foreach, fp16 autocast, a GradScaler."""

import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
if "--sim" in sys.argv:
    import simcuda  # noqa: F401  (patches ampguard before the guard is made)
import host_time as H  # noqa: E402
import torch  # noqa: E402

import ampguard  # noqa: E402
import ampguard.pipeline as P  # noqa: E402
from ampguard.payload import Layout  # noqa: E402

METHODS = {  # owner path on the guard -> methods
    "": ("_measure", "_fresh_grads", "_end_step", "_check_step_call"),
    "_pipeline": ("gather", "decide", "measure", "_measure_scaled", "_through_decision", "_hold", "inner_step",
                  "_learn_skip", "update_scale", "payload", "_decides_through", "clip", "fast_path"),
    "_pipeline.step_graph": ("run",), "_pipeline.adapter": ("record_found_inf", "view", "fast_path_ok"),
    "_outcome": ("settle",), "_outcome.records": ("quiet", "decode", "build", "record"), "_reporter": ("enqueue",),
}
FUNCTIONS = ((P, "grads_by_device_and_dtype"), (P, "Measured"), (P, "Decision"), (P, "Packed"), (P, "_addresses"),
             (P, "pack"), (Layout, "of"))


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--sim"]
    name, steps = args[0], int(args[1]) if len(args) > 1 else 300
    clock = time.thread_time_ns
    model, loss_fn = H.build(name, torch.device("cpu"))
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), model=model,
                        precision="fp16", exporters=[])

    def one() -> int:
        with opt.autocast():
            loss = loss_fn()
        opt.backward(loss)
        t0 = clock()
        opt.step()
        t = clock() - t0
        opt.zero_grad()
        return t

    for _ in range(20):
        one()
    H.CLOCK[0] = clock  # host_time.py's timers, on this clock and these functions (never removed: this process ends)
    timers = H.Timers(opt, stages={})
    for path, names in METHODS.items():
        owner: Any = opt
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        for attr in names:
            timers._wrap(owner, attr, f"{path or 'guard'}.{attr}")
    for mod, attr in FUNCTIONS:
        timers._wrap(mod, attr, attr)
    ns = timers.ns
    total = [one() for _ in range(steps)]
    graphs = opt._pipeline.step_graph
    print(f"{name}{' (sim)' if '--sim' in sys.argv else ''}: {steps} steps, step() median "
          f"{statistics.median(total) / 1e3:.1f} us; step graph {graphs.replays} replays, {graphs.captures} captures")
    for label, v in sorted(ns.items(), key=lambda kv: -statistics.median(kv[1]) if kv[1] else 0):
        if v:
            print(f"  {label:40s} calls/step {len(v) / steps:4.1f}  median {statistics.median(v) / 1e3:7.1f} us"
                  f"  mean {statistics.mean(v) / 1e3:7.1f} us")


if __name__ == "__main__":
    main()
