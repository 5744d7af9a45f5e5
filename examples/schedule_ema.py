"""Skip-aware LR schedule and weight EMA in a hand-written loop: no ``sched.step()``, no host sync.

fp16 with a loss scale far too large, so the first steps overflow and are skipped; an inf is
also put into a gradient at ``--fault-step``. The scheduler (warm-up, then cosine) advances
only on taken steps, and the EMA of the weights is updated only on them, on device. On a fused
optimizer on CUDA the scheduler advances at the end of each ``step()`` as if the step was taken, and
the next ``step()`` undoes that, before its update reads the LR, where the step was skipped
(``docs/schedules.md``).

    python examples/schedule_ema.py                      # CPU, in seconds
    python examples/schedule_ema.py --device cuda        # fused AdamW, the sync-free path

Exit code 0 when the schedule advanced exactly once per taken step.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import ampguard
from ampguard import faults


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--fault-step", type=int, default=12, help="put an inf into a gradient at this step (-1: none)")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**22)  # too large: the first steps overflow
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model,
                        precision="fp16", scaler=scaler)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    sched = opt.schedule(torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[5]))
    ema = opt.track_ema(ampguard.EMA(model, decay=0.9))
    if args.fault_step >= 0:
        faults.inject(opt, faults.grad("0.weight", "inf", steps=[args.fault_step]))

    x = torch.randn(256, 8, device=device)
    y = x.sum(dim=1, keepdim=True).sin()
    for _ in range(args.steps):
        batch = torch.randint(0, 256, (32,), device=device)
        with opt.autocast():
            loss = F.mse_loss(model(x[batch]).float(), y[batch])
        opt.backward(loss)
        opt.step()  # steps sched once per taken step, updates ema on device
        opt.zero_grad()
    opt.flush()  # the last step's outcome counted (its advance kept or undone on the sync-free path)

    skipped = [r.step for r in opt.history if r.skipped]
    taken = args.steps - len(skipped)
    with torch.no_grad():
        live = F.mse_loss(model(x), y).item()
        with ema.applied():
            averaged = F.mse_loss(model(x), y).item()
    print(f"steps {args.steps}  skipped {skipped}  taken {taken}")
    print(f"scheduler stepped {sched.last_epoch} times  lr {sched.get_last_lr()[0]:.6f}")
    print(f"loss: weights {live:.4f}  EMA weights {averaged:.4f}")
    opt.close()
    ok = sched.last_epoch == taken and bool(skipped) and (args.fault_step < 0 or args.fault_step in skipped)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
