"""``GuardedTrainer``: the transformers ``Trainer`` with every optimizer step guarded.

>>> from ampguard.integrations.transformers import GuardedTrainer
>>> trainer = GuardedTrainer(model=model, args=args, train_dataset=ds)   # Trainer's own arguments
>>> trainer.train()
>>> trainer.guard.skipped_steps, trainer.guard.last_report

What changes against the plain ``Trainer`` (everything else is the Trainer's own code):

- The optimizer that accelerate prepared is guarded
  (``ampguard.wrap(trainer.optimizer, accelerator=trainer.accelerator)``, see
  :mod:`ampguard.integrations.accelerate`) right after ``accelerator.prepare``, before the LR
  scheduler is built on it and before any optimizer state is loaded on
  ``resume_from_checkpoint``: ``trainer.optimizer`` is then the
  ``GuardedAcceleratedOptimizer``, and ``trainer.guard`` the :class:`~ampguard.GuardedOptimizer`
  (None until ``train()`` prepared the optimizer).
- Precision follows ``TrainingArguments`` as the Accelerator resolved it: ``fp16`` with the
  Accelerator's ``GradScaler`` (shared: ``accelerator.backward`` scales with it), ``bf16``, or
  ``fp32`` (also ``fp16=True`` where accelerate builds no scaler and no autocast, e.g. on CPU).
- A non-finite step is skipped on device; ``accelerator.optimizer_step_was_skipped`` is the
  guard's decision, so the Trainer holds the LR scheduler on that step.
- ``max_grad_norm``: the Trainer's ``accelerator.clip_grad_norm_`` is the guard's
  ``clip_grad_norm_`` (see the accelerate integration): with a fused optimizer in fp16
  (``optim="adamw_torch_fused"``) folded into the guarded step, otherwise the guard measures the
  gradients first and torch clips; the report's ``grad_norm`` is the norm before clipping.
- Loss: the report's loss is the loss of the optimizer step: the sum of the micro-batch losses
  as the Trainer back-propagates them through ``accelerator.backward`` (each already divided by
  the accumulation steps, or normalised by the items of the whole accumulated batch), observed by
  the accelerate integration: the same number the Trainer logs as ``loss`` for that step.
- Logs (``trainer.state.log_history``): the training logs gain ``loss_scale`` (1.0 without loss
  scaling) and ``skipped_steps`` (skipped so far in the run).
- Checkpoints: ``optimizer.pt`` holds the guard's state dict (inner optimizer, scaler and guard
  counters), so ``resume_from_checkpoint`` continues bit for bit. Under FSDP the inner optimizer
  goes to accelerate's FSDP save (DCP) and the guard's state beside it, ``ampguard_0_rank<r>.pt``.

Overridden ``Trainer`` methods (kept few on purpose):

- ``__init__``: checks the guard's arguments before the Trainer builds anything.
- ``create_scheduler``: ``Trainer._prepare_for_training`` calls it right after
  ``accelerator.prepare`` wrapped the optimizer, and before it loads ``optimizer.pt`` on resume:
  the one public method that runs there. The guard goes in first (``self.optimizer`` becomes the
  guarded one), so the scheduler is built on it and the checkpoint's guard state is loaded into
  the guard.
- ``log``: adds ``loss_scale`` and ``skipped_steps``.
- ``_save_checkpoint``: refuses an unhealthy state before anything is written.
- ``_save_optimizer_and_scheduler``/``_load_optimizer_and_scheduler``: under FSDP only, around the
  Trainer's own (torch's FSDP state-dict functions take a plain optimizer).

A subclass of ``GuardedTrainer`` that overrides one of these should call ``super()``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from ..config import GuardConfig
from ..errors import GuardStateError
from ..exporters.base import Exporter, MultiExporter
from ..factory import wrap
from ..guard import GuardedOptimizer
from ..integrity import refuse_unhealthy
from ._versions import require

require("transformers")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402  (after the version check)
from transformers import Trainer  # noqa: E402

from .accelerate import GuardedAcceleratedOptimizer, load_fsdp, save_fsdp  # noqa: E402

__all__ = ["GuardedTrainer"]


def _resolve_config(config: GuardConfig | dict[str, Any] | None) -> GuardConfig:
    if config is None:
        return GuardConfig()
    if isinstance(config, dict):
        return GuardConfig.from_dict(config)
    if isinstance(config, GuardConfig):
        return config
    raise TypeError(f"guard_config must be a GuardConfig or a dict of its fields, got {type(config).__name__}")


def _check_optimizers(optimizers: Any) -> None:
    """Refuse an optimizer that is already guarded: GuardedTrainer guards the one it prepares."""
    if not isinstance(optimizers, (tuple, list)) or len(optimizers) != 2:
        return  # the Trainer's own check speaks to that
    opt = optimizers[0]
    if isinstance(opt, GuardedOptimizer) or getattr(opt, "guard", None) is not None:
        raise GuardStateError(
            "GuardedTrainer got an optimizer that ampguard.wrap() already guarded. GuardedTrainer guards the optimizer "
            "itself, after accelerate prepared it: pass the plain optimizer (optimizers=(opt.optimizer, scheduler), "
            "with the scheduler built on that plain optimizer) and the guard's settings as guard_config=... and "
            "guard_exporters=...; or use the plain Trainer without ampguard. Nothing was changed."
        )


class GuardedTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer steps are guarded by ampguard.

    Takes the Trainer's own arguments, plus:

    - ``guard_config``: a :class:`~ampguard.GuardConfig` or a dict of its fields.
    - ``guard_exporters``: where the guard's step reports go (see :mod:`ampguard.exporters`).

    ``trainer.guard`` is the :class:`~ampguard.GuardedOptimizer` once ``train()`` has prepared
    the optimizer (None before). See the module docstring for what changes against ``Trainer``.
    Raises (before the Trainer builds anything) :class:`~ampguard.GuardStateError` for an
    optimizer that is already guarded, ``ValueError``/``TypeError`` for a bad guard argument,
    and :class:`~ampguard.integrations._versions.IntegrationVersionError` for a transformers
    version outside the tested range.
    """

    guard: GuardedOptimizer | None

    def __init__(self, *args: Any, guard_config: GuardConfig | dict[str, Any] | None = None,
                 guard_exporters: Sequence[Exporter] = (), **kwargs: Any) -> None:
        require("transformers")
        bound = inspect.signature(Trainer.__init__).bind(self, *args, **kwargs)  # TypeError as Trainer would
        config = _resolve_config(guard_config)
        _check_optimizers(bound.arguments.get("optimizers", (None, None)))
        exporters = tuple(guard_exporters)
        MultiExporter(exporters)  # checks each has open/export/close; opens nothing
        training_args = bound.arguments.get("args")
        if config.clip_grad_norm is not None and (training_args is None or training_args.max_grad_norm > 0):
            raise ValueError(
                f"guard_config.clip_grad_norm={config.clip_grad_norm} and TrainingArguments.max_grad_norm="
                f"{1.0 if training_args is None else training_args.max_grad_norm} would clip twice. Clip in one place: "
                "set max_grad_norm in TrainingArguments (the Trainer clips, the guard reports the norm before "
                "clipping) and drop clip_grad_norm from guard_config, or set TrainingArguments(max_grad_norm=0)."
            )
        if training_args is not None and getattr(training_args, "deepspeed", None):
            raise ValueError("GuardedTrainer does not support DeepSpeed (DeepSpeed scales the loss and steps the "
                             "optimizer itself). Use the plain Trainer, or drop deepspeed= from TrainingArguments.")
        self.guard = None
        self._guard_config = config
        self._guard_exporters = exporters
        super().__init__(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train()``; then the guard's :meth:`~ampguard.GuardedOptimizer.flush`, so that the
        guard's readers and exporters hold every step when it returns (healthy reports wait for a batch otherwise:
        until stop 51 a 21-step run's JSONL log read after ``train()`` held 16 to 20 of them). The guard stays open
        for another ``train()``; ``trainer.guard.close()`` ends it."""
        result = super().train(*args, **kwargs)
        if self.guard is not None and not self.guard._closed:
            self.guard.flush()
        return result

    # ------------------------------------------------------------------ install
    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None) -> torch.optim.lr_scheduler.LRScheduler:
        """Install the guard (once the optimizer is the prepared one), then the Trainer's own."""
        if optimizer is None:
            self._install_guard()
        return super().create_scheduler(num_training_steps, optimizer)

    def _install_guard(self) -> None:
        opt = self.optimizer
        if not isinstance(opt, AcceleratedOptimizer):
            return  # create_optimizer_and_scheduler() before train(): not prepared yet
        existing = getattr(opt, "guard", None)
        if existing is not None:  # a second train() on this trainer: accelerate hands back the same optimizer
            self.guard = existing
            return
        if self.guard is not None:
            # A new optimizer for a new run (train() with model_init reloads the model and drops the optimizer): the
            # last run's guard ends here, its summary and its exporters' close, before the new guard opens the same
            # exporters. Left open, it lived on beside the new one and wrote into exporters the new one had reopened.
            self.guard.close()
        # The accelerator's scaler and precision; the loss of every accelerator.backward is observed and
        # accelerator.clip_grad_norm_ measures before it clips (see ampguard.integrations.accelerate).
        guarded = wrap(opt, accelerator=self.accelerator, model=self.model, config=self._guard_config,
                       exporters=self._guard_exporters)
        self.optimizer, self.guard = guarded, guarded.guard

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, refused (``CheckpointError`` naming the tensors) before anything
        is written when the guarded state holds a NaN/Inf: the last checkpoint on disk stays the last
        good one (docs/integrity.md)."""
        if self.guard is not None:
            refuse_unhealthy(self.guard._verdict(fingerprints=False),
                             f"GuardedTrainer refused to save checkpoint-{self.state.global_step}")
        super()._save_checkpoint(model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's; under FSDP accelerate's ``save_fsdp_optimizer`` gets the inner optimizer (torch's
        FSDP state-dict functions take a plain optimizer's ``state_dict``) and the guard's own state goes
        beside it, one file per rank (:func:`ampguard.integrations.accelerate.save_fsdp`)."""
        places = self._fsdp_places()
        if not places:
            return super()._save_optimizer_and_scheduler(output_dir)
        save = super()._save_optimizer_and_scheduler
        save_fsdp(self.accelerator, places, lambda: save(output_dir), output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's; under FSDP accelerate's ``load_fsdp_optimizer`` gets the inner optimizer, then the
        guard's state is read back, checked and agreed by every rank
        (:func:`ampguard.integrations.accelerate.load_fsdp`)."""
        places = self._fsdp_places() if checkpoint is not None else []
        if not places:
            return super()._load_optimizer_and_scheduler(checkpoint)
        load = super()._load_optimizer_and_scheduler
        load_fsdp(self.accelerator, places, lambda: load(checkpoint), lambda: str(checkpoint),
                  "GuardedTrainer (resume_from_checkpoint)")

    def _fsdp_places(self) -> list[tuple[int, GuardedAcceleratedOptimizer]]:
        opt = self.optimizer
        if self.is_fsdp_enabled and self.guard is not None and isinstance(opt, GuardedAcceleratedOptimizer):
            return [(0, opt)]
        return []

    # ------------------------------------------------------------------ logs
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log; training logs gain ``loss_scale`` and ``skipped_steps``."""
        if self.guard is not None and ("loss" in logs or "train_loss" in logs):
            logs["loss_scale"] = self.guard.get_scale()
            logs["skipped_steps"] = self.guard.skipped_steps
        super().log(logs, start_time)
