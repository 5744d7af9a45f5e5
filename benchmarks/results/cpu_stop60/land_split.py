"""Stop 60: where the early arm's extra guard._measure goes on a device. host_time.py --nested (H100, MLP foreach)
put it in pipeline._land_last (~30 us a step, against 2.7 us for the same fill in a warm loop: landing_parts.py)
and in the step graph's run (+20-25 us over the default arm's, where graph_nodes.py finds the replay() call
itself +6 us). This times the parts inside a training step, the device drained before each step() as
host_time.py does, the default and the early arm in turn: Landing.synchronize's event.synchronize() and its
memmove (_land), the step graph's CUDAGraph.replay() and the rest of MeasureGraph.run, and the early read's
event.synchronize(). Run on the device: PYTHONPATH=$PWD python benchmarks/results/cpu_stop60/land_split.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import ampguard
from ampguard import payload

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from host_time import build

clock = time.perf_counter_ns
T: dict[str, list[int]] = {}


def timed(owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            T.setdefault(ARM[0] + label, []).append(clock() - t0)
    setattr(owner, name, wrapper)


ARM = [""]


def main(steps: int = int(os.environ.get("STEPS", 300))) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: a smoke run only
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timed(torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay")
    timed(torch.cuda.Event, "synchronize", "Event.synchronize")
    timed(payload.Landing, "_land", "Landing._land")
    timed(payload.Landing, "synchronize", "Landing.synchronize")
    arms = {}
    for arm, early in (("default", "0"), ("early", "1")):
        model, loss_fn = build("mlp", device)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        with mock.patch.dict(os.environ, {"AMPGUARD_STEP_GRAPH": "1", "AMPGUARD_EARLY_SKIP": early}):
            opt = ampguard.wrap(inner, model=model, precision="fp16", exporters=[])
        pipe = opt._pipeline
        for name in ("_land_last", "_learn_skip"):
            timed(pipe, name, f"pipeline.{name}")
        timed(pipe.step_graph, "run", "step_graph.run")
        timed(opt, "_measure", "guard._measure")
        timed(opt, "step", "guard.step")
        arms[arm] = (opt, loss_fn)
    for i in range(steps):
        for arm, (opt, loss_fn) in arms.items():
            ARM[0] = f"{arm:<8} " if i >= 50 else "warm "
            with opt.autocast():
                loss = loss_fn()
            opt.backward(loss)
            sync()
            opt.step()
            sync()
            opt.zero_grad(set_to_none=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; {steps - 50} steps an arm, interleaved; "
          "us a call: p25 / median / p75 (calls a step)")
    for key in sorted(k for k in T if not k.startswith("warm")):
        qs = statistics.quantiles(T[key], n=4)
        print(f"{key:<40} {qs[0] / 1e3:7.1f} / {qs[1] / 1e3:7.1f} / {qs[2] / 1e3:7.1f}"
              f"   ({len(T[key]) / (steps - 50):.1f})")


if __name__ == "__main__":
    main()
