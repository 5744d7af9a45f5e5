"""The transformers Trainer with every optimizer step guarded: ``GuardedTrainer``.

A tiny GPT-2 built from its config (no download) learns to count, on the CPU in bf16 autocast,
with gradient accumulation and clipping, in a few seconds. At optimizer step 3 a NaN is put into
the output of the MLP on purpose (``ampguard.faults``): the guard skips that step, the Trainer's
LR scheduler holds, and the Trainer's logs gain ``loss_scale`` and ``skipped_steps``.

    python examples/hf_trainer.py
    python examples/hf_trainer.py --steps 20 --no-faults --output-dir /tmp/hf

The last line is ``first loss <x> final loss <y>``; exit code 0 when the run finished with finite
parameters and the loss went down.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from ampguard import faults
from ampguard.integrations.transformers import GuardedTrainer


class Counting(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sequences that count up by one from a random start, modulo 50: easy to learn."""

    def __init__(self, n: int = 256) -> None:
        start = torch.randint(0, 50, (n, 1), generator=torch.Generator().manual_seed(0))
        self.ids = (start + torch.arange(16)) % 50

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class InjectNaN(TrainerCallback):  # type: ignore[misc]
    """Once training starts (the guard exists), schedule a NaN in the MLP's output at one step."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.trainer: GuardedTrainer | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.trainer is not None and self.trainer.guard is not None
        faults.inject(self.trainer.guard, self.trainer.model, faults.output("transformer.h.0.mlp", "nan",
                                                                            steps=[self.step]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--no-faults", action="store_true", help="no NaN at step 3")
    parser.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: a temp dir)")
    opts = parser.parse_args(argv)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    output_dir = opts.output_dir or tempfile.mkdtemp(prefix="hf_trainer_")
    args = TrainingArguments(
        output_dir=output_dir, max_steps=opts.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-2, max_grad_norm=1.0, bf16=True, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )
    callbacks = [] if opts.no_faults else [InjectNaN(step=3)]
    trainer = GuardedTrainer(model=model, args=args, train_dataset=Counting(), callbacks=callbacks,
                             guard_config={"history_size": 4096})
    for cb in callbacks:
        cb.trainer = trainer
    trainer.train()

    guard = trainer.guard
    assert guard is not None
    print(f"{'step':>4} {'loss':>8} {'grad_norm':>9} {'lr':>9} {'scale':>6} skipped")
    for report, log in zip(guard.history, (h for h in trainer.state.log_history if "loss" in h), strict=True):
        print(f"{report.step:>4} {report.loss:>8.4f} {report.grad_norm:>9.4f} {log['learning_rate']:>9.2e} "
              f"{log['loss_scale']:>6g} {'SKIPPED: ' + str(report.reason) if report.skipped else ''}")
    skipped = [r.step for r in guard.history if r.skipped]
    print(f"skipped steps: {skipped}")
    finite = all(torch.isfinite(p).all() for p in trainer.model.parameters())
    losses = [r.loss for r in guard.history if not r.skipped]
    print(f"first loss {losses[0]:.4f} final loss {losses[-1]:.4f}")
    guard.close()
    return 0 if finite and losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
