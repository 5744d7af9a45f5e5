#!/usr/bin/env python
"""Issue 17, item 2: what the sampled fp16 numerics cost, and the headroom scale policy against the default.

(a) cost: the guarded step with ``GuardConfig(numerics_every=N)`` (N = 10) against the guarded step
    without it, on the GPT-2-small-like model of ``overhead.py`` (124M parameters, fp16 autocast on
    CUDA, fused AdamW, GradScaler). The two variants are timed interleaved (``overhead.time_variants``):
    each block runs N steps of every variant, in an order rotated per block, so every block holds
    exactly one sampled step; one sample per block and variant. Reported: p25/median/p75 of the
    per-block ratios (numerics / without), and the medians.
(b) policy: a small GPT trained in fp16 on the same synthetic data (a fixed random bigram chain,
    which the model can learn), same seed, ``--steps`` (2000) steps with the default scale policy
    (GradScaler's: back off on overflow, grow after 2000 clean steps) and with
    ``scale_policy="headroom"``. Both sample the numerics every N steps (measuring only reads: the
    default run is bitwise the run without it). Reported per policy: skipped steps, mean (and last)
    gradient zero fraction, final loss (mean of the last 100 taken steps), the loss curve at its
    quartiles, the loss-scale range, and which policy wins (if the headroom policy loses, it says so:
    keep the default).

Both phases on one H200 take well under 5 minutes. ``--device cpu --quick`` is a smoke run of
seconds (tiny models, few steps; its numbers mean nothing). Writes ``--out`` + ``.json`` and
``.md`` (a markdown table)::

    python benchmarks/numerics.py --out benchmarks/results/numerics_h200
    python benchmarks/numerics.py --device cpu --quick --out /tmp/numerics_smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead

import ampguard

#: The small GPT of the policy comparison (about 14M parameters), and its smoke-test size.
POLICY_MODEL = dict(vocab=8192, seq=256, layers=6, d=384, heads=6, batch=32)
POLICY_MODEL_QUICK = dict(vocab=256, seq=16, layers=1, d=32, heads=2, batch=4)
FINAL_WINDOW = 100
"""Taken steps averaged into the final loss."""


def quantiles(values: list[float]) -> dict[str, float]:
    """p25 / median / p75 (statistics.quantiles, inclusive method; one value: that value)."""
    if len(values) == 1:
        return {"p25": values[0], "median": values[0], "p75": values[0]}
    q = statistics.quantiles(values, n=4, method="inclusive")
    return {"p25": q[0], "median": q[1], "p75": q[2]}


# ---------------------------------------------------------------------------------------- (a) cost


def cost_phase(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    size = overhead.SIZES[args.cost_model]
    amp = torch.float16 if device.type == "cuda" else torch.bfloat16  # as overhead.py: CPU fp16 is emulation
    ctx: dict[str, Any] = {
        "device": device, "size": size, "batch": overhead.make_batch(size, device),
        "autocast": lambda: torch.autocast(device.type, dtype=amp), "init_scale": 2.0**12,
        "tmpdir": tempfile.mkdtemp(prefix="ampguard-numerics-"), "numerics_every": args.every,
    }
    variants = [overhead.build_variant("guard", True, ctx), overhead.build_variant("guard_numerics", True, ctx)]
    # one block = N steps of each variant: exactly one sampled step per block
    timing = argparse.Namespace(warmup=args.warmup, blocks=args.blocks, block=args.every)
    try:
        overhead.time_variants(variants, timing, device)
    finally:
        for v in variants:
            v.close()
    base, num = variants
    ratios = [b / a for a, b in zip(base.times, num.times)]
    q = quantiles(ratios)
    return {
        "model_size": args.cost_model,
        "params": sum(p.numel() for p in base.info["model"].parameters()),
        "autocast_dtype": str(amp),
        "numerics_every": args.every,
        "blocks": len(ratios),
        "steps_per_block": args.every,
        "guard_median_ms": 1e3 * statistics.median(base.times),
        "numerics_median_ms": 1e3 * statistics.median(num.times),
        "ratio": q,
        "overhead_pct": {k: 100 * (v - 1) for k, v in q.items()},
        "within_budget_0_5pct": 100 * (q["median"] - 1) <= 0.5,
    }


# ---------------------------------------------------------------------------------------- (b) policy


def bigram_data(size: dict[str, Any], steps: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """``[steps, batch, seq + 1]`` tokens: independent chains of a fixed random bigram table (each
    token has 4 successors, drawn with probabilities 0.55/0.25/0.15/0.05), the same for every run."""
    g = torch.Generator().manual_seed(seed)
    vocab, seq, batch = size["vocab"], size["seq"], size["batch"]
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    chains = steps * batch
    tokens = torch.empty(chains, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (chains,), generator=g)
    for t in range(seq):
        pick = torch.multinomial(probs, chains, replacement=True, generator=g)
        tokens[:, t + 1] = succ[tokens[:, t], pick]
    return tokens.view(steps, batch, seq + 1).to(device)


def train(policy: str, data: torch.Tensor, size: dict[str, Any], args: argparse.Namespace,
          device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    model = overhead.GPT(size["vocab"], size["seq"], size["layers"], size["d"], size["heads"]).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=True)
    scaler = torch.amp.GradScaler(device.type)  # GradScaler's defaults: 2**16, growth every 2000 clean steps
    steps = data.shape[0]
    opt = ampguard.wrap(inner, model=model, scaler=scaler, precision="fp16",
                        config=ampguard.GuardConfig(numerics_every=args.every, scale_policy=policy,
                                                    history_size=steps))
    t0 = time.perf_counter()
    for step in range(steps):
        with opt.autocast():  # cross_entropy runs in float32 under autocast
            loss = overhead.compute_loss(model, (data[step, :, :-1], data[step, :, 1:]))
        opt.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.flush()
    overhead.sync(device)
    seconds = time.perf_counter() - t0
    history = list(opt.history)
    opt.close()
    return summarise_run(policy, history, seconds)


def summarise_run(policy: str, history: list[ampguard.StepReport], seconds: float) -> dict[str, Any]:
    taken = [r for r in history if not r.skipped and math.isfinite(r.loss)]
    sampled = [r for r in history if r.grad_zero_fraction is not None]
    zero = [r.grad_zero_fraction for r in sampled if r.grad_zero_fraction is not None
            and math.isfinite(r.grad_zero_fraction)]
    headroom = [r.headroom_log2 for r in sampled if r.headroom_log2 is not None and math.isfinite(r.headroom_log2)]

    def loss_near(frac: float) -> float:  # mean loss of the taken steps in a window around a point of the run
        mid = int(frac * (len(history) - 1))
        window = [r.loss for r in taken if abs(r.step - mid) <= FINAL_WINDOW // 2]
        return statistics.fmean(window) if window else math.nan

    final = [r.loss for r in taken[-FINAL_WINDOW:]]
    return {
        "policy": policy,
        "steps": len(history),
        "skipped": sum(r.skipped for r in history),
        "zero_fraction_mean": statistics.fmean(zero) if zero else math.nan,
        "zero_fraction_last": zero[-1] if zero else math.nan,
        "headroom_log2_median": statistics.median(headroom) if headroom else math.nan,
        "final_loss": statistics.fmean(final) if final else math.nan,
        "min_loss": min((r.loss for r in taken), default=math.nan),
        "loss_curve": {f"at_{int(100 * f)}pct": loss_near(f) for f in (0.0, 0.25, 0.5, 0.75, 1.0)},
        "loss_scale": {"first": history[0].loss_scale, "last": history[-1].next_loss_scale,
                       "min": min(r.loss_scale for r in history), "max": max(r.loss_scale for r in history)},
        "seconds": seconds,
    }


def verdict(default: dict[str, Any], headroom: dict[str, Any]) -> str:
    """Which policy wins on final loss (ties within 0.5 % go to the default), with what it cost."""
    d, h = default["final_loss"], headroom["final_loss"]
    if not math.isfinite(h) or h > d * 1.005:
        return (f"headroom loses (final loss {h:.4f} vs {d:.4f}): keep the default policy "
                f"(skipped {headroom['skipped']} vs {default['skipped']})")
    if h < d * 0.995:
        return (f"headroom wins (final loss {h:.4f} vs {d:.4f}; skipped {headroom['skipped']} vs "
                f"{default['skipped']}; mean zero fraction {headroom['zero_fraction_mean']:.4f} vs "
                f"{default['zero_fraction_mean']:.4f})")
    return (f"no difference in final loss ({h:.4f} vs {d:.4f}, within 0.5 %): keep the default policy "
            f"(skipped {headroom['skipped']} vs {default['skipped']})")


def policy_phase(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    size = POLICY_MODEL_QUICK if args.quick else POLICY_MODEL
    data = bigram_data(size, args.steps, device)
    runs = {policy: train(policy, data, size, args, device) for policy in ("default", "headroom")}
    return {"model": size, "lr": args.lr, "numerics_every": args.every, "runs": runs,
            "verdict": verdict(runs["default"], runs["headroom"])}


# ---------------------------------------------------------------------------------------- output


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [f"# ampguard numerics benchmark ({meta['device']}, torch {meta['torch']}, {meta['date_utc']})", "",
             f"`{meta['command']}`", ""]
    cost = results.get("cost")
    if cost:
        r, o = cost["ratio"], cost["overhead_pct"]
        lines += [
            f"## (a) cost of numerics_every={cost['numerics_every']} ({cost['model_size']}, "
            f"{cost['params'] / 1e6:.0f}M params, {cost['autocast_dtype']}, fused AdamW)", "",
            "| guard ms/step (median) | + numerics ms/step (median) | ratio p25 | ratio median | ratio p75 | "
            "overhead median | <= 0.5 % |",
            "|---|---|---|---|---|---|---|",
            f"| {cost['guard_median_ms']:.3f} | {cost['numerics_median_ms']:.3f} | {r['p25']:.4f} | "
            f"{r['median']:.4f} | {r['p75']:.4f} | {o['median']:+.2f} % | "
            f"{'yes' if cost['within_budget_0_5pct'] else 'NO'} |", "",
            f"{cost['blocks']} interleaved blocks of {cost['steps_per_block']} steps per variant.", "",
        ]
    pol = results.get("policy")
    if pol:
        d, h = pol["runs"]["default"], pol["runs"]["headroom"]
        m = pol["model"]
        lines += [
            f"## (b) headroom policy vs default ({d['steps']} steps each, GPT {m['layers']}x{m['d']}, vocab "
            f"{m['vocab']}, seq {m['seq']}, batch {m['batch']}, fp16, same data and seed)", "",
            "| policy | skipped | zero fraction (mean) | zero fraction (last) | headroom log2 (median) | final loss | "
            "min loss | loss @0/25/50/75/100 % | loss scale first→last (min..max) | s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for run in (d, h):
            c, s = run["loss_curve"], run["loss_scale"]
            lines.append(
                f"| {run['policy']} | {run['skipped']} | {run['zero_fraction_mean']:.5f} | "
                f"{run['zero_fraction_last']:.5f} | {run['headroom_log2_median']:.2f} | {run['final_loss']:.4f} | "
                f"{run['min_loss']:.4f} | {' / '.join(f'{v:.3f}' for v in c.values())} | "
                f"{s['first']:g}→{s['last']:g} ({s['min']:g}..{s['max']:g}) | {run['seconds']:.1f} |")
        lines += ["", f"**Verdict:** {pol['verdict']}", ""]
    return "\n".join(lines) + "\n"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny models, few steps: a smoke run of seconds")
    ap.add_argument("--every", type=int, default=10, help="GuardConfig.numerics_every (default 10)")
    ap.add_argument("--steps", type=int, default=None, help="steps per policy run (default 2000; --quick 12)")
    ap.add_argument("--blocks", type=int, default=None, help="timed blocks in the cost phase (default 30; --quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed blocks first (default 3; --quick 0)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the policy runs")
    ap.add_argument("--phases", default="cost,policy", help="comma list: cost, policy")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    args.steps = args.steps or (12 if args.quick else 2000)
    args.blocks = args.blocks or (2 if args.quick else 30)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 3)
    args.cost_model = "mlp-small" if args.quick else "gpt2"
    phases = {p.strip() for p in args.phases.split(",")}

    results: dict[str, Any] = {"meta": {
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.machine() or "cpu"),
        "torch": torch.__version__, "ampguard": ampguard.__version__, "quick": args.quick,
    }}
    t0 = time.perf_counter()
    if "cost" in phases:
        results["cost"] = cost_phase(args, device)
        print(json.dumps({"cost": results["cost"]["overhead_pct"]}), flush=True)
    if "policy" in phases:
        results["policy"] = policy_phase(args, device)
        print(results["policy"]["verdict"], flush=True)
    results["meta"]["seconds"] = time.perf_counter() - t0
    text = markdown(results)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(_json_safe(results), f, indent=2)
        with open(args.out + ".md", "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
