"""Train a small regression MLP with PyTorch Lightning under ampguard, with faults on purpose.

The LightningModule is plain Lightning: ``configure_optimizers`` returns an AdamW and a warmup
scheduler stepped per optimizer step. ampguard comes in as one plugin,
``Trainer(plugins=[AmpGuardPrecision(...)])``, which guards the optimizer, holds the scheduler on
skipped steps and keeps Lightning's clipping and gradient accumulation. Two faults are injected
through :mod:`ampguard.faults` (steps are optimizer steps):

- step 5: a NaN in the output of ``net.0`` (both micro-batches): skipped;
- step 12: a huge but finite activation (3e4): in fp16 the scaled gradients overflow and the step
  is skipped with a loss-scale backoff; in bf16 it is just a bad batch, taken.

    python examples/lightning_train.py                         # fp16 (on CPU too), faults
    python examples/lightning_train.py --precision bf16-mixed --no-faults
    python examples/lightning_train.py --steps 30 --out summary.json

Runs in seconds on a CPU. On CPU, ``16-mixed`` runs real fp16 autocast with a CPU GradScaler
(Lightning's own ``Trainer(precision="16-mixed")`` would switch to bf16 there). Exit code 0 when
the run finished, every parameter is finite and the loss went down.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ampguard import faults
from ampguard.integrations.lightning import AmpGuardPrecision

ACCUMULATE = 2
NAN_STEP, HUGE_STEP = 5, 12


class Regressor(L.LightningModule):
    """y = sin(x @ w): an MLP learns it. Nothing here knows about ampguard."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: min(1.0, (n + 1) / 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = 0.25 * torch.randn(16, 1, generator=torch.Generator().manual_seed(0))  # the same target everywhere
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return x, torch.sin(x @ w)


@torch.no_grad()
def held_out_mse(model: Regressor) -> float:
    x, y = data(512, seed=2)
    return F.mse_loss(model.net(x.to(model.device)).float(), y.to(model.device)).item()


class InjectFaults(L.Callback):
    """Install the faults on the guard once the plugin built it."""

    def __init__(self) -> None:
        self.injection: faults.Injection | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        guard = trainer.precision_plugin.guard  # type: ignore[attr-defined]
        self.injection = faults.inject(guard, pl_module,
                                       faults.output("net.0", "nan", steps=[NAN_STEP]),
                                       faults.output("net.0", 3e4, steps=[HUGE_STEP]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.injection is not None:
            self.injection.remove()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=["16-mixed", "bf16-mixed"], default="16-mixed")
    parser.add_argument("--steps", type=int, default=40, help=f"optimizer steps (each of {ACCUMULATE} micro-batches)")
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--out", help="write a JSON summary here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", module="lightning")  # num_workers hints and the like
    torch.manual_seed(0)
    torch.set_num_threads(min(2, torch.get_num_threads()))

    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    scaler = torch.amp.GradScaler(accelerator, init_scale=2.0**12) if args.precision == "16-mixed" else None
    plugin = AmpGuardPrecision(args.precision, device=accelerator, scaler=scaler, log=True)
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_epochs=1, plugins=[plugin],
                        gradient_clip_val=1.0, accumulate_grad_batches=ACCUMULATE,
                        callbacks=[] if args.no_faults else [InjectFaults()],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = Regressor()
    before = held_out_mse(model)
    trainer.fit(model, DataLoader(TensorDataset(*data(args.steps * ACCUMULATE * 16, seed=1)), batch_size=16))
    after = held_out_mse(model)

    guard = plugin.guard
    assert guard is not None
    history = list(guard.history)
    for r in history:
        if r.skipped or r.step % 10 == 0:
            flag = f"SKIPPED ({r.reason})" if r.skipped else ""
            print(f"step {r.step:3d}  loss {r.loss:8.4f}  grad_norm {r.grad_norm:9.4f}  "
                  f"scale {r.loss_scale:7.0f}  {flag}")
    for a in guard.anomalies:
        print(f"anomaly at step {a.step}: {a.kind}: {a.detail}")
    held = trainer.lr_scheduler_configs[0].scheduler
    print(f"{guard.step_count} steps, {guard.skipped_steps} skipped; scheduler held {held.held}x; "
          f"final lr {held.get_last_lr()[0]:.2e}; logged {sorted(trainer.callback_metrics)}")
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    learned = math.isfinite(after) and after < before
    print(f"held-out MSE {before:.4f} -> {after:.4f}; parameters finite: {finite}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"precision": args.precision, "steps": guard.step_count,
                       "skipped": [r.step for r in history if r.skipped],
                       "reasons": {r.step: str(r.reason) for r in history if r.skipped},
                       "scheduler_held": held.held, "finite": finite, "mse": [before, after]}, f, indent=1)
    return 0 if finite and learned else 1


if __name__ == "__main__":
    sys.exit(main())
