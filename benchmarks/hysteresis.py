#!/usr/bin/env python
"""Loss-scale trajectories of hysteresis rules on the same overflow patterns (docs/hysteresis.md).

Each rule is fed the same sequence of steps, overflowing (1) or clean (0), and the loss scale it
sets after every step is recorded. The rules:

- ``torch``: ``torch.amp.GradScaler``'s own update (``torch._amp_update_scale_``, run for real):
  every overflow backs off; ``growth_interval`` clean steps in a row grow the scale.
- ``ampguard``: ampguard's real rule, :func:`ampguard.scale_rule.next_scale`, run on host values
  (the CPU decision) and on tensors (the device decision), compared step by step.
- ``ampguard-old``: the rule ampguard had before (a reimplementation): back off after
  ``hysteresis`` *consecutive* overflows, every clean step resets the count.
- ``megatron``: a reimplementation of Megatron-LM's ``DynamicGradScaler.update``
  (megatron/core/optimizer/grad_scaler.py): the hysteresis tracker drops on every overflow,
  backs off at <= 0 and is refilled only when the scale grows.
- ``deepspeed`` / ``deepspeed-consecutive``: a reimplementation of DeepSpeed's
  ``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/loss_scaler.py), with
  ``consecutive_hysteresis=False`` (its default: refill only on growth) and ``True`` (refill on
  every clean step). Its growth waits for ``scale_window + 1`` clean steps (``stable_interval``
  counts from the step after the overflow), one more than torch's and Megatron's.

    python benchmarks/hysteresis.py --out benchmarks/results/hysteresis

Writes ``<out>.md`` (the tables, with the command that made them) and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ampguard.ops import HOST, TensorOps
from ampguard.scale_rule import next_scale

INIT = 2.0**16
BACKOFF, GROWTH = 0.5, 2.0
MIN_SCALE = 1.0

Trajectory = list[float]


def ampguard_trajectory(pattern: Sequence[int], *, hysteresis: int, growth_interval: int,
                        init: float = INIT) -> Trajectory:
    """ampguard's rule, host and device, checked equal at every step; the scale after each step."""
    kw = dict(growth_factor=GROWTH, backoff_factor=BACKOFF, growth_interval=growth_interval, hysteresis=hysteresis,
              min_scale=MIN_SCALE, max_scale=None)
    scale, tracker, run, out = init, 0, 0, []
    for bad in pattern:
        new, new_tracker, _, _, _, new_run = next_scale(HOST, scale=scale, growth_tracker=tracker, overflow=bool(bad),
                                                        held=False, overflow_run=run, **kw)
        t = next_scale(TensorOps(torch.device("cpu")), scale=torch.tensor(scale),
                       growth_tracker=torch.tensor(tracker, dtype=torch.int32), overflow=torch.tensor(bool(bad)),
                       held=torch.tensor(False), overflow_run=torch.tensor(run, dtype=torch.int32), **kw)
        if (float(t[0]), int(t[1]), int(t[5])) != (new, new_tracker, new_run):
            raise AssertionError("the scale rule on tensors and on host values disagree")
        scale, tracker, run = new, new_tracker, new_run
        out.append(scale)
    return out


def torch_trajectory(pattern: Sequence[int], *, growth_interval: int, init: float = INIT, **_: object) -> Trajectory:
    """GradScaler's own update kernel, run for real (CPU)."""
    scale = torch.tensor([init])
    tracker = torch.zeros(1, dtype=torch.int32)
    out = []
    for bad in pattern:
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(bad)]), GROWTH, BACKOFF, growth_interval)
        out.append(max(float(scale), MIN_SCALE))  # GradScaler has no floor; none is reached here
    return out


def old_ampguard_trajectory(pattern: Sequence[int], *, hysteresis: int, growth_interval: int,
                            init: float = INIT) -> Trajectory:
    """ampguard before: back off after ``hysteresis`` consecutive overflows; a clean step resets."""
    scale, tracker, run, out = init, 0, 0, []
    for bad in pattern:
        if bad:
            tracker, run = 0, run + 1
            if run >= hysteresis:
                scale, run = max(scale * BACKOFF, MIN_SCALE), 0
        else:
            tracker, run = tracker + 1, 0
            if tracker >= growth_interval:
                scale, tracker = scale * GROWTH, 0
        out.append(scale)
    return out


def megatron_trajectory(pattern: Sequence[int], *, hysteresis: int, growth_interval: int,
                        init: float = INIT) -> Trajectory:
    """Megatron-LM's ``DynamicGradScaler.update``, on floats."""
    scale, growth_tracker, hysteresis_tracker, out = init, 0, hysteresis, []
    for bad in pattern:
        if bad:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = max(scale * BACKOFF, MIN_SCALE)
        else:
            growth_tracker += 1
            if growth_tracker == growth_interval:
                growth_tracker, hysteresis_tracker = 0, hysteresis
                scale *= GROWTH
        out.append(scale)
    return out


def deepspeed_trajectory(pattern: Sequence[int], *, hysteresis: int, growth_interval: int, consecutive: bool,
                         init: float = INIT) -> Trajectory:
    """DeepSpeed's ``DynamicLossScaler.update_scale`` (``delayed_shift=hysteresis``,
    ``scale_window=growth_interval``), on floats; at the floor it would raise, here it stays."""
    scale, last_overflow, cur_h, out = init, -1, hysteresis, []
    for cur_iter, bad in enumerate(pattern):
        if bad:
            if hysteresis == 1 or cur_h == 1:
                scale = max(scale / 2.0, MIN_SCALE)
            else:
                cur_h -= 1
            last_overflow = cur_iter
        else:
            if consecutive:
                cur_h = hysteresis
            stable = cur_iter - last_overflow - 1
            if stable > 0 and stable % growth_interval == 0:
                if not consecutive:
                    cur_h = hysteresis
                scale *= 2.0
        out.append(scale)
    return out


RULES: dict[str, Callable[..., Trajectory]] = {
    "torch": torch_trajectory,
    "ampguard": ampguard_trajectory,
    "ampguard-old": old_ampguard_trajectory,
    "megatron": megatron_trajectory,
    "deepspeed": lambda p, **k: deepspeed_trajectory(p, consecutive=False, **k),
    "deepspeed-consecutive": lambda p, **k: deepspeed_trajectory(p, consecutive=True, **k),
}


def patterns(steps: int) -> dict[str, list[int]]:
    out = {"alternating": [i % 2 for i in range(steps)]}
    for k in (1, 2, 3, 5):  # bursts of k, 10 clean steps apart
        out[f"bursts of {k}"] = [1 if i % (k + 10) < k else 0 for i in range(steps)]
    out["burst of 6, then calm"] = [1 if 2 <= i < 8 else 0 for i in range(steps)]
    out["1 in 4"] = [1 if i % 4 == 3 else 0 for i in range(steps)]
    return out


def summarise(pattern: Sequence[int], traj: Trajectory, init: float) -> dict[str, object]:
    prev, backoffs = init, 0
    for s in traj:
        backoffs += s < prev
        prev = s
    return {"skipped": sum(pattern), "backoffs": backoffs, "final_log2": math.log2(traj[-1]),
            "log2": [int(math.log2(s)) for s in traj]}


def run(steps: int, hysteresis: int, growth_interval: int) -> dict[str, dict[str, dict[str, object]]]:
    out: dict[str, dict[str, dict[str, object]]] = {}
    for name, pattern in patterns(steps).items():
        out[name] = {"pattern": {"overflow": pattern}}  # type: ignore[dict-item]
        for rule, fn in RULES.items():
            h = 1 if rule == "torch" else hysteresis
            traj = fn(pattern, hysteresis=h, growth_interval=growth_interval)
            out[name][rule] = summarise(pattern, traj, INIT)
    return out


def markdown(result: dict[str, dict[str, dict[str, object]]], argv: list[str], hysteresis: int,
             growth_interval: int) -> str:
    lines = [f"# Hysteresis trajectories (hysteresis={hysteresis}, growth_interval={growth_interval}, "
             f"initial scale 2**{int(math.log2(INIT))})", "",
             f"`{shlex.join(['python', *argv])}`", "",
             "Per step: the overflow pattern (1: overflow, skipped), then log2 of the scale after the step.", ""]
    for name, rows in result.items():
        lines += [f"## {name}", "", "| rule | backoffs | skipped | final log2 | log2(scale) per step |",
                  "|---|---|---|---|---|"]
        for rule, row in rows.items():
            seq = " ".join(str(v) for v in row.get("log2", row.get("overflow")))  # type: ignore[union-attr]
            if rule == "pattern":
                lines.append(f"| overflow | | | | `{seq}` |")
            else:
                lines.append(f"| {rule} | {row['backoffs']} | {row['skipped']} | {row['final_log2']:g} | `{seq}` |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--hysteresis", type=int, default=2)
    ap.add_argument("--growth-interval", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="write <out>.md and <out>.json")
    args = ap.parse_args(argv)
    result = run(args.steps, args.hysteresis, args.growth_interval)
    md = markdown(result, ["benchmarks/hysteresis.py", *argv], args.hysteresis, args.growth_interval)
    if args.out is None:
        print(md)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(md + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(result) + "\n")
        print(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
