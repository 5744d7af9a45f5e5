"""Stop 62: the decision rule fused by torch.compile, against the rule as it runs in the step graph (one kernel an op).

Issue 26's MLP foreach row (+133 / +152 us of host time against 100) is mostly the skip read waiting for the step
graph, ~70 small kernels of which ~58 are the local vector, the rule and the payload (``cpu_stop59/early_census.py``).
``docs/design.md`` turned ``torch.compile`` of the rule down because Triton divides approximately and contracts
multiply-adds, and the rule is held bit for bit to the host's. torch has since grown the switches for both
(``torch._inductor.config.eager_numerics.division_rounding``: ``/`` as ``div_rn``; ``emulate_precision_casts``:
no fp fusion). Two questions, on the device, before any of it goes into the library:

1. bits: ``policies.decide`` compiled (inductor, ``fullgraph``, those two options; and without them, to see
   whether they matter) against ``policies.decide`` eager, on tests/unit/test_host_decision.py's random configs,
   states and gathered rows (specials included), every output and every carried statistic compared bit for bit;
2. time: each captured in a CUDA graph as the step graph captures it (``decision_graph.captured``), for the default
   GuardConfig with a GradScaler: kernels a run (``torch.profiler``), device time a replay (CUDA events over 2000
   replays), and a replay's wall time with the host waiting for its end (the skip read's situation), median of 2000.

Run from the repository root: ``PYTHONPATH=$PWD python benchmarks/results/cpu_stop62/fused_rule.py`` (CUDA; on the
CPU ``--device cpu`` checks the bits with inductor's C++ backend, slowly: a compile a config)."""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import ampguard.ops as ops_module
import ampguard.policies as policies
import ampguard.scale_rule as scale_rule
from ampguard.config import GuardConfig
from ampguard.decision_graph import captured
from ampguard.policies import decide
from tests.unit.test_host_decision import (
    DETECTOR_COUNTS,
    DETECTOR_FLOATS,
    Carried,
    bits,
    rand_carried,
    rand_config,
    rand_row,
)

# f32 rounds a Python float through struct: a constant of the trace, not an op
_f32 = torch.compiler.assume_constant_result(ops_module.f32)
for _m in (ops_module, policies, scale_rule):
    _m.f32 = _f32  # type: ignore[attr-defined]

EXACT = {"eager_numerics.division_rounding": True, "emulate_precision_casts": True}


def on(device: torch.device, carried: Carried):
    spikes, state, view = carried.tensors()
    move = lambda t: t.to(device)  # noqa: E731
    spikes = type(spikes)(*(move(getattr(spikes, f.name)) for f in dataclasses.fields(spikes)))
    state = type(state)(*(move(getattr(state, f.name)) for f in dataclasses.fields(state)))
    if view is not None:
        view = dataclasses.replace(view, scale=move(view.scale), growth_tracker=move(view.growth_tracker))
    return spikes, state, view


def outputs(fn, g, config, carried, device):
    spikes, state, view = on(device, carried)
    out, tracker = fn(g.clone(), config=config, spikes=spikes, scale_state=state, scaler=view, grads_sharded=False)
    floats = out.tolist() + [getattr(spikes, n).item() for n in DETECTOR_FLOATS]
    ints = [getattr(spikes, n).item() for n in DETECTOR_COUNTS] + [state.overflow_run.item()]
    if tracker is not None:
        ints.append(tracker.item())
    return floats, ints


def check_bits(device: torch.device, configs: int, inputs: int, options: dict | None, seed: int) -> None:
    rng = random.Random(seed)
    torch._dynamo.config.cache_size_limit = 64
    mismatched, total, names = 0, 0, []
    t0 = time.perf_counter()
    for _ in range(configs):
        config = rand_config(rng)
        factors = rand_carried(rng)  # the scaler's constants: one set a config (each set compiles once)
        comp = torch.compile(decide, fullgraph=True, dynamic=False, options=options)
        for _ in range(inputs):
            carried = dataclasses.replace(rand_carried(rng), growth_factor=factors.growth_factor,
                                          backoff_factor=factors.backoff_factor,
                                          growth_interval=factors.growth_interval)
            if rng.random() < 0.8 and carried.scale is None:
                carried = dataclasses.replace(carried, scale=65536.0)
            g = torch.tensor([rand_row(rng, p_bad=rng.choice([0.0, 0.2, 0.6]))], dtype=torch.float32, device=device)
            (fa, ia), (fb, ib) = outputs(decide, g, config, carried, device), outputs(comp, g, config, carried, device)
            total += 1
            bad = [k for k, (a, b) in enumerate(zip(fa, fb)) if bits(a) != bits(b)] + (["ints"] if ia != ib else [])
            if bad:
                mismatched += 1
                if len(names) < 6:
                    names.append((bad, [fa[k] for k in bad if k != "ints"], [fb[k] for k in bad if k != "ints"],
                                  g.tolist(), config, carried))
    label = "exact options" if options else "inductor defaults"
    print(f"bits, {label}: {mismatched} of {total} decisions differ ({configs} configs, "
          f"{time.perf_counter() - t0:.0f} s)")
    for n in names:
        print("   ", *n, sep="\n     ")


def kernels(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def timing(device: torch.device, reps: int) -> None:
    config = GuardConfig()
    carried = Carried(scale=65536.0)
    rng = random.Random(7)
    g = torch.tensor([rand_row(rng, p_bad=0.0)], dtype=torch.float32, device=device)
    comp = torch.compile(decide, fullgraph=True, dynamic=False, options=EXACT)
    arms = {}
    for name, fn in (("eager rule", decide), ("compiled rule", comp)):
        spikes, state, view = on(device, carried)

        def run(fn=fn, spikes=spikes, state=state, view=view):
            return fn(g, config=config, spikes=spikes, scale_state=state, scaler=view, grads_sharded=False)

        run()
        run()
        torch.cuda.synchronize()
        n = kernels(run)
        graph, _ = captured(run)
        torch.cuda.synchronize()
        arms[name] = (graph, n)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = {}
    for name, (graph, n) in arms.items():
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        device_us = start.elapsed_time(end) * 1e3 / reps
        walls = []
        for _ in range(reps):
            t = time.perf_counter_ns()
            graph.replay()
            torch.cuda.current_stream().synchronize()
            walls.append((time.perf_counter_ns() - t) / 1e3)
        q = statistics.quantiles(walls, n=4)
        rows[name] = (n, device_us, q)
    print(f"\ntime, default GuardConfig with a GradScaler, {reps} replays an arm "
          f"({torch.cuda.get_device_name(device)}):")
    print(f"  {'arm':<14} {'kernels':>8} {'device us/replay':>17} {'replay+sync wall us p25/median/p75':>38}")
    for name, (n, dev, q) in rows.items():
        print(f"  {name:<14} {n:>8} {dev:>17.1f} {q[0]:>14.1f} {q[1]:>8.1f} {q[2]:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--configs", type=int, default=6)
    ap.add_argument("--inputs", type=int, default=60)
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {device}")
    if device.type == "cuda":
        timing(device, args.reps)
    check_bits(device, args.configs, args.inputs, EXACT, seed=1)
    if device.type == "cuda":
        check_bits(device, args.configs, args.inputs, None, seed=1)


if __name__ == "__main__":
    main()
