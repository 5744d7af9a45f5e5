"""Train a tiny character-level transformer under ampguard, with faults injected on purpose.

This is what ``make demo`` runs. It needs no download: the training text is
``pydoc_data.topics`` (the ~460 kB of English that ``help()`` shows), which ships with
CPython. The default run uses fp16 autocast with loss scaling on the CPU and schedules
three faults with :mod:`ampguard.faults`:

- step 10: a NaN loss (the gradients stay finite): skipped, the loss scale is held;
- steps 20-22: an inf gradient burst in ``head.weight``. With ``GuardConfig(hysteresis=2)``
  the scale is kept on the first overflow and halved on the second and the third (the
  allowance refills only when the scale grows: docs/hysteresis.md);
- step 35: a huge but fp16-representable activation (3e4) in the output of ``ln_f``. The
  forward pass stays finite (the loss just jumps), but in the backward pass the scaled
  gradient of ``head.weight`` (activation x scaled logit gradient) overflows fp16: a
  realistic overflow. It is skipped, and since the scale has not grown since the burst, it
  backs the scale off.

The spike detector (``Spikes(grad_factor=...)``) is on in "warn" mode: whatever it flags, it
flags on its own; nothing here fakes a spike.

    python examples/train_single.py                       # fp16, faults, 250 steps
    python examples/train_single.py --precision bf16 --no-faults --steps 100
    python examples/train_single.py --steps 60 --out summary.json

Exit code 0 when the run finished and the model learned (the loss went down).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampguard
from ampguard import faults

# ------------------------------------------------------------------------------ data

_VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))  # printable ASCII; anything else -> "?"


def load_text() -> str:
    """English text that ships with Python: the topics ``help()`` shows."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data; fall back to stdlib docstrings
        import collections
        import functools
        import inspect
        import json as json_mod
        import re

        docs = []
        for mod in (collections, functools, inspect, json_mod, re, argparse, math):
            for _, obj in inspect.getmembers(mod):
                doc = inspect.getdoc(obj)
                if doc:
                    docs.append(doc)
        return "\n\n".join(docs)
    return "\n\n".join(topics[k] for k in sorted(topics))


def encode(text: str) -> torch.Tensor:
    index = {ch: i for i, ch in enumerate(_VOCAB)}
    unknown = index["?"]
    return torch.tensor([index.get(ch, unknown) for ch in text], dtype=torch.long)


def batches(data: torch.Tensor, *, batch: int, context: int, generator: torch.Generator):
    """Endless random windows: (inputs, next-character targets)."""
    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=generator)
        window = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


# ------------------------------------------------------------------------------ model


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """A 2-block pre-LayerNorm transformer over characters (~0.1 M parameters)."""

    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, layers: int = 2, context: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ------------------------------------------------------------------------------ faults

NAN_LOSS_STEP = 10
BURST_STEPS = (20, 21, 22)
OVERFLOW_STEP = 35
OVERFLOW_MODULE = "ln_f"
OVERFLOW_VALUE = 3e4  # finite in fp16 (max 65504); its products in the backward pass are not
BURST_PARAM = "head.weight"


def schedule() -> list[tuple[str, faults.Fault]]:
    return [
        ("nan loss", faults.loss("nan", steps=[NAN_LOSS_STEP])),
        ("inf gradient burst", faults.grad(BURST_PARAM, "inf", steps=BURST_STEPS)),
        ("huge module output", faults.output(OVERFLOW_MODULE, OVERFLOW_VALUE, steps=[OVERFLOW_STEP])),
    ]


# ------------------------------------------------------------------------------ run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=250, help="optimizer steps (default 250)")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.add_argument("--no-faults", action="store_true", help="do not inject the scheduled faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip", type=float, default=1.0, help="clip the gradient norm to this (0: off; default 1.0)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: this model's ops are too small to gain from more, and "
                   "extra threads only spin when the cores are shared)")
    p.add_argument("--print-every", type=int, default=None, help="healthy steps between lines (default steps/15)")
    p.add_argument("--out", default=None, help="write the JSON summary to this path")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.clip < 0:
        p.error("--clip must be >= 0")
    return args


def _fmt(x: float, spec: str = ".4f") -> str:
    return format(x, spec) if math.isfinite(x) else str(x)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    data = encode(load_text())
    stream = batches(data, batch=args.batch, context=args.context, generator=gen)

    model = CharTransformer(len(_VOCAB), context=args.context)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    config = ampguard.GuardConfig(
        hysteresis=2,  # absorb one overflow per growth of the scale; back off on the others
        # flag (and only warn) on a gradient norm 5x its running average
        spikes=ampguard.Spikes(grad_factor=5.0, action="warn", warmup=20),
        clip_grad_norm=args.clip or None,
        max_consecutive_skips=10,  # a run that cannot take a step for 10 steps is broken: raise
        history_size=max(1024, args.steps),
    )
    opt = ampguard.wrap(inner, model=model, precision=args.precision, config=config)

    planned = [] if args.no_faults else schedule()
    injection = faults.inject(opt, model, *(f for _, f in planned))

    every = args.print_every or max(1, args.steps // 15)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"ampguard {ampguard.__version__} demo: char-level transformer ({n_params / 1e3:.0f}k params) on "
        f"{len(data) / 1e3:.0f}k chars of pydoc_data.topics | precision={args.precision} steps={args.steps} "
        f"batch={args.batch}x{args.context} clip={args.clip or 'off'} seed={args.seed} "
        f"faults={'off' if args.no_faults else 'on'} | torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    if planned:
        print(
            f"scheduled faults: NaN loss @ {NAN_LOSS_STEP}; inf grad in {BURST_PARAM} @ "
            f"{BURST_STEPS[0]}-{BURST_STEPS[-1]}; output {OVERFLOW_VALUE:g} in {OVERFLOW_MODULE} @ {OVERFLOW_STEP}"
        )
    print(f"{'step':>5} {'loss':>8} {'scale':>9} {'grad norm':>10}  event")

    reports: list[dict[str, Any]] = []
    seen_anomalies = 0
    t0 = time.perf_counter()
    try:
        for step in range(args.steps):
            x, y = next(stream)
            fired_before = len(injection.fired)  # output faults fire in the forward pass
            with opt.autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)

            r = opt.last_report
            assert r is not None and r.step == step  # one process on CPU: reports are never lagged
            fired = [f for s, _, f in injection.fired[fired_before:]]
            new = list(opt.anomalies[seen_anomalies:])
            seen_anomalies += len(new)
            events = []
            if fired:
                events.append("FAULT " + ", ".join(f"{f.where}{'=' + f.target if f.target else ''}" for f in fired))
            if r.skipped:
                events.append(f"SKIPPED ({r.reason})")
            if r.next_loss_scale != r.loss_scale:
                events.append(f"scale {r.loss_scale:g} -> {r.next_loss_scale:g}")
            elif r.nonfinite_grads and opt.scaler is not None:
                events.append(f"scale kept (hysteresis={config.hysteresis})")
            events += [f"[{a.kind}]" for a in new if a.kind not in ("overflow", "nonfinite_loss", "nonfinite_grad")]
            if events or step % every == 0 or step == args.steps - 1:
                print(f"{step:>5} {_fmt(r.loss):>8} {r.loss_scale:>9g} {_fmt(r.grad_norm, '.3f'):>10}  "
                      + ("  ".join(events) or "ok"))
            reports.append(
                {
                    "step": r.step,
                    "loss": r.loss,
                    "loss_scale": r.loss_scale,
                    "next_loss_scale": r.next_loss_scale,
                    "grad_norm": r.grad_norm,
                    "skipped": r.skipped,
                    "reason": r.reason,
                    "grad_spike": r.grad_spike,
                    "faults": [f.where for f in fired],
                }
            )
    finally:
        injection.remove()
        opt.close()
    elapsed = time.perf_counter() - t0

    summary = summarize(args, opt, reports, planned, injection, elapsed)
    print_summary(summary)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(_jsonable(summary), fh, indent=1)
        print(f"summary written to {args.out}")
    if summary["learned"] is False:
        print("FAILED: the loss did not go down", file=sys.stderr)
        return 1
    return 0


def summarize(args: argparse.Namespace, opt: ampguard.GuardedOptimizer, reports: list[dict[str, Any]],
              planned: list[tuple[str, faults.Fault]], injection: faults.Injection,
              elapsed: float) -> dict[str, Any]:
    healthy = [r["loss"] for r in reports if not r["skipped"] and math.isfinite(r["loss"])]
    k = max(1, min(10, len(healthy) // 4))
    first, last = sum(healthy[:k]) / k, sum(healthy[-k:]) / k
    skipped = [r for r in reports if r["skipped"]]
    by_reason: dict[str, list[int]] = {}
    for r in skipped:
        by_reason.setdefault(r["reason"], []).append(r["step"])
    scales = [r["loss_scale"] for r in reports] + [reports[-1]["next_loss_scale"]]
    fired_by_fault = Counter()
    fired_steps: dict[int, list[int]] = {}
    for step, _, f in injection.fired:
        idx = next(i for i, (_, g) in enumerate(planned) if g is f)
        fired_by_fault[idx] += 1
        fired_steps.setdefault(idx, []).append(step)
    return {
        "precision": args.precision,
        "steps": len(reports),
        "seed": args.seed,
        "clip": args.clip or None,
        "faults_enabled": not args.no_faults,
        "seconds": round(elapsed, 2),
        "steps_per_second": round(len(reports) / elapsed, 2),
        "skipped": len(skipped),
        "skipped_by_reason": by_reason,
        "loss_first": first,
        "loss_last": last,
        "loss_avg_over": k,
        # judged only on runs long enough to learn something: 0.5 nats below the start
        "learned": (last < first - 0.5) if len(healthy) >= 40 else None,
        "scale_min": min(scales),
        "scale_max": max(scales),
        "scale_final": scales[-1],
        "faults": [
            {
                "name": name,
                "where": f.where,
                "target": f.target,
                "value": f.value,
                "steps": sorted(f.steps) if f.steps is not None else None,
                "fired_at": sorted(set(fired_steps.get(i, []))),
            }
            for i, (name, f) in enumerate(planned)
        ],
        "anomalies": [a.to_dict() for a in opt.anomalies],
        "reports": reports,
    }


def print_summary(s: dict[str, Any]) -> None:
    print()
    print("=" * 78)
    print(f"summary: {s['steps']} steps ({s['precision']}) in {s['seconds']:.1f} s "
          f"({s['steps_per_second']:.1f} steps/s)")
    reasons = ", ".join(f"{reason}: {len(steps)} at {steps}" for reason, steps in s["skipped_by_reason"].items())
    print(f"  skipped      {s['skipped']}" + (f" ({reasons})" if reasons else ""))
    print(f"  loss         {s['loss_first']:.3f} -> {s['loss_last']:.3f} "
          f"(mean of first/last {s['loss_avg_over']} steps taken; learned: "
          f"{ {True: 'yes', False: 'NO', None: 'run too short to judge'}[s['learned']] })")
    print(f"  loss scale   {s['scale_min']:g} .. {s['scale_max']:g} (final {s['scale_final']:g})")
    for f in s["faults"]:
        print(f"  fault        {f['name']:<20} scheduled {f['steps']} fired {f['fired_at']}")
    print(f"  anomalies    {len(s['anomalies'])}")
    for a in s["anomalies"]:
        print(f"    step {a['step']:>4} {a['kind']:<15} {a['detail']}")
    print("=" * 78)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
