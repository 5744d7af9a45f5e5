"""fp16 underflow and headroom, sampled by ``GuardConfig(numerics_every=N)``, on a real CPU run.

A small tanh MLP in fp16 autocast (``torch.amp.GradScaler("cpu")``), two param groups (body and
head), starting from a loss scale far too low (2**-14): most fp16 gradients of the body flush to
zero. GradScaler's growth (every 10 clean steps here, to fit a short run) doubles the scale: the
zero fraction falls and the headroom log2(65504 / max|scaled grad|) shrinks by one per doubling,
until it reaches 0: an overflow, skipped and backed off. With ``--policy headroom`` the guard
sets the scale from the measured headroom instead (a margin of 2 doublings).

    python examples/fp16_numerics.py --out runs/numerics
    ampguard report runs/numerics --plot docs/numerics.png

Prints one line per sampled step; writes ``OUT/events.jsonl`` (every step).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import ampguard
from ampguard.exporters import JsonlExporter


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=450)
    ap.add_argument("--every", type=int, default=5, help="GuardConfig.numerics_every")
    ap.add_argument("--policy", choices=("default", "headroom"), default="default")
    ap.add_argument("--out", default="runs/numerics")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    body = [p for layer in model[:4] for p in layer.parameters()]
    inner = torch.optim.AdamW([{"params": body}, {"params": model[4].parameters()}], lr=3e-3)
    os.makedirs(args.out, exist_ok=True)
    opt = ampguard.wrap(
        inner, model=model, precision="fp16",
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**-14, growth_interval=10),
        config=ampguard.GuardConfig(numerics_every=args.every, scale_policy=args.policy, min_scale=2.0**-20),
        exporters=[JsonlExporter(os.path.join(args.out, "events.jsonl"), every_step=True)],
    )
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 1, generator=g)
    for _ in range(args.steps):
        x = torch.randn(64, 32, generator=g)
        y = torch.tanh(x @ w) * 1e-3  # small targets: small gradients, which fp16 loses at a low scale
        with opt.autocast():
            out = model(x)
        opt.backward(F.mse_loss(out.float(), y))
        opt.step()
        opt.zero_grad()
        r = opt.last_report
        if r.grad_zero_fraction is not None:
            groups = " ".join(f"{z:.3f}" for z in r.group_zero_fractions or ())
            print(f"step {r.step:4d}  scale {r.loss_scale:<12g} zero {r.grad_zero_fraction:.3f} (groups {groups})  "
                  f"headroom {r.headroom_log2:+.2f}{'  skipped' if r.skipped else ''}")
    opt.close()
    print(f"skipped {opt.skipped_steps} of {opt.step_count}; event log: {os.path.join(args.out, 'events.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
