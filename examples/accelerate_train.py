"""accelerate's standard training loop, guarded by ampguard: one added line.

A tiny regression model on synthetic data, with what real loops use: gradient accumulation
(``accelerator.accumulate``), ``accelerator.clip_grad_norm_`` and an LR scheduler. A NaN is put
into the first layer's output at one optimizer step (``--fault-step``; -1 for none): the guard
skips that step, ``accelerator.optimizer_step_was_skipped`` says so and the scheduler holds the LR.

    python examples/accelerate_train.py                        # bf16 on CPU, in seconds
    accelerate launch examples/accelerate_train.py --mixed-precision fp16   # on GPUs

Exit code 0 when the run finished, skipped exactly the faulty step and the loss went down.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import ampguard
from ampguard import faults


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed-precision", default="bf16", choices=["no", "fp16", "bf16"])
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--fault-step", type=int, default=5)
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum)
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = x @ torch.randn(16, 1) + 0.1 * torch.randn(256, 1)
    dataloader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    optimizer = ampguard.wrap(optimizer, accelerator=accelerator, model=model)  # the one added line

    injection = faults.inject(optimizer, model, faults.output("0", "nan", steps=[args.fault_step]))
    skipped = []
    for _ in range(args.epochs):
        for inputs, targets in dataloader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(inputs).float(), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                report = optimizer.last_report
                if accelerator.optimizer_step_was_skipped:
                    skipped.append(report.step)
                accelerator.print(f"step {report.step:3d}  loss {report.loss:8.4f}  grad_norm {report.grad_norm:8.4f}"
                                  f"  lr {scheduler.get_last_lr()[0]:.4f}  {report.reason or ''}")
    injection.remove()
    optimizer.close()
    first = next(r.loss for r in optimizer.history if not r.skipped)
    last = optimizer.last_report.loss
    expected = sorted({s for s, _, _ in injection.fired})  # fires on each micro-batch of that step
    accelerator.print(f"{optimizer.step_count} steps, skipped {skipped} (fault at {expected}), "
                      f"loss {first:.4f} -> {last:.4f}")
    return 0 if skipped == expected and last < first else 1


if __name__ == "__main__":
    sys.exit(main())
