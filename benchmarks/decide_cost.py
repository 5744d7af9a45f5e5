#!/usr/bin/env python
"""What the step decision costs, before and after the rule was written once.

Before (``--base``, default ``4a6c9d3``): ``policies.decide_host`` and ``scaling.next_scale_host``,
a hand-written float32 emulation beside the tensor rule ``policies.decide``. After (this tree):
one rule (``policies.rule``) over ``ampguard.ops``' two executions. The base's ``policies.py`` and
``scaling.py`` are read with ``git show`` into a temporary package, so both run in ONE process.

1. **Host decision, CPU** (what every CPU step, and every non-fused optimizer's step, pays): per
   config, one pre-generated sequence of gathered matrices (world 1: a noisy healthy norm and loss,
   2% x10 spikes, 1% non-finite gradients; the headroom column sampled every 10th step), and each
   implementation's ``decide_host`` on its own carried state and scaler, timed call by call,
   interleaved (old, new, new, old, ...). The pipeline's write of the new scale and tracker runs
   between calls, untimed; each step's decision vectors are checked equal, bit for bit.
   Reported: p25 / median / p75 of the per-call times, in microseconds, and the median's change.
2. **Tensor decision** (the CUDA graph's content): the ops ``decide`` dispatches on CPU tensors,
   counted with a ``TorchDispatchMode``, view ops (no kernel) left out: about the kernels a
   captured graph replays. Also its CPU time (median, microseconds: not a path CPU runs).
3. **CUDA** (when a GPU is there): ``decide`` captured as a CUDA graph, as ``pipeline.DecisionGraph``
   captures it; one replay's device time (CUDA events over blocks of 200 replays, old and new blocks
   interleaved), median over the blocks.

    python benchmarks/decide_cost.py                 # two runs, the tables
    python benchmarks/decide_cost.py --runs 1 --steps 2000
"""

from __future__ import annotations

import argparse
import importlib
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ampguard import policies as new
from ampguard.config import GuardConfig, Spikes, ZClip
from ampguard.scale_rule import ScalerView, ScaleState
from ampguard.stats import LOCAL_K, Dec, Loc

ROOT = Path(__file__).resolve().parents[1]

CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (the base's GuardConfig fields, this tree's): the same detectors, named as each tree names them
    "default": ({}, {}),
    "grad_spike_factor": ({"grad_spike_factor": 3.0, "loss_spike_factor": 3.0, "on_spike": "skip"},
                          {"spikes": Spikes(grad_factor=3.0, loss_factor=3.0, action="skip")}),
    "zscore": ({"spike_detector": "zscore", "on_spike": "skip"}, {"spikes": Spikes(grad_zscore=4.0, action="skip")}),
    "zclip": ({"zclip": True}, {"zclip": ZClip()}),
    "clip_grad_norm": ({"clip_grad_norm": 1.0}, {"clip_grad_norm": 1.0}),
    "hysteresis=2": ({"hysteresis": 2}, {"hysteresis": 2}),
    "headroom": ({"scale_policy": "headroom", "numerics_every": 10},
                 {"scale_policy": "headroom", "numerics_every": 10}),
}

_VIEWS = {"aten.view.default", "aten.select.int", "aten.slice.Tensor", "aten.alias.default",
          "aten._reshape_alias.default", "aten.reshape.default", "aten.unsqueeze.default", "aten.expand.default",
          "aten.detach.default"}


def old_modules(base: str, base_dir: str | None = None) -> ModuleType:
    """The base's policies.py (with its scaling.py) as a package of its own, importable beside ampguard
    (``base_dir``: a folder holding the two files, for a copy of the tree without ``.git``)."""
    tmp = Path(tempfile.mkdtemp(prefix="decide_cost_"))
    pkg = tmp / "ampguard_base_rule"
    pkg.mkdir()
    for name in ("policies", "scaling", "config"):
        if base_dir is not None:
            text = (Path(base_dir) / f"{name}.py").read_text()
        else:
            text = subprocess.run(["git", "-C", str(ROOT), "show", f"{base}:ampguard/{name}.py"], check=True,
                                  capture_output=True, text=True).stdout
        (pkg / f"{name}.py").write_text(text)
    (pkg / "__init__.py").write_text("")
    (pkg / "stats.py").write_text("from ampguard.stats import DECISION_K, Loc  # noqa\n")
    (pkg / "errors.py").write_text("from ampguard.errors import GuardStateError  # noqa\n")
    sys.path.insert(0, str(tmp))
    return importlib.import_module("ampguard_base_rule.policies")


def old_config(old: ModuleType, kw: dict[str, Any]) -> Any:
    """The base tree's own GuardConfig (its field names), for the base's rule."""
    return sys.modules[old.__name__.rsplit(".", 1)[0] + ".config"].GuardConfig(**kw)


def steps(n: int, seed: int = 0) -> list[torch.Tensor]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        row = [0.0] * LOCAL_K
        row[Loc.LOSS] = rng.uniform(1.0, 1.2)
        row[Loc.GRAD_NORM] = rng.gauss(2.0, 0.2) * (10.0 if rng.random() < 0.02 else 1.0)
        if rng.random() < 0.01:
            row[Loc.GRAD_NORM], row[Loc.FOUND_INF], row[Loc.NONFINITE_TENSORS] = math.inf, 1.0, 1.0
        row[Loc.HEADROOM] = rng.uniform(2.0, 6.0) if i % 10 == 0 else math.nan
        row[Loc.SENTINEL] = -1.0
        out.append(torch.tensor([row], dtype=torch.float32))
    return out


class Path_:
    """One implementation's decide_host, with its own carried state and scaler."""

    def __init__(self, module: ModuleType, config: Any) -> None:
        cpu = torch.device("cpu")
        self.fn = module.decide_host
        self.config = config
        self.spikes = module.SpikeState.fresh(cpu)
        scaling = sys.modules[module.__name__.rsplit(".", 1)[0] + ".scaling"] if module is not new else None
        self.scale_state = (scaling.ScaleState if scaling else ScaleState).fresh(cpu)
        view_cls = scaling.ScalerView if scaling else ScalerView
        self.view = view_cls(torch.tensor(2.0**16), torch.zeros((), dtype=torch.int32), 2.0, 0.5, 20)
        self.times: list[int] = []

    def step(self, g: torch.Tensor) -> list[float]:
        t0 = time.perf_counter_ns()
        out, tracker = self.fn(g, config=self.config, spikes=self.spikes, scale_state=self.scale_state,
                               scaler=self.view, grads_sharded=False)
        self.times.append(time.perf_counter_ns() - t0)
        self.view.scale.fill_(out[Dec.NEXT_SCALE])  # the pipeline's update, untimed
        self.view.growth_tracker.fill_(tracker)
        return list(out)


def _bits(v: list[float]) -> list[Any]:
    return ["nan" if math.isnan(x) else x for x in v]


def host_table(old: ModuleType, n: int) -> list[tuple[str, list[float], list[float]]]:
    rows = []
    seq = steps(n)
    for name, kw in CONFIGS.items():
        a, b = Path_(old, old_config(old, kw[0])), Path_(new, GuardConfig(**kw[1]))
        for i, g in enumerate(seq):
            first, second = (a, b) if i % 2 == 0 else (b, a)
            x, y = first.step(g), second.step(g)
            if _bits(x) != _bits(y):
                raise AssertionError(f"{name}, step {i}: the decisions differ\n{x}\n{y}")
        warm = n // 10  # the first steps: caches, lazy imports
        rows.append((name, _quartiles(a.times[warm:]), _quartiles(b.times[warm:])))
    return rows


def _quartiles(ns: list[int]) -> list[float]:
    q = statistics.quantiles(ns, n=4)
    return [q[0] / 1e3, q[1] / 1e3, q[2] / 1e3]


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name not in _VIEWS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def tensor_ops(module: ModuleType, config: Any, g: torch.Tensor) -> tuple[int, int, float]:
    """(ops dispatched by one tensor decision, of which host reads, median CPU microseconds)."""
    cpu = torch.device("cpu")
    scaling = sys.modules[module.__name__.rsplit(".", 1)[0] + ".scaling"] if module is not new else None
    spikes = module.SpikeState.fresh(cpu)
    state = (scaling.ScaleState if scaling else ScaleState).fresh(cpu)
    view = (scaling.ScalerView if scaling else ScalerView)(torch.tensor(2.0**16),
                                                          torch.zeros((), dtype=torch.int32), 2.0, 0.5, 20)
    kw = dict(config=config, spikes=spikes, scale_state=state, scaler=view, grads_sharded=False)
    with _Count() as c:
        module.decide(g, **kw)
    times = []
    for _ in range(60):
        t0 = time.perf_counter_ns()
        module.decide(g, **kw)
        times.append(time.perf_counter_ns() - t0)
    reads = sum(1 for op in c.ops if "_local_scalar_dense" in op or "item" in op)
    return len(c.ops), reads, statistics.median(times) / 1e3


def cuda_graph(module: ModuleType, config: Any, g: torch.Tensor) -> Any:
    """``decide`` captured as one CUDA graph (as ``pipeline.DecisionGraph`` captures it), after one eager run."""
    dev = torch.device("cuda")
    scaling = sys.modules[module.__name__.rsplit(".", 1)[0] + ".scaling"] if module is not new else None
    view = (scaling.ScalerView if scaling else ScalerView)(torch.full((), 2.0**16, device=dev),
                                                          torch.zeros((), dtype=torch.int32, device=dev), 2.0, 0.5, 20)
    kw = dict(config=config, spikes=module.SpikeState.fresh(dev),
              scale_state=(scaling.ScaleState if scaling else ScaleState).fresh(dev), scaler=view, grads_sharded=False)
    static = g.to(dev)
    module.decide(static, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module.decide(static, **kw)
    return graph


def cuda_table(old: ModuleType, reps: int = 200, blocks: int = 15) -> None:
    """Replay time of the captured decision, old and new, interleaved blocks of ``reps`` replays."""
    print("\n## Tensor decision on CUDA: one replay of the captured graph, microseconds (median of blocks)\n")
    print(f"| {'config':<17} | {'old':>8} | {'new':>8} | {'change':>8} |")
    print(f"|{'-' * 19}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
    g = steps(1)[0]
    for name, kw in CONFIGS.items():
        graphs = [cuda_graph(old, old_config(old, kw[0]), g), cuda_graph(new, GuardConfig(**kw[1]), g)]
        times: list[list[float]] = [[], []]
        for b in range(blocks):
            for i in ((0, 1) if b % 2 == 0 else (1, 0)):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    graphs[i].replay()
                end.record()
                end.synchronize()
                times[i].append(start.elapsed_time(end) * 1e3 / reps)
        a, b_ = statistics.median(times[0]), statistics.median(times[1])
        print(f"| {name:<17} | {a:>8.2f} | {b_:>8.2f} | {b_ - a:>+8.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="4a6c9d3", help="the commit whose policies.py/scaling.py are 'old'")
    p.add_argument("--base-dir", help="read the base's policies.py and scaling.py from this folder, not git")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    old = old_modules(args.base, args.base_dir)
    print(f"# decide cost: base {args.base} (old) vs this tree (new); torch {torch.__version__}, "
          f"{args.steps} steps per config, CPU, 1 thread")
    for run in range(1, args.runs + 1):
        print(f"\n## Host decision (decide_host), run {run}: per call, microseconds\n")
        print(f"| {'config':<17} | {'old p25/med/p75':>20} | {'new p25/med/p75':>20} | {'median change':>13} |")
        print(f"|{'-' * 19}|{'-' * 22}|{'-' * 22}|{'-' * 15}|")
        for name, a, b in host_table(old, args.steps):
            fa, fb = "/".join(f"{x:.1f}" for x in a), "/".join(f"{x:.1f}" for x in b)
            print(f"| {name:<17} | {fa:>20} | {fb:>20} | {b[1] - a[1]:>+13.1f} |")
    print("\n## Tensor decision (decide): ops dispatched per call, views left out (~ kernels in the CUDA graph)\n")
    print(f"| {'config':<17} | {'old ops':>7} | {'new ops':>7} | {'host reads':>10} | {'old CPU us':>10} | "
          f"{'new CPU us':>10} |")
    print(f"|{'-' * 19}|{'-' * 9}|{'-' * 9}|{'-' * 12}|{'-' * 12}|{'-' * 12}|")
    g = steps(1)[0]
    for name, kw in CONFIGS.items():
        na, ra, ta = tensor_ops(old, old_config(old, kw[0]), g)
        nb, rb, tb = tensor_ops(new, GuardConfig(**kw[1]), g)
        print(f"| {name:<17} | {na:>7} | {nb:>7} | {f'{ra}/{rb}':>10} | {ta:>10.0f} | {tb:>10.0f} |")
    if torch.cuda.is_available():
        cuda_table(old)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
