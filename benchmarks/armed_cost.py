#!/usr/bin/env python
"""What forensics' armed hooks cost a training step: the same guarded fp16 loop (GradScaler, fused AdamW), blocks
of steps with the hooks armed and disarmed in turn, in one process. Until stop 42 every non-finite step armed them
for ``forensics_window`` (50) clean steps, GradScaler's routine growth overshoot included (once every
``growth_interval`` steps or so); since then an fp16 overflow with a finite loss arms only right after a back-off
(docs/diagnosis.md). The hooks are armed as ``Forensics.after_report`` arms them (a ``Localizer`` on the whole
model) and the window is made endless, so that only the blocks decide. Each block is timed whole, the device
drained at its end; the figure is the per-block ratio armed / disarmed of adjacent blocks, p25 / median / p75.

Run: ``python benchmarks/armed_cost.py --device cuda --models mlp,gpt2-124m --blocks 10 --steps 20``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_time import build

import ampguard


def run(name: str, device: torch.device, blocks: int, steps: int) -> str:
    model, loss_fn = build(name, device)
    fused = device.type == "cuda"
    inner = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if fused else {}))
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)  # nothing overflows: only the blocks arm
    opt = ampguard.wrap(inner, model=model, scaler=scaler, precision="fp16",
                        config={"forensics_window": 10**9})
    forensics = opt._outcome.forensics

    def block(armed: bool) -> float:
        if armed:
            forensics.arm(opt.step_count)
        else:
            forensics.remove()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            with opt.autocast():
                loss = loss_fn()
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.flush()
        sync()
        return (time.perf_counter() - t0) / steps

    block(False), block(True)  # warm-up: the kernels, the allocator, the hooks' first calls
    ratios, off, on = [], [], []
    for i in range(blocks):
        order = (False, True) if i % 2 == 0 else (True, False)  # alternate which goes first
        t = {armed: block(armed) for armed in order}
        off.append(t[False])
        on.append(t[True])
        ratios.append(t[True] / t[False])
    assert not any(r.skipped for r in opt.history), "a step was skipped: the blocks are not the same work"
    q = statistics.quantiles(ratios, n=4)
    return (f"{name} on {device.type}: step disarmed {statistics.median(off) * 1e3:.2f} ms, armed "
            f"{statistics.median(on) * 1e3:.2f} ms (medians); armed / disarmed per block p25 {q[0]:.3f} / median "
            f"{q[1]:.3f} / p75 {q[2]:.3f} ({blocks} pairs of {steps} steps)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="mlp,gpt2-124m")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    for name in args.models.split(","):
        print(run(name, torch.device(args.device), args.blocks, args.steps), flush=True)


if __name__ == "__main__":
    main()
