"""PyTorch Lightning: :class:`AmpGuardPrecision`, a precision plugin that guards the optimizer.

>>> trainer = lightning.Trainer(plugins=[AmpGuardPrecision("bf16-mixed")], ...)
>>> trainer.fit(model)          # configure_optimizers returns a plain optimizer (+ schedulers)
>>> trainer.precision_plugin.guard.history

The plugin is Lightning's own :class:`~lightning.pytorch.plugins.precision.MixedPrecision`
(autocast, GradScaler, hooks, clipping, checkpointing) with the optimizer guarded:

- ``connect()`` (called by the strategy after ``configure_optimizers`` and before a checkpoint's
  optimizer state is restored) wraps the optimizer with :func:`ampguard.wrap`, sharing the
  plugin's GradScaler. Lightning's optimizers are then ``[guard]``: the checkpoint's optimizer
  state is ``guard.state_dict()`` (inner optimizer, scaler, guard counters).
- A step runs Lightning's fp16 order with the guard in GradScaler's place, in both precisions:
  ``scaler.scale(loss)`` in ``pre_backward`` (fp16), the closure, ``guard.unscale_()`` (unscale
  in fp16, and measure) where an ``on_before_optimizer_step`` hook (the module's or a callback's)
  may read the gradients, the hooks and clipping, ``guard.step()`` (which also sets the next loss
  scale: Lightning's ``scaler.step``/``scaler.update`` are not called).
- Clipping by norm (``Trainer(gradient_clip_val=...)``, or ``self.clip_gradients`` in manual
  optimization) is the guard's :meth:`~ampguard.GuardedOptimizer.clip_grad_norm_`: with a fused
  optimizer and a GradScaler, and no hook that reads the gradients first, it is folded into the
  fused step (no unscale pass, no clip pass: issue 26); otherwise it unscales and clips as torch
  does. Clipping by value is Lightning's own, on gradients the guard unscaled first. Either way the
  reports show the norm before clipping.
- Under ``ModelParallelStrategy`` (FSDP2, tensor parallelism), whose checkpoints go through torch's
  ``get_optimizer_state_dict``/``set_optimizer_state_dict`` (a plain optimizer's format), torch gets the
  inner optimizer and the guard's state rides in the same sharded checkpoint, one entry per rank, checked
  and agreed by every rank on load (the full, rank-0 checkpoint is refused: the guard's state is per rank).
- The previous step's gradients are freed just before Lightning's closure (``free_grads_first``), where the
  closure would free them after ``training_step`` and no hook can tell: each backward then puts them where the
  last one did, so the guard's measurement replays as a CUDA graph, and the forward runs without them (stop 54).
- LR schedulers with ``interval="step"`` are wrapped in :class:`HeldScheduler`: a scheduler step
  that follows a skipped optimizer step is held, so the schedule counts the steps taken (with no
  host sync in automatic optimization: the guard steps the scheduler itself).
"""

from __future__ import annotations

from ._versions import require

require("lightning")  # before importing from it: outside the tested range, say so and stop

import dataclasses  # noqa: E402
import io  # noqa: E402
import types  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Literal  # noqa: E402

import torch  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

from ..config import GuardConfig  # noqa: E402
from ..errors import GuardStateError  # noqa: E402
from ..exporters.base import Exporter, MultiExporter  # noqa: E402
from ..factory import wrap  # noqa: E402
from ..guard import GuardedOptimizer  # noqa: E402
from ..integrity import refuse_unhealthy  # noqa: E402
from ..schedules import ScheduledLR  # noqa: E402
from ._resume import restore_agreed  # noqa: E402

__all__ = ["AmpGuardPrecision", "HeldScheduler"]

_PRECISIONS = {"16-mixed": "fp16", "bf16-mixed": "bf16"}


class HeldScheduler:
    """An LR scheduler that does not advance after a step the guard skipped.

    Lightning steps ``interval="step"`` schedulers after every optimizer step and does not know
    about skips; :class:`AmpGuardPrecision` puts this wrapper in their place. Two ways:

    - ``sync_free=True`` (automatic optimization, ``frequency=1``, an ``LRScheduler``): the
      scheduler is handed to the guard (:meth:`GuardedOptimizer.schedule`), which steps it once
      per *taken* step with no host sync (on CUDA with a fused optimizer: at the start of the
      next step, before its update reads the LR); Lightning's call of ``step()`` does nothing.
    - otherwise (manual optimization, ``frequency > 1``, ``ReduceLROnPlateau``): ``step()`` is
      held when the guard stepped since the last call and its last step was skipped; otherwise
      it is the scheduler's own ``step()``. Reading the skip waits for the decision (on CUDA with
      a fused optimizer: one sync per call).

    ``get_last_lr()`` and ``state_dict()`` are the wrapped scheduler's; with ``sync_free``, once the guard
    knows the last step's skip (``docs/schedules.md``: between steps the guard has advanced the scheduler as
    if the last step was taken, undone before the next update where it was skipped). Everything else
    (attributes) is the wrapped scheduler's as it stands: checkpoints hold the scheduler's own state.
    ``self.lr_schedulers()`` returns this wrapper;
    ``.scheduler`` is yours.
    """

    def __init__(self, scheduler: Any, guard: GuardedOptimizer, *, sync_free: bool = False) -> None:
        self.scheduler = scheduler
        self.guard = guard
        self.sync_free = sync_free
        self._held = 0
        self._seen = guard.step_count
        self._wrapper: ScheduledLR | None = None
        if sync_free:
            self._skipped_before = guard.skipped_steps
            self._wrapper = guard.schedule(scheduler)

    @property
    def held(self) -> int:
        """Scheduler steps held so far, i.e. skipped optimizer steps since the wrapper was made
        (not checkpointed)."""
        return self.guard.skipped_steps - self._skipped_before if self.sync_free else self._held

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Nothing when ``sync_free`` (the guard steps the scheduler). Otherwise the scheduler's
        ``step()``, unless the optimizer step just before it was skipped (reading that waits for
        the guard's decision)."""
        if self.sync_free:
            return None
        stepped, self._seen = self.guard.step_count != self._seen, self.guard.step_count
        if stepped and self.guard.step_was_skipped:
            self._held += 1
            return None
        return self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> Any:
        return (self._wrapper or self.scheduler).get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return (self._wrapper or self.scheduler).state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "_wrapper"):  # not set yet (during unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"HeldScheduler({self.scheduler!r})"


def _sync_free(config: Any, automatic: bool, optimizer: torch.optim.Optimizer) -> bool:
    """Whether Lightning's calls of this scheduler's ``step()`` can be left to the guard's
    :meth:`~GuardedOptimizer.schedule`: one call per optimizer step (automatic optimization,
    ``frequency=1``) of a scheduler without a metric, built on ``optimizer``."""
    scheduler = config.scheduler
    return (automatic and config.frequency == 1 and isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
            and not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
            and getattr(scheduler.optimizer, "param_groups", None) is optimizer.param_groups)


def _trainer_of(model: Any) -> Any:
    """The Trainer a LightningModule (or a strategy's wrapper of one) is attached to; None if none."""
    try:
        return getattr(model, "module", model).trainer
    except (AttributeError, RuntimeError):  # not a LightningModule, or not attached to a Trainer
        return None


class AmpGuardPrecision(MixedPrecision):
    """Lightning's ``MixedPrecision`` with the optimizer guarded by ampguard.

    ``Trainer(plugins=[AmpGuardPrecision("16-mixed" | "bf16-mixed", ...)])``, with no
    ``precision=`` argument. ``configure_optimizers`` is unchanged: it returns one plain
    optimizer (and schedulers); the plugin guards it when the strategy connects it.

    - ``device``: the autocast device type ("cuda", "cpu"); None: the parameters' device type.
    - ``scaler``: fp16's ``torch.amp.GradScaler`` (None: a new one for the device, with
      GradScaler's defaults). Shared with the guard.
    - ``config``, ``exporters``, ``backend``, ``on_rollback``, ``on_abort``: as in
      :func:`ampguard.wrap`. ``GuardConfig.clip_grad_norm`` (the guard clips with its own norm)
      and ``Trainer(gradient_clip_val=...)`` (Lightning clips) exclude each other.
    - ``log``: after each step, ``self.log`` the loss scale, the skipped-step count and whether the
      step was skipped (``ampguard/loss_scale``, ``ampguard/skipped_steps``, ``ampguard/skipped``)
      to Lightning's loggers. Reading the decision waits for it (on CUDA: one sync per step).
    - ``free_grads_first``: free the previous step's gradients before ``training_step``, where Lightning's
      closure would free them after it (between the forward and the backward), on the steps where Lightning
      zeroes them in the closure and nothing else can tell: no ``on_before_zero_grad`` or
      ``optimizer_zero_grad`` hook (the module's or a callback's), Lightning's own closure. The gradients are
      then not held through the forward (lower peak memory), and each backward puts them at the addresses of the
      last, which lets the guard replay its measurement as a CUDA graph (under Lightning's order the addresses
      change every step: stop 54). ``False``: Lightning's order, for a ``training_step`` that reads the previous
      step's ``.grad``.

    Resuming a checkpoint written without the plugin works: its plain optimizer state (and
    ``MixedPrecision``'s scaler state) is adopted, with guard counters starting at the
    checkpoint's global step.

    ``guard``: the :class:`~ampguard.guard.GuardedOptimizer`, from ``connect()`` on (e.g. in
    ``on_train_start``); its reports stay readable after ``fit()``, which closes it.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        config: GuardConfig | dict[str, Any] | None = None,
        exporters: Sequence[Exporter] = (),
        backend: Any = None,
        on_rollback: Callable[[Any, int], None] | None = None,
        on_abort: Callable[[Any, str], None] | None = None,
        log: bool = False,
        free_grads_first: bool = True,
    ) -> None:
        require("lightning")
        if precision not in _PRECISIONS:
            raise ValueError(
                f"AmpGuardPrecision(precision={precision!r}): use '16-mixed' (fp16 with loss scaling) or "
                "'bf16-mixed'. Pass it to the plugin only, not also as Trainer(precision=...).")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if scaler is not None and precision == "bf16-mixed":
            raise ValueError("AmpGuardPrecision('bf16-mixed', scaler=...): bf16 needs no loss scaling. Drop the "
                             "scaler, or use '16-mixed'.")
        if not isinstance(free_grads_first, bool):
            raise TypeError(f"free_grads_first must be a bool (True: free the gradients before training_step where "
                            f"Lightning frees them after it; False: Lightning's order), got {free_grads_first!r}")
        if not isinstance(config, (GuardConfig, dict, type(None))):
            raise TypeError(f"config must be a GuardConfig or a dict of its fields, got {type(config).__name__}")
        # MixedPrecision.__init__ is not called: it would build a GradScaler before the device is known.
        self.precision = precision
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.scaler = scaler
        self.config = config if isinstance(config, GuardConfig) else GuardConfig.from_dict(config or {})
        self.exporters = tuple(exporters)
        MultiExporter(self.exporters)  # checks each has open/export/close; opens nothing
        self.backend = backend
        self.on_rollback, self.on_abort = on_rollback, on_abort
        self.log_stats = log
        self.free_grads_first = free_grads_first
        self.guard: GuardedOptimizer | None = None
        self._device_given = device is not None

    # ------------------------------------------------------------------ setup
    def connect(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                lr_schedulers: list[Any]) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Guard the optimizer and hold the step schedulers (see the module docstring). Every
        check runs before anything is built."""
        if not optimizers or (self.guard is not None and list(optimizers) == [self.guard]):
            return model, optimizers, lr_schedulers  # validate/test/predict, or after our own fit
        self._check(model, optimizers)
        (optimizer,) = optimizers
        device = next(p.device for group in optimizer.param_groups for p in group["params"])
        if not self._device_given:
            self.device = device.type
        automatic = getattr(getattr(model, "module", model), "automatic_optimization", True)
        free = [c.interval == "step" and _sync_free(c, automatic, optimizer) for c in lr_schedulers]
        if self.precision == "16-mixed" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device)
        guard = wrap(optimizer, model=model, scaler=self.scaler, precision=_PRECISIONS[self.precision],  # type: ignore[arg-type]
                     config=self.config, exporters=self.exporters, backend=self.backend,
                     on_rollback=self.on_rollback, on_abort=self.on_abort)
        guard.register_load_state_dict_pre_hook(self._adopt_plain_state)
        self.guard = guard
        trainer = _trainer_of(model)
        if trainer is not None and isinstance(trainer.strategy, ModelParallelStrategy):  # checked in _check
            _model_parallel_checkpoints(trainer.strategy, guard)
        held = [dataclasses.replace(c, scheduler=HeldScheduler(c.scheduler, guard, sync_free=f))
                if c.interval == "step" else c for c, f in zip(lr_schedulers, free)]
        return model, [guard], held

    def _check(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        if len(optimizers) > 1:
            names = ", ".join(type(o).__name__ for o in optimizers)
            raise ValueError(
                f"AmpGuardPrecision guards one optimizer; configure_optimizers returned {len(optimizers)} ({names}). "
                "Put the parameters into one optimizer, as param groups with their own lr/weight_decay "
                "(torch.optim.AdamW([{'params': ...}, {'params': ..., 'lr': ...}])).")
        (optimizer,) = optimizers
        if isinstance(optimizer, GuardedOptimizer):
            raise GuardStateError(
                "configure_optimizers returned an optimizer already guarded by ampguard.wrap(); AmpGuardPrecision "
                "guards it itself. Return the plain optimizer (the guard's .optimizer). Nothing was changed.")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("AmpGuardPrecision cannot guard LBFGS: its step re-evaluates the closure, and the guard "
                             "checks one backward per step. Use another optimizer, or train without the plugin.")
        trainer = _trainer_of(model)
        if (trainer is not None and isinstance(trainer.strategy, ModelParallelStrategy)
                and not trainer.strategy._save_distributed_checkpoint):
            raise NotImplementedError(
                "AmpGuardPrecision with ModelParallelStrategy(save_distributed_checkpoint=False) is not supported: the "
                "full checkpoint keeps rank 0's state only, and the guard's state is per rank. Use the default "
                "(save_distributed_checkpoint=True). Nothing was changed.")
        if trainer is not None and trainer.gradient_clip_val and self.config.clip_grad_norm is not None:
            raise ValueError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) and GuardConfig(clip_grad_norm="
                f"{self.config.clip_grad_norm}) would clip twice. Keep one: Lightning's clipping (norm or value), or "
                "the guard's (norm, with the norm it already measured).")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The plugin's state in a Lightning checkpoint, which Lightning builds whole before writing
        anything: refused (``CheckpointError`` naming the tensors) when the guarded state holds a
        NaN/Inf, so ``ModelCheckpoint`` writes nothing and the last good checkpoint stays."""
        if self.guard is not None and not self.guard._closed:
            refuse_unhealthy(self.guard._verdict(fingerprints=False), "Lightning checkpoint refused")
        return super().state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of Lightning's own fp16 ``MixedPrecision``: adopt its scaler state."""
        plain = checkpoint.get(MixedPrecision.__qualname__)
        if self.scaler is not None and type(self).__qualname__ not in checkpoint and plain:
            self.scaler.load_state_dict(plain)

    def _adopt_plain_state(self, guard: GuardedOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``guard.load_state_dict`` pre-hook: a plain optimizer state (a checkpoint written without
        the plugin) becomes a guard state with fresh counters from the restored global step."""
        if not isinstance(state_dict, dict) or "ampguard" in state_dict or "param_groups" not in state_dict:
            return state_dict
        fresh = guard.state_dict()
        trainer = _trainer_of(guard.model)
        if trainer is not None:
            fresh["ampguard"]["step"] = trainer.global_step
        return {**fresh, "optimizer": state_dict}

    # ------------------------------------------------------------------ the step
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        """Record the loss for the guard's checks, then Lightning's: scale (fp16) and hooks.
        Automatic optimization divides each micro-batch loss by ``accumulate_grad_batches``:
        the guard sums them; manual losses are averaged."""
        if self.guard is not None and tensor.numel() == 1:
            self.guard.observe_loss(tensor, reduction="sum" if module.automatic_optimization else "mean")
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, model: Any,  # type: ignore[override]
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Lightning's fp16 order in both precisions, with the guard in GradScaler's place: the
        closure, ``guard.unscale_()`` (unscale in fp16, and measure), the hooks and clipping
        (``_after_closure``), ``guard.step()``, which also sets the next loss scale (Lightning's
        ``scaler.step``/``scaler.update`` are not called). A ``training_step`` that returned None
        (automatic optimization) runs no backward and no step, as in Lightning's fp16 path."""
        guard = self.guard
        if guard is None or optimizer is not guard:
            raise GuardStateError(f"AmpGuardPrecision was asked to step {type(optimizer).__name__}, which it did not "
                                  "guard: step the optimizer configure_optimizers returned (self.optimizers()).")
        if self.free_grads_first and _zeroes_in_closure(closure, model):
            guard.zero_grad()  # what the closure's zero_grad_fn does after training_step, before it instead
        result = closure()
        backward_ran = not (result is None and model.automatic_optimization)
        if backward_ran and _hooks_read_grads(model):
            guard.unscale_()  # unscaled for the hooks, and measured before they or the clip change the gradients
        self._after_closure(model, guard)
        if backward_ran:
            guard.step(**kwargs)
            if self.log_stats:
                self._log(model, guard)
        return result

    @staticmethod
    def _log(model: Any, guard: GuardedOptimizer) -> None:
        report = guard.last_report
        if report is None:
            return
        for name, value in (("loss_scale", report.loss_scale), ("skipped_steps", float(guard.skipped_steps)),
                            ("skipped", float(report.skipped))):
            model.log(f"ampguard/{name}", value, on_step=True, on_epoch=False, batch_size=1)

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """By norm: the guard's ``clip_grad_norm_`` (folded into a fused step where it can be; see the module
        docstring). By value: Lightning's, on gradients the guard unscaled and measured first (also in manual
        optimization, where Lightning's own fp16 path would clip scaled gradients)."""
        if clip_val > 0 and self.guard is not None:
            if gradient_clip_algorithm == GradClipAlgorithmType.NORM:
                self.guard.clip_grad_norm_(clip_val)
                return
            self.guard.unscale_()
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def teardown(self) -> None:
        """Close the guard (flush the exporters, detach from the scaler); reports stay readable."""
        if self.guard is not None:
            self.guard.close()
        super().teardown()


def _model_parallel_checkpoints(strategy: ModelParallelStrategy, guard: GuardedOptimizer) -> None:
    """``ModelParallelStrategy`` (FSDP2, tensor parallelism) saves and loads each optimizer with torch's
    ``get_optimizer_state_dict``/``set_optimizer_state_dict``, which read a plain optimizer's ``state_dict``
    and call ``step()`` on an empty one: on the guard its first checkpoint died (``KeyError: 'state'``).
    Instance attributes on this strategy (``teardown`` of the strategy drops the object with them) hand
    torch the inner optimizer and keep the guard's own state in the same distributed checkpoint, under the
    optimizer's key, one entry per rank (``ampguard.rank<r>``), restored after Lightning's load by
    :func:`~ampguard.integrations._resume.restore_agreed` (checked, the ranks agreeing). Only the sharded
    checkpoint (``save_distributed_checkpoint=True``, the default) is supported: ``_check`` refuses the other
    before the guard is built."""
    cls = type(strategy)
    optimizer_state = types.MethodType(cls.optimizer_state, strategy)
    load_checkpoint = types.MethodType(cls.load_checkpoint, strategy)
    key = f"rank{guard.backend.rank}"

    def guarded_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if opt is not guard:
            return optimizer_state(optimizer)  # type: ignore[no-any-return]
        buf = io.BytesIO()
        torch.save(guard._state_without_optimizer(), buf)  # before torch touches the optimizer
        return {**optimizer_state(guard.optimizer), "ampguard": {key: buf}}

    def guarded_load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        held = strategy._optimizers
        strategy._optimizers = [guard.optimizer if o is guard else o for o in held]
        try:
            loaded = load_checkpoint(checkpoint_path, weights_only)
        finally:
            strategy._optimizers = held
        path = Path(checkpoint_path)
        index = next((i for i, o in enumerate(held) if o is guard), None)
        state = None
        if index is not None and path.is_dir():
            from torch.distributed.checkpoint import FileSystemReader, load

            if f"optimizer_{index}.ampguard.{key}" in FileSystemReader(path).read_metadata().state_dict_metadata:
                template = {f"optimizer_{index}": {"ampguard": {key: io.BytesIO()}}}
                load(template, checkpoint_id=path)
                buf = template[f"optimizer_{index}"]["ampguard"][key]
                buf.seek(0)
                state = torch.load(buf, weights_only=True)  # plain values only: no code runs
        restore_agreed([(guard, state)], str(path), "Lightning (ModelParallelStrategy) checkpoint load")
        return loaded  # type: ignore[no-any-return]

    strategy.optimizer_state = guarded_optimizer_state  # type: ignore[method-assign]
    strategy.load_checkpoint = guarded_load_checkpoint  # type: ignore[method-assign]


def _zeroes_in_closure(closure: Any, model: Any) -> bool:
    """Whether freeing the gradients before ``closure()`` changes nothing a hook can see: ``closure`` is Lightning's
    own automatic-optimization ``Closure`` and zeroes the gradients itself (its ``zero_grad_fn``: the first batch of
    an accumulation window, a backward to run), with Lightning's ``optimizer_zero_grad`` (``optimizer.zero_grad()``)
    and no ``on_before_zero_grad`` hook of the module's or a callback's, which would see the previous step's
    gradients there. A user's own closure, or any of those hooks: Lightning's order is kept."""
    import lightning.pytorch as pl
    from lightning.pytorch.loops.optimization.automatic import Closure

    if not isinstance(closure, Closure) or getattr(closure, "_zero_grad_fn", None) is None:  # private: absent, kept
        return False
    if type(model).optimizer_zero_grad is not pl.LightningModule.optimizer_zero_grad:
        return False
    return not _hook_defined(model, "on_before_zero_grad")


def _hooks_read_grads(model: Any) -> bool:
    """Whether an ``on_before_optimizer_step`` hook may read the gradients before the step: the module's own, or a
    callback's (Lightning documents the gradients as unscaled there). Without one, the guard measures them in
    ``step()`` itself, still scaled on the fused fast path (and folds a clip by norm)."""
    return _hook_defined(model, "on_before_optimizer_step")


def _hook_defined(model: Any, name: str) -> bool:
    """Whether the module or one of its Trainer's callbacks overrides Lightning's hook ``name`` (a no-op in both
    ``LightningModule`` and ``Callback``)."""
    import lightning.pytorch as pl

    if getattr(type(model), name) is not getattr(pl.LightningModule, name):
        return True
    trainer = getattr(model, "_trainer", None)
    callbacks = getattr(trainer, "callbacks", ()) if trainer is not None else ()
    default = getattr(pl.Callback, name)
    return any(getattr(type(cb), name) is not default for cb in callbacks)
