"""Issue 27 in the frameworks: accelerate's ``save_state``, ``GuardedTrainer``'s checkpoints and
Lightning's ``ModelCheckpoint`` (through ``AmpGuardPrecision``) refuse to write a non-finite state,
and the last good checkpoint stays. The poison is real: an update at an infinite learning rate
(the parameter check, ``param_check_every``, is off here so that training reaches the save)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import ampguard

pytestmark = pytest.mark.frameworks


def test_accelerate_save_state_refuses_a_non_finite_state_before_writing(tmp_path: Path) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, inner)
    opt = ampguard.wrap(opt, accelerator=acc, model=model, config={"param_check_every": None})
    x, y = torch.randn(16, 8), torch.randn(16, 2)

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()

    step()
    acc.save_state(str(tmp_path / "good"))  # healthy: written
    for group in inner.param_groups:
        group["lr"] = math.inf  # an LR schedule gone inf: a real update to inf/NaN from finite gradients
    step()
    with pytest.raises(ampguard.CheckpointError, match=r"save_state refused: .* non-finite: 0.weight"):
        acc.save_state(str(tmp_path / "poisoned"))
    assert not (tmp_path / "poisoned").exists() and (tmp_path / "good").is_dir()
    opt.close()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_guarded_trainer_refuses_to_save_a_non_finite_checkpoint(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from ampguard.integrations.transformers import GuardedTrainer

    class _LrGoesInf(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args, state, control, optimizer=None, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == 2:
                for group in optimizer.param_groups:
                    group["lr"] = math.inf

    class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        ids = torch.randint(0, 50, (32, 8), generator=torch.Generator().manual_seed(1))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
                             save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, bf16=True,
                             dataloader_num_workers=0, disable_tqdm=True, optim="adamw_torch",
                             lr_scheduler_type="constant")
    trainer = GuardedTrainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[_LrGoesInf()],
                             guard_config={"param_check_every": None, "max_consecutive_skips": None})
    with pytest.raises(ampguard.CheckpointError, match="GuardedTrainer refused to save checkpoint-4"):
        trainer.train()
    assert (tmp_path / "checkpoint-2").is_dir() and not (tmp_path / "checkpoint-4").exists()


def test_lightning_model_checkpoint_refuses_a_non_finite_state(tmp_path: Path) -> None:
    import lightning as L
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from ampguard.integrations.lightning import AmpGuardPrecision

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return F.mse_loss(self.head(torch.tanh(self.layer(x))).float(), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            if self.global_step == 2:
                for group in self.trainer.optimizers[0].param_groups:
                    group["lr"] = math.inf

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 1, generator=g)), batch_size=4)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    plugin = AmpGuardPrecision("bf16-mixed", config={"param_check_every": None, "max_consecutive_skips": None})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, plugins=[plugin], enable_progress_bar=False,
                        logger=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[ckpt])
    with pytest.raises(ampguard.CheckpointError, match="Lightning checkpoint refused"):
        trainer.fit(Net(), train_dataloaders=data)
    saved = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert saved == ["epoch=0-step=2.ckpt"], saved
