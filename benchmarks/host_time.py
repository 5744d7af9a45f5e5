#!/usr/bin/env python
"""Host time of one ``step()``: the plain GradScaler loop's ``scaler.step(opt); scaler.update()``
against the guard's ``opt.step()``, and where each microsecond of the guard's goes.

Each measured call starts on a drained device (``torch.cuda.synchronize()`` after the backward),
so what is timed is the host's own work: Python, kernel launches, and any wait the call makes
on the device (a sync shows up as time here). Plain and guarded steps alternate in blocks, in one
process; the figure is the median (p25, p75) over the steps of all blocks. The mean is printed
beside it: it also counts what only every N-th step pays (``param_check_every``, default 10: the
median never sees it).

The breakdown wraps the guard's stages (``guard._fresh_grads``, ``outcome.settle``,
``pipeline.measure``/``gather``/``decide``/``clip``/``inner_step``/``update_scale``/``payload``,
``reporter.enqueue``, ``guard._end_step``) with a timer on the instance; "rest" is the step's time
outside every stage. A stage in brackets, ``(pipeline._learn_skip)``, runs inside one of those (a non-fused step's skip
read, its one sync, inside ``inner_step``) and is shown beside the sums, not in them. The timers cost ~0.2 us each, so
the breakdown runs in blocks of its own and the headline figures come from unwrapped steps. ``inner_step`` holds the
optimizer's own update: compare it with the plain row's whole step.

On the CPU the "device" is the host: every stage's time includes its arithmetic. Use tiny, deep
models there (``gpt2-deep``: GPT-2's 148 parameter tensors at width 32) to see the Python work that
grows with the parameter count. Run::

    python benchmarks/host_time.py --device cuda --models mlp,gpt2-350m --optims fused,foreach
    python benchmarks/host_time.py --device cuda --models mlp-fp8 --optims fused --step-graph   # torchao float8
    python benchmarks/host_time.py --device cpu --models mlp,gpt2-deep --optims fused,foreach --blocks 6 --clock thread
    python benchmarks/host_time.py --device cpu --models mlp-small --optims foreach --batch-arm --clock thread

``--host-arm`` also times the default guard with a non-fused optimizer's decision on the host
(``AMPGUARD_UNFUSED_HOST_DECISION=1``, how foreach steps ran before stop 55) in the same blocks.

``--early-arm`` also times the default guard with the step graph's early skip flag (``AMPGUARD_EARLY_SKIP=1``: a
non-fused step's skip read waits for the flag, not for the whole graph; stop 59) in the same blocks.

``--fused-rule-arm`` also times the default guard with the step graph's local vector, decision and payload compiled
(``AMPGUARD_FUSED_RULE=1``: a few kernels where the rule ran ~45; stop 62) in the same blocks.

``--batch-arm`` also times the default guard with each report decoded at its own step (``AMPGUARD_REPORT_BATCH=0``,
the behaviour before stop 45) in the same blocks: compare the means, since a batch's decode lands on one step in 16.

``--nested OWNER:NAME,...`` times more methods inside the stages, shown in brackets beside the sums: ``OWNER`` is an
attribute path on the guard (``_pipeline``, ``_pipeline.step_graph``, ``_pipeline.adapter``), ``NAME`` a method of
it. Stop 60 found the early flag's extra ``_measure`` this way (``_pipeline:_land_last,_pipeline.step_graph:run``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ampguard

CLOCK = [time.perf_counter_ns]
"""The clock of every timing: wall time, or with ``--clock thread`` the calling thread's CPU time
(``time.thread_time_ns``: on a shared CPU machine, with ``OMP_NUM_THREADS=1``, the time the step
computed, without the time other processes held the core; a wait on a device does not count)."""

STAGES = {  # owner attribute path on the guard -> stage methods timed
    "": ("_fresh_grads", "_check_step_call", "_end_step", "_measure"),
    "_outcome": ("settle",),
    "_pipeline": ("gather", "decide", "clip", "inner_step", "update_scale", "payload"),
    "_reporter": ("enqueue",),
}
NESTED = {"_pipeline": ("_learn_skip",)}
"""Timed inside a stage, so not in its sums: a non-fused step's skip read (its one sync: the wait for the step graph,
or for the decision, then the copy), inside ``inner_step``; printed as ``(pipeline._learn_skip)`` (stop 58)."""


def add_nested(spec: str, nested: dict[str, tuple[str, ...]]) -> None:
    """``--nested OWNER:NAME,...``: each method added to ``nested`` beside those already timed for its owner (stop
    60: where the early arm's ``_measure`` goes)."""
    for item in filter(None, spec.split(",")):
        owner, _, name = item.partition(":")
        nested[owner] = (*nested.get(owner, ()), name)


def build(name: str, device: torch.device) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    if name in ("mlp", "mlp-fp8"):  # issue 26's 8x256 MLP; mlp-fp8: its 8 hidden layers as torchao Float8Linear
        layers: list[torch.nn.Module] = []
        for _ in range(8):
            layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 10)).to(device)
        if name == "mlp-fp8":  # the guard's fp8 monitoring turns on (wrap(model=...)); emulated off CUDA
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            model = convert_to_float8_training(model, config=Float8LinearConfig(emulate=device.type != "cuda"),
                                               module_filter_fn=lambda m, fqn: fqn != "16")  # the 10-wide head stays
        x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)
        return model, lambda: torch.nn.functional.cross_entropy(model(x), y)
    if name == "mlp-small":  # benchmarks/table.py's CPU model of that name (overhead.SIZES): 8 tensors, 0.7M floats
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import overhead
        size = overhead.SIZES[name]
        model, batch = overhead.build_model(size, device), overhead.make_batch(size, device)
        return model, lambda: overhead.compute_loss(model, batch)
    from transformers import GPT2Config, GPT2LMHeadModel
    shapes = {"gpt2-350m": dict(n_layer=24, n_embd=1024, n_head=16, batch=8, seq=512),
              "gpt2-124m": dict(n_layer=12, n_embd=768, n_head=12, batch=8, seq=512),
              "gpt2-deep": dict(n_layer=12, n_embd=32, n_head=4, batch=2, seq=16)}[name]
    batch, seq = shapes.pop("batch"), shapes.pop("seq")
    cfg = GPT2Config(vocab_size=50257 if name != "gpt2-deep" else 256, n_positions=max(seq, 64), **shapes)
    model = GPT2LMHeadModel(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    return model, lambda: model(input_ids=ids, labels=ids).loss


class Timers:
    """perf_counter wrappers set on the instances (shadowing the class's methods)."""

    def __init__(self, guard: Any, stages: dict[str, tuple[str, ...]] = STAGES) -> None:
        self.ns: dict[str, list[int]] = {}
        self.nested: dict[str, list[int]] = {}
        """Another Timers' figures for stages timed inside these (:data:`NESTED`), shown beside them."""
        self._undo: list[tuple[Any, str]] = []
        for path, names in stages.items():
            owner = guard
            for part in filter(None, path.split(".")):  # a dotted path: an attribute's attribute
                owner = getattr(owner, part)
            for name in names:
                self._wrap(owner, name, f"{path.strip('_') or 'guard'}.{name}")

    def _wrap(self, owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)
        acc = self.ns.setdefault(label, [])
        clock = CLOCK[0]

        def timed(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                acc.append(clock() - t0)
        setattr(owner, name, timed)
        self._undo.append((owner, name))

    def remove(self) -> None:
        for owner, name in self._undo:
            delattr(owner, name)


def run(model_name: str, optim: str, device: torch.device, blocks: int, steps: int, warmup: int,
        profile: int = 0, ops: int = 0, step_graph: bool = False, pstats_dir: Path | None = None,
        batch_arm: bool = False, host_arm: bool = False, early_arm: bool = False,
        fused_rule_arm: bool = False) -> dict[str, Any]:
    dtype = torch.float16
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    loops = {}
    variants = (["plain", "guard"] + (["guard-step"] if step_graph else []) + (["guard-perstep"] if batch_arm else [])
                + (["guard-host"] if host_arm else []) + (["guard-early"] if early_arm else [])
                + (["guard-fused"] if fused_rule_arm else []))
    for variant in variants:
        model, loss_fn = build(model_name, device)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4, **{optim: True})
        if variant == "plain":
            scaler = torch.amp.GradScaler(device.type)

            def fwd_bwd(model=model, loss_fn=loss_fn, scaler=scaler) -> None:
                with torch.autocast(device.type, dtype=dtype):
                    loss = loss_fn()
                scaler.scale(loss).backward()

            def step(inner=inner, scaler=scaler) -> None:
                scaler.step(inner)
                scaler.update()
            loops[variant] = (fwd_bwd, step, inner.zero_grad, None)
        else:  # guard-step: the step graph on (the default since stop 40); guard: the stages apart (=0);
            # guard-perstep: the step graph on, each report decoded at its step (AMPGUARD_REPORT_BATCH=0, stop 45);
            # guard-host: the step graph on, a non-fused optimizer's decision on the host (as before stop 55);
            # guard-early: the step graph on, its skip flag handed over before the graph ends (stop 59)
            # guard-fused: the step graph on, its tail (vector, rule, payload) compiled (AMPGUARD_FUSED_RULE, stop 62)
            env = {"AMPGUARD_STEP_GRAPH": "0" if variant == "guard" else "1",
                   "AMPGUARD_REPORT_BATCH": "0" if variant == "guard-perstep" else "1",
                   "AMPGUARD_UNFUSED_HOST_DECISION": "1" if variant == "guard-host" else "0",
                   "AMPGUARD_EARLY_SKIP": "1" if variant == "guard-early" else "0",
                   "AMPGUARD_FUSED_RULE": "1" if variant == "guard-fused" else "0"}
            with mock.patch.dict(os.environ, env):
                opt = ampguard.wrap(inner, model=model, precision="fp16", exporters=[])

            def fwd_bwd(opt=opt, loss_fn=loss_fn) -> None:
                with opt.autocast():
                    loss = loss_fn()
                opt.backward(loss)
            loops[variant] = (fwd_bwd, opt.step, opt.zero_grad, opt)

    def one(variant: str, out: list[int] | None) -> None:
        fwd_bwd, step, zero, _ = loops[variant]
        fwd_bwd()
        sync()
        clock = CLOCK[0]
        t0 = clock()
        step()
        t1 = clock()
        sync()
        zero(set_to_none=True)
        if out is not None:
            out.append(t1 - t0)

    for variant in loops:
        for _ in range(warmup):
            one(variant, None)
    times: dict[str, list[int]] = {variant: [] for variant in loops}
    names = list(loops)
    for b in range(blocks):
        order = names[b % len(names):] + names[:b % len(names)]  # rotated: each variant first in turn
        for variant in order:
            for _ in range(steps):
                one(variant, times[variant])
    breakdowns = {}
    for variant in names[1:]:
        timers = Timers(loops[variant][3])
        nested = Timers(loops[variant][3], NESTED)
        broken: list[int] = []
        for _ in range(max(steps, 20)):
            one(variant, broken)
        timers.remove()
        nested.remove()
        timers.nested = nested.ns
        breakdowns[variant] = (timers, broken)
    guard = loops["guard"][3]
    timers, broken = breakdowns["guard"]
    if ops:  # torch.profiler over step() only: each op's own host time, the launches, per step
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        n_steps = max(steps, 20)
        for variant in names:  # plain, guard (and guard-step)
            fwd_bwd, step, zero, _ = loops[variant]
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with torch_profile(activities=acts) as prof:  # CUDA: the runtime calls (launches) too
                for _ in range(n_steps):
                    fwd_bwd()
                    sync()
                    with torch.profiler.record_function("STEP"):
                        step()
                    sync()
                    zero(set_to_none=True)
            events = [e for e in prof.events() if e.name != "STEP"]
            steps_ev = [e for e in prof.events() if e.name == "STEP"]
            inside = [e for e in events if any(s.time_range.start <= e.time_range.start <= s.time_range.end
                                               for s in steps_ev)]
            agg: dict[str, list[float]] = {}
            for e in inside:
                a = agg.setdefault(e.name, [0, 0.0])
                a[0] += 1
                a[1] += e.self_cpu_time_total
            print(f"\n--- ops inside step(), {variant}, {model_name} {optim}: per step, by own host time ---")
            for name, (count, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:ops]:
                print(f"    {name:<48} {count / n_steps:7.1f} calls {us / n_steps:9.1f} us")
    if profile:
        import cProfile
        import io
        import pstats
        for variant in names[1:]:  # guard (and guard-step)
            prof = cProfile.Profile()
            fwd_bwd, step, zero, _ = loops[variant]
            for _ in range(max(steps, 20)):  # step() only: the forward and backward are not profiled
                fwd_bwd()
                sync()
                prof.enable()
                step()
                prof.disable()
                sync()
                zero(set_to_none=True)
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(profile)
            if pstats_dir is not None:  # the raw profile, to read at full precision: pstats.Stats(path)
                pstats_dir.mkdir(parents=True, exist_ok=True)
                prof.dump_stats(str(pstats_dir / f"{model_name}_{optim}_{variant}.pstats"))
            text.write("\n  ampguard's own functions by cumulative time:\n")
            pstats.Stats(prof, stream=text).sort_stats("cumtime").print_stats("ampguard", profile)
            print(f"\n--- cProfile of {max(steps, 20)} {variant} step() calls, {model_name} {optim} ---")
            print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:12000])
    graphs = guard._pipeline.measure_graph  # the measurement's CUDA graph: how often it was replayed
    steps_run = guard.step_count

    def q(xs: list[int]) -> dict[str, float]:
        qs = statistics.quantiles(xs, n=4)  # the mean also counts what every N-th step pays (param_check_every)
        return {"p25": qs[0] / 1e3, "median": qs[1] / 1e3, "p75": qs[2] / 1e3, "mean": statistics.fmean(xs) / 1e3}

    def breakdown(timers: Timers, broken: list[int]) -> tuple[dict[str, float], float]:
        n = len(broken)
        stages = {k: statistics.median(v) / 1e3 if len(v) == n else sum(v) / n / 1e3
                  for k, v in timers.ns.items() if v}
        total = statistics.median(broken) / 1e3
        stages["rest"] = total - sum(stages.values())  # no timed stage runs inside another
        for k, v in timers.nested.items():  # inside a stage: beside the sums, not in them
            if v:
                stages[f"({k})"] = statistics.median(v) / 1e3
        return stages, total

    def means(timers: Timers, broken: list[int]) -> dict[str, float]:
        """Each stage's time a step, mean over the timed steps (what every N-th step pays counts: a batch of
        reports decoded on one step in 16 moves a stage's median and leaves its mean), and the rest's."""
        n = len(broken)
        out = {k: sum(v) / n / 1e3 for k, v in timers.ns.items() if v}
        out["rest"] = statistics.fmean(broken) / 1e3 - sum(out.values())
        out.update({f"({k})": sum(v) / n / 1e3 for k, v in timers.nested.items() if v})
        return out
    stages, inner_total = breakdown(timers, broken)
    out = {"model": model_name, "optim": optim, "device": str(device), "plain_us": q(times["plain"]),
           "guard_us": q(times["guard"]), "breakdown_us": stages, "breakdown_total_us": inner_total,
           "breakdown_mean_us": means(timers, broken)}
    out["measure_graph"] = {"steps": steps_run, "captures": graphs.captures, "replays": graphs.replays}
    out["added_us"] = out["guard_us"]["median"] - out["plain_us"]["median"]
    out["added_mean_us"] = out["guard_us"]["mean"] - out["plain_us"]["mean"]

    def arm(variant: str, **extra: Any) -> dict[str, Any]:
        """A guarded arm timed in the same blocks: its times, its breakdown, ``extra`` (read before it is closed) and
        what it adds to the plain step; then the arm closed."""
        a_stages, a_total = breakdown(*breakdowns[variant])
        row = {"us": q(times[variant]), "breakdown_us": a_stages, "breakdown_total_us": a_total,
               "breakdown_mean_us": means(*breakdowns[variant]), **extra}
        row["added_us"] = row["us"]["median"] - out["plain_us"]["median"]
        row["added_mean_us"] = row["us"]["mean"] - out["plain_us"]["mean"]
        loops[variant][3].close()
        return row

    if step_graph:  # the step graph's guard, timed in the same blocks
        stepped = loops["guard-step"][3]
        sg = stepped._pipeline.step_graph
        out["guard_step"] = arm("guard-step", step_graph={"steps": stepped.step_count, "captures": sg.captures,
                                                          "replays": sg.replays})
    if batch_arm:  # each report decoded at its step, in the same blocks: what the batches save (the mean counts them)
        out["guard_perstep"] = arm("guard-perstep")
    if host_arm:  # a non-fused optimizer's host decision (before stop 55), in the same blocks
        out["guard_host"] = arm("guard-host", host_decision=loops["guard-host"][3]._pipeline.host_decision)
    if early_arm:  # the step graph's early skip flag (stop 59), in the same blocks
        early = loops["guard-early"][3]
        sg = early._pipeline.step_graph
        out["guard_early"] = arm("guard-early", early_skip=early._pipeline.early_skip,
                                 step_graph={"steps": early.step_count, "captures": sg.captures, "replays": sg.replays,
                                             "failed": sg.failed})
    if fused_rule_arm:  # the step graph's tail compiled (stop 62), in the same blocks
        fused = loops["guard-fused"][3]
        sg = fused._pipeline.step_graph
        out["guard_fused"] = arm("guard-fused", fused_rule=fused._pipeline.fused_rule,
                                 compile_failed=fused._pipeline._compile_failed,
                                 capture_misses=fused._pipeline.fused_rule_capture_misses,
                                 step_graph={"steps": fused.step_count, "captures": sg.captures, "replays": sg.replays,
                                             "failed": sg.failed})
    guard.close()
    return out


def stage_lines(arm: dict[str, Any]) -> None:
    """An arm's stages, the largest median first, each with its mean a step beside it."""
    mean = arm.get("breakdown_mean_us", {})
    for k, v in sorted(arm["breakdown_us"].items(), key=lambda kv: -kv[1]):
        print(f"    {k:<26} {v:8.1f} us   mean {mean.get(k, float('nan')):8.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="mlp")
    ap.add_argument("--optims", default="fused,foreach")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--profile", type=int, default=0,
                    help="also print cProfile's top N functions inside step() (own time)")
    ap.add_argument("--ops", type=int, default=0, help="also print the top N torch ops inside step() (torch.profiler)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--pstats", type=Path, default=None, help="with --profile: also dump each raw profile here")
    ap.add_argument("--step-graph", action="store_true",
                    help="also time a guard with the step graph on (the default since stop 40), in the same blocks; "
                         "'guard' is then the stages apart (AMPGUARD_STEP_GRAPH=0)")
    ap.add_argument("--batch-arm", action="store_true",
                    help="also time the default guard with each report decoded at its step (AMPGUARD_REPORT_BATCH=0) "
                         "in the same blocks; compare the means (a batch's decode lands on one step in 16)")
    ap.add_argument("--host-arm", action="store_true",
                    help="also time the default guard with a non-fused optimizer's decision on the host "
                         "(AMPGUARD_UNFUSED_HOST_DECISION=1, every step before stop 55) in the same blocks")
    ap.add_argument("--fused-rule-arm", action="store_true",
                    help="also time the default guard with the step graph's tail compiled (AMPGUARD_FUSED_RULE=1, "
                         "stop 62), in the same blocks")
    ap.add_argument("--early-arm", action="store_true",
                    help="also time the default guard with the step graph's early skip flag (AMPGUARD_EARLY_SKIP=1, "
                         "stop 59) in the same blocks")
    ap.add_argument("--nested", default="",
                    help="more stages timed inside others, shown beside the sums: OWNER:NAME,... where OWNER is an "
                         "attribute path on the guard (e.g. _pipeline:_land_last,_pipeline.step_graph:run)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: the thread's CPU time (a CPU run on a busy machine, OMP_NUM_THREADS=1)")
    args = ap.parse_args()
    add_nested(args.nested, NESTED)
    if args.clock == "thread":
        CLOCK[0] = time.thread_time_ns
    device = torch.device(args.device)
    rows = []
    for model_name in args.models.split(","):
        for optim in args.optims.split(","):
            row = run(model_name, optim, device, args.blocks, args.steps, args.warmup, args.profile, args.ops,
                      args.step_graph, args.pstats, args.batch_arm, args.host_arm, args.early_arm,
                      args.fused_rule_arm)
            rows.append(row)
            p, g = row["plain_us"], row["guard_us"]
            print(f"\n{model_name} {optim} on {device}: plain {p['median']:.0f} us (p25 {p['p25']:.0f}, p75 "
                  f"{p['p75']:.0f}); guard {g['median']:.0f} us (p25 {g['p25']:.0f}, p75 {g['p75']:.0f}); "
                  f"added {row['added_us']:+.0f} us; mean plain {p['mean']:.0f}, guard {g['mean']:.0f}, "
                  f"added {row['added_mean_us']:+.0f} us")
            mg = row["measure_graph"]
            print(f"  measurement graph: {mg['replays']} replays, {mg['captures']} captures in {mg['steps']} steps")
            print(f"  breakdown of a timed guarded step ({row['breakdown_total_us']:.0f} us, median):")
            stage_lines(row)
            if "guard_step" in row:
                st = row["guard_step"]
                u, sg = st["us"], st["step_graph"]
                print(f"  guard with the step graph: {u['median']:.0f} us (p25 {u['p25']:.0f}, p75 {u['p75']:.0f}); "
                      f"added {st['added_us']:+.0f} us; mean {u['mean']:.0f}, added {st['added_mean_us']:+.0f} us; "
                      f"step graph: {sg['replays']} replays, {sg['captures']} captures in {sg['steps']} steps")
                print(f"  its breakdown ({st['breakdown_total_us']:.0f} us, median):")
                stage_lines(st)
            if "guard_perstep" in row:
                st = row["guard_perstep"]
                u = st["us"]
                default = row.get("guard_step", row)  # the default guard: the step graph's arm where it ran
                print(f"  guard, each report decoded at its step: {u['median']:.0f} us (p25 {u['p25']:.0f}, p75 "
                      f"{u['p75']:.0f}); added {st['added_us']:+.0f} us; mean {u['mean']:.0f}, added "
                      f"{st['added_mean_us']:+.0f} us (the batched arm's mean: added {default['added_mean_us']:+.0f})")
                stage_lines(st)
            if "guard_host" in row:
                st = row["guard_host"]
                u = st["us"]
                print(f"  guard, the host decision (before stop 55; host_decision={st['host_decision']}): "
                      f"{u['median']:.0f} us (p25 {u['p25']:.0f}, p75 {u['p75']:.0f}); added {st['added_us']:+.0f} us; "
                      f"mean {u['mean']:.0f}, added {st['added_mean_us']:+.0f} us")
                stage_lines(st)
            for key, label, flags in (("guard_early", "the early skip flag", ("early_skip",)),
                                      ("guard_fused", "the fused rule",
                                       ("fused_rule", "compile_failed", "capture_misses"))):
                if key in row:  # an arm on the step graph: its times, then its graph's counts
                    st = row[key]
                    u, sg = st["us"], st["step_graph"]
                    print(f"  guard, {label} ({', '.join(f'{k}={st[k]}' for k in flags)}): {u['median']:.0f} us "
                          f"(p25 {u['p25']:.0f}, p75 {u['p75']:.0f}); added {st['added_us']:+.0f} us; mean "
                          f"{u['mean']:.0f}, added {st['added_mean_us']:+.0f} us; step graph: {sg['replays']} replays, "
                          f"{sg['captures']} captures in {sg['steps']} steps, failed={sg['failed']}")
                    stage_lines(st)
            sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "torch": torch.__version__, "clock": args.clock,
                                         "ampguard_from": str(Path(ampguard.__file__).resolve().parent),
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
