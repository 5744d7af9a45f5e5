#!/usr/bin/env python
"""Per-step cost of issue 17's sampled numerics and leading indicators: a guarded fp16 step with
``GuardConfig(numerics_every=N, indicators_every=N)`` against the same guarded step with neither,
interleaved in one process.

Variants (each with its own copy of the model, same initial weights, same batch; fused AdamW, an
enabled GradScaler, ``ampguard.wrap(model=...)``, so the fused fast path is taken):

  off          ``GuardConfig()``: the baseline
  indicators   ``GuardConfig(numerics_every=N, indicators_every=N)`` (default N=10): on every N-th step
               the leading indicators (per top-level module gradient norm and update ratio,
               ``ampguard.indicators``: a copy of the parameters, two foreach norms, two segment sums)
               and the fp16 numerics; other steps pay two integer compares

Timing (the method and helpers of ``overhead.py``: model, batch, guarded step, ``time_variants``): blocks of
``--block`` steps, each block visits every variant once in an order rotated per block, the device
synchronised at block edges; a block's time / ``--block`` is one sample. A block should hold a
multiple of N steps (the default: ``--block`` = N) so every block of ``indicators`` contains the same
number of sampled steps. Reported: each variant's median/p25/p75 step time, and the p25/median/p75
of the per-block ratios ``indicators / off`` (blocks paired by index: they ran back to back).

    python benchmarks/numerics_indicators.py --device cuda --out benchmarks/results/numerics_h200.json
    python benchmarks/numerics_indicators.py --device cpu --quick   # smoke: a few seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: overhead.py's helpers
from overhead import SIZES, Variant, build_model, guarded_step, make_batch, time_variants

import ampguard  # overhead.py put the repository on sys.path

#: variant name -> the GuardConfig fields it sets (``{every}``: the --every value)
VARIANTS: dict[str, dict[str, Any]] = {
    "off": {"numerics_every": None, "indicators_every": None},
    "indicators": {"numerics_every": "{every}", "indicators_every": "{every}"},
}


def build(name: str, ctx: dict[str, Any]) -> Variant:
    """A guarded step of the ``name`` variant on its own copy of the model."""
    device: torch.device = ctx["device"]
    model = build_model(ctx["size"], device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**12)
    fields = {k: (ctx["every"] if v == "{every}" else v) for k, v in VARIANTS[name].items()}
    g = ampguard.wrap(opt, model=model, scaler=scaler, precision="fp16", config=ampguard.GuardConfig(**fields))
    v = Variant(name, step=guarded_step(g, model, ctx["batch"], ctx["autocast"]), close=g.close)
    v.info["guard"] = g
    return v


def quartiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"p25": q[0], "median": q[1], "p75": q[2]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--model-size", choices=sorted(SIZES), default=None,
                    help="default: gpt2 on CUDA (GPT-2 124M), gpt-tiny on CPU and with --quick")
    ap.add_argument("--every", type=int, default=10,
                    help="numerics_every and indicators_every of the indicators variant (default 10)")
    ap.add_argument("--block", type=int, default=None, help="steps per timing block (default: --every)")
    ap.add_argument("--blocks", type=int, default=None, help="timed blocks (default 30; --quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed blocks first (default 2; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="smoke mode: tiny GPT, few blocks (seconds on CPU)")
    ap.add_argument("--out", default=None, help="write the JSON results here")
    args = ap.parse_args(argv)
    if args.every < 1:
        ap.error(f"--every={args.every}: allowed an int >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu)")
    device = torch.device(args.device)
    if args.model_size is None:
        args.model_size = "gpt2" if device.type == "cuda" and not args.quick else "gpt-tiny"
    args.block = args.block or args.every
    args.blocks = args.blocks or (2 if args.quick else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    size = dict(SIZES[args.model_size])
    if args.quick and device.type == "cpu":
        size.update(vocab=512, seq=32, batch=2)  # tens of ms a step on one CPU thread
        torch.set_num_threads(1)  # a smoke run shares the CPU: more threads only contend
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16  # CPU fp16 matmuls: slow emulation
    ctx = {"device": device, "size": size, "batch": make_batch(size, device), "every": args.every,
           "autocast": lambda: torch.autocast(device.type, dtype=amp_dtype), "tmpdir": tempfile.mkdtemp()}
    variants = [build(name, ctx) for name in VARIANTS]
    print(f"{args.model_size} on {device}, every={args.every}, {args.blocks} blocks of {args.block} "
          f"steps (+{args.warmup} warm-up)", flush=True)
    try:
        time_variants(variants, args, device)
    finally:
        for v in variants:
            v.close()
    by_name = {v.name: v for v in variants}
    results: dict[str, Any] = {
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "size": size},
        "env": {"torch": torch.__version__, "python": platform.python_version(),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()},
        "modules": list(by_name["indicators"].info["guard"].run_info.modules),
        "variants": {v.name: {k + "_ms": 1e3 * x for k, x in quartiles(v.times).items()} for v in variants},
    }
    base = by_name["off"].times
    for v in variants:
        if v.name != "off":
            results["variants"][v.name]["ratio_vs_off"] = quartiles([t / b for t, b in zip(v.times, base)])
    for name, e in results["variants"].items():
        ratio = e.get("ratio_vs_off")
        tail = (f"  ratio vs off p25/median/p75 {ratio['p25']:.4f} / {ratio['median']:.4f} / {ratio['p75']:.4f}"
                if ratio else "")
        print(f"  {name:<12} median {e['median_ms']:8.3f} ms  (p25 {e['p25_ms']:.3f}, p75 {e['p75_ms']:.3f}){tail}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
