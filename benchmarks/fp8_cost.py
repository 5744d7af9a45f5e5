#!/usr/bin/env python
"""The cost of the guard's fp8 monitoring on a GPT-2-style model trained with torchao float8 (issue 28's target).

Variants of the same run, each on its own copy of one converted model (fused AdamW, bf16 autocast): ``plain`` (fp8, no
guard), ``guard`` (``ampguard.wrap(..., fp8=False)``), ``guard+fp8`` (``wrap(model=...)``: every cast's amax and scale
each step, the underflow sampled every ``--numerics-every`` steps), ``guard+fp8-nosample`` (amax and scale only),
``guard+fp8-whole`` (``guard+fp8`` with the underflow and the range over every element of each cast,
``Fp8Monitor.sample = None``: the monitor before its row sample) and ``guard+fp8-stages`` (``guard+fp8`` with
``AMPGUARD_STEP_GRAPH=0``: the measurement, the local vector and the decision as separate stages, as every
fp8-monitored step ran before the fp8 flag joined the step graph). They run in paired, interleaved blocks (the order
rotated per block) of ``--steps`` steps, each block timed from a drained device to a drained device. Printed: per
variant the p25/median/p75 of the per-step time over the blocks, and the p25/median/p75 of its per-block ratio to
``plain``'s block of the same round (the target: ``guard+fp8`` at most 1.01x, ``guard+fp8-nosample`` at most 1.005x),
and the fastest-quartile ratio (the mean of the variant's fastest quarter of blocks over ``plain``'s: a host hiccup
only ever adds time, so the fastest blocks are the least disturbed; ``benchmarks/table.py``'s method), and the mean of
the per-block ratios. ``plain2``, the plain run built a second time, is the control: ``plain2 / plain`` is the noise
floor of the same measurement. ``guard+numerics`` is ``guard`` with the guard's own sampled numerics every
``--numerics-every`` steps (the gradients' zero fractions, ``GuardConfig.numerics_every``, which ``guard+fp8`` samples
too): ``guard+fp8`` over it is what the fp8 monitoring adds. Give ``--steps`` a multiple of ``--numerics-every``: each
block then holds the same number of sampled steps (with 5 steps a block and sampling every 10, every other block held
one, and the per-block ratios of the sampled variants were two populations, their median neither's).

    python benchmarks/fp8_cost.py --device cuda --blocks 30 --steps 10 [--compile] --out fp8_cost.json
    python benchmarks/fp8_cost.py --device cpu --blocks 3 --steps 2 --layers 2 --width 64 --seq 32   # emulated
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ampguard


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=args.width, n_layer=args.layers, n_head=max(1, args.width // 64), vocab_size=8192,
                        n_positions=args.seq, use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(args.device)
    # GPT-2's own layers are Conv1D; the float8 conversion swaps nn.Linear, so turn Conv1D into Linear first.
    from transformers.pytorch_utils import Conv1D

    for _, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                linear = torch.nn.Linear(child.weight.shape[0], child.weight.shape[1], device=args.device)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(module, child_name, linear)
    emulate = args.device == "cpu"
    return convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate),
                                      module_filter_fn=lambda m, fqn: "lm_head" not in fqn)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--numerics-every", type=int, default=10)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the timing: this many steps of each variant under torch.profiler; prints the "
                             "device kernel time and count per step, and the kernels each guarded variant adds to "
                             "plain's")
    parser.add_argument("--variants",
                        default="plain,plain2,guard,guard+numerics,guard+fp8,guard+fp8-nosample,guard+fp8-whole,"
                                "guard+fp8-stages",
                        help="comma-separated subset of the variants (plain is always kept: the ratios' base)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    base = _model(args)
    runs: dict[str, dict[str, Any]] = {}
    every = args.numerics_every  # per variant: (fp8 monitoring, GuardConfig.numerics_every); None: no guard
    variants = (("plain", None), ("plain2", None), ("guard", (False, None)), ("guard+numerics", (False, every)),
                ("guard+fp8", (True, every)), ("guard+fp8-nosample", (True, 10**9)), ("guard+fp8-whole", (True, every)),
                ("guard+fp8-stages", (True, every)))
    wanted = set(args.variants.split(",")) | {"plain"}
    for name, guarded in variants:
        if name not in wanted:
            continue
        model = copy.deepcopy(base)
        fwd = torch.compile(model) if args.compile else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
        if guarded is not None:
            # guard+fp8-stages: the step graph off (read at wrap time), as every fp8 step ran before 4676bd1
            with mock.patch.dict(os.environ, {"AMPGUARD_STEP_GRAPH": "0"} if name == "guard+fp8-stages" else {}):
                opt = ampguard.wrap(opt, model=model, precision="bf16", fp8=guarded[0],
                                    config={"numerics_every": guarded[1], "param_check_every": None})
        if name == "guard+fp8-whole":  # the underflow over every element (the monitor before its row sample)
            opt._fp8.sample = None
        runs[name] = {"model": fwd, "opt": opt, "guarded": guarded is not None, "times": []}
    tokens = torch.randint(0, 8192, (args.batch, args.seq), device=args.device)

    def block(run: dict[str, Any], steps: int) -> float:
        _sync(args.device)
        start = time.perf_counter()
        opt = run["opt"]
        for _ in range(steps):
            with torch.autocast(args.device, dtype=torch.bfloat16):
                loss = run["model"](tokens, labels=tokens).loss
            if run["guarded"]:
                opt.backward(loss)
            else:
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(args.device)
        return (time.perf_counter() - start) / steps

    names = list(runs)
    for name in names:  # warm-up (and compile) outside the timed blocks
        block(runs[name], max(3, args.numerics_every + 1 if args.compile else 3))
    gc.collect()
    for b in range(args.blocks):
        for name in names[b % len(names):] + names[: b % len(names)]:
            runs[name]["times"].append(block(runs[name], args.steps))
    skipped = {name: run["opt"].skipped_steps for name, run in runs.items() if run["guarded"]}

    def quartiles(xs: list[float]) -> tuple[float, float, float]:
        xs = sorted(xs)
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        return q[0], statistics.median(xs), q[2]

    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "ms_per_step": {},
                              "ratio_to_plain": {}, "skipped_steps": skipped,
                              "torch": torch.__version__, "device_name": torch.cuda.get_device_name()
                              if args.device == "cuda" else "cpu"}
    for name in names:
        p25, med, p75 = quartiles(runs[name]["times"])
        ratios = [t / p for t, p in zip(runs[name]["times"], runs["plain"]["times"])]
        r25, rmed, r75 = quartiles(ratios)
        quarter = max(1, len(ratios) // 4)
        fastest = (statistics.fmean(sorted(runs[name]["times"])[:quarter])
                   / statistics.fmean(sorted(runs["plain"]["times"])[:quarter]))
        result["ms_per_step"][name] = {"p25": p25 * 1e3, "median": med * 1e3, "p75": p75 * 1e3}
        mean = statistics.fmean(ratios)
        result["ratio_to_plain"][name] = {"p25": r25, "median": rmed, "p75": r75, "fastest_quartile": fastest,
                                          "mean": mean}
        result.setdefault("block_ms", {})[name] = [t * 1e3 for t in runs[name]["times"]]
        print(f"{name:20s} p25 {p25 * 1e3:9.3f}  median {med * 1e3:9.3f}  p75 {p75 * 1e3:9.3f} ms/step   "
              f"ratio to plain p25 {r25:.4f} median {rmed:.4f} p75 {r75:.4f} fastest-quartile {fastest:.4f} "
              f"mean {mean:.4f}")
    print("skipped steps:", skipped)
    if args.profile_steps:
        result["profile"] = {name: _profile(lambda run=run: block(run, args.profile_steps), args.profile_steps)
                             for name, run in runs.items()}
        _print_profile(result["profile"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


def _profile(run_block: Any, steps: int) -> dict[str, Any]:
    """Kernel time and count per step by kernel name, over one block of ``steps`` steps under ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_block()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if "CUDA" not in str(getattr(ev, "device_type", "")) or getattr(ev, "is_user_annotation", False):
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        k = kernels.setdefault(ev.name[:110], [0.0, 0.0])
        k[0] += 1 / steps
        k[1] += us / steps
    return {"kernel_us_per_step": sum(v[1] for v in kernels.values()),
            "kernels_per_step": sum(v[0] for v in kernels.values()), "kernels": kernels}


def _print_profile(prof: dict[str, dict[str, Any]]) -> None:
    base = prof["plain"]
    for name, p in prof.items():  # kernel time: the device's share, which a host-bound lease's wall clock hides
        ratio = p["kernel_us_per_step"] / base["kernel_us_per_step"] if base["kernel_us_per_step"] else math.nan
        print(f"profile {name:20s} kernels/step {p['kernels_per_step']:7.1f}  kernel time/step "
              f"{p['kernel_us_per_step'] / 1e3:8.3f} ms  ratio to plain {ratio:.4f}")
    for name, p in prof.items():
        if name.startswith("plain"):
            continue
        diff = []
        for k in set(p["kernels"]) | set(base["kernels"]):
            c, t = p["kernels"].get(k, [0.0, 0.0])
            c0, t0 = base["kernels"].get(k, [0.0, 0.0])
            if abs(c - c0) > 0.01 or abs(t - t0) > 2.0:
                diff.append((t - t0, c - c0, k))
        diff.sort(key=lambda d: -abs(d[0]))
        print(f"  {name}: kernels added to plain's (us/step, count/step), largest first")
        for dt, dc, k in diff[:30]:
            print(f"    {dt:+9.1f} us  {dc:+6.1f}  {k}")


if __name__ == "__main__":
    main()
