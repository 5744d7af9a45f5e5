#!/usr/bin/env python
"""The cost of fp8 monitoring (``ampguard.fp8.Fp8Monitor``) on a GPT-2-style model trained with torchao float8.

Three variants of the same run, each on its own copy of one converted model (fused AdamW, bf16 autocast):
``plain`` (fp8, unmonitored), ``monitor`` (every cast's amax and scale, underflow sampled every
``--numerics-every`` steps) and ``monitor-nosample`` (amax and scale only). They run in paired, interleaved
blocks (the order rotated per block) of ``--steps`` steps, each block timed from a drained device to a drained
device; the figures are the p25/median/p75 of the per-step time over the blocks, and each monitored variant's
median overhead against ``plain``'s.

The guard does not run the monitor yet (docs/fp8.md): this measures the monitor's own hooks, which is what the
guard would add for fp8 on top of its usual step.

    python benchmarks/fp8_cost.py --device cuda --blocks 30 [--compile] --out fp8_cost.json
    python benchmarks/fp8_cost.py --device cpu --blocks 4 --steps 2 --layers 2   # emulated fp8, a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ampguard.fp8 import Fp8Monitor


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
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    base = _model(args)
    runs: dict[str, dict[str, Any]] = {}
    for name, every in (("plain", None), ("monitor", args.numerics_every), ("monitor-nosample", 10**9)):
        model = copy.deepcopy(base)
        monitor = Fp8Monitor(model, numerics_every=every) if every is not None else None
        fwd = torch.compile(model) if args.compile else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
        runs[name] = {"model": fwd, "monitor": monitor, "opt": opt, "step": 0, "times": []}
    tokens = torch.randint(0, 8192, (args.batch, args.seq), device=args.device)

    def block(run: dict[str, Any], steps: int) -> float:
        _sync(args.device)
        start = time.perf_counter()
        for _ in range(steps):
            if run["monitor"] is not None:
                run["monitor"].begin_step(run["step"])
            with torch.autocast(args.device, dtype=torch.bfloat16):
                loss = run["model"](tokens, labels=tokens).loss
            loss.backward()
            run["opt"].step()
            run["opt"].zero_grad(set_to_none=True)
            if run["monitor"] is not None:
                run["monitor"].nonfinite(run["monitor"].collect())
            run["step"] += 1
        _sync(args.device)
        return (time.perf_counter() - start) / steps

    names = list(runs)
    for name in names:  # warm-up (and compile) outside the timed blocks
        block(runs[name], max(2, args.numerics_every if args.compile else 2))
    for b in range(args.blocks):
        for name in names[b % len(names):] + names[: b % len(names)]:
            runs[name]["times"].append(block(runs[name], args.steps))

    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "ms_per_step": {}}
    plain_median = statistics.median(runs["plain"]["times"])
    for name in names:
        times = sorted(runs[name]["times"])
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        med = statistics.median(times)
        result["ms_per_step"][name] = {"p25": q[0] * 1e3, "median": med * 1e3, "p75": q[2] * 1e3,
                                       "overhead_pct": (med / plain_median - 1) * 100}
        print(f"{name:18s} p25 {q[0] * 1e3:9.3f}  median {med * 1e3:9.3f}  p75 {q[2] * 1e3:9.3f} ms/step  "
              f"overhead {(med / plain_median - 1) * 100:+.2f}%")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
