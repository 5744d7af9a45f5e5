"""ampguard inside Hugging Face accelerate.

Guard the optimizer that ``accelerator.prepare`` returned, and name the Accelerator; the training
loop stays accelerate's::

    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    optimizer = ampguard.wrap(optimizer, accelerator=accelerator, model=model)   # the one added line

``ampguard.wrap`` checks the arguments here (:func:`resolve`), builds the
:class:`~ampguard.GuardedOptimizer` around the optimizer inside the ``AcceleratedOptimizer``, and
hands it back here (:func:`attach`), which returns a :class:`GuardedAcceleratedOptimizer`: an
``AcceleratedOptimizer`` whose ``optimizer`` is the guard. It takes the prepared optimizer's place
in the Accelerator (``save_state``/``load_state``, ``optimizer_step_was_skipped``,
``unscale_gradients``) and in the ``AcceleratedScheduler``'s that hold it:

- ``optimizer.step()`` runs the guarded step on accumulation boundaries
  (``accelerator.sync_gradients``) and does nothing on the other micro-steps. The guard unscales
  with the accelerator's own ``GradScaler`` (shared: ``accelerator.backward`` scales with it),
  decides, steps or skips, and sets the next loss scale itself.
- ``optimizer.step_was_skipped`` (so ``accelerator.optimizer_step_was_skipped``) is the guard's:
  the ``AcceleratedScheduler`` holds the learning rate exactly on the skipped steps.
- ``accelerator.clip_grad_norm_`` over a guard's parameters, on a step boundary, is the guard's
  :meth:`~ampguard.GuardedOptimizer.clip_grad_norm_` (an instance attribute, like ``backward``):
  with a fused optimizer in fp16 it is folded into the guarded step (2 passes over the gradients
  instead of accelerate's 4: unscale_, the norm, the clip, the step). Other calls are accelerate's,
  which
  measures through the guard first: in fp16 accelerate's own
  ``scaler.unscale_`` is the guard's ``unscale_``; without a scaler (bf16, fp32) accelerate unscales
  nothing, and the integration has the guard measure first. Clipping sees unscaled gradients and
  the report's ``grad_norm`` is the norm before clipping. Clipping on a micro-step that does not
  step is refused.
- ``state_dict``/``load_state_dict`` are the guard's: ``accelerator.save_state``/``load_state``
  carry the guard's counters with the optimizer. Under FSDP (1 or 2) accelerate hands the optimizer to
  torch's FSDP state-dict functions, which take a plain optimizer's ``state_dict`` and, for an empty state,
  call its ``step()``: there the integration hands them the inner optimizer (saved and loaded as in the plain
  FSDP run) and keeps the guard's own state beside it, one file per rank (``ampguard_<i>_rank<r>.pt``),
  checked and agreed by every rank when it is loaded.
- The guard's readers (``last_report``, ``history``, ``anomalies``, ``skipped_steps``,
  ``step_count``, ``flush``, ``close``, ...) are reachable on the returned object;
  ``optimizer.guard`` is the :class:`~ampguard.GuardedOptimizer`.

The reported loss: accelerate has no hook on ``accelerator.backward``, so the integration wraps
that one Accelerator's ``backward`` (an instance attribute; ``close()`` of its last guard removes
it) and records ``loss / gradient_accumulation_steps``, what accelerate back-propagates, summed
over the step's micro-batches: the loss of the optimizer step. Without a GradScaler it wraps
``unscale_gradients`` the same way (accelerate's ``clip_grad_norm_`` calls it before it clips).

Wrapping before ``prepare`` (``accelerator.prepare(ampguard.wrap(optimizer))``) is refused by
``prepare`` with :class:`~ampguard.GuardStateError` naming the order above.
"""

from __future__ import annotations

import contextlib
import os
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import GuardStateError
from ..guard import GuardedOptimizer
from ..integrity import refuse_unhealthy
from ..vocab import Precision
from ._resume import restore_agreed
from ._versions import require

require("accelerate")

from accelerate import Accelerator  # noqa: E402  (after the version check)
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["GuardedAcceleratedOptimizer", "attach", "load_fsdp", "resolve", "save_fsdp"]

_ORDER = "optimizer = ampguard.wrap(accelerator.prepare(optimizer), accelerator=accelerator, model=model)"
_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


class GuardedAcceleratedOptimizer(AcceleratedOptimizer):
    """An ``AcceleratedOptimizer`` whose inner optimizer is a :class:`~ampguard.GuardedOptimizer`.
    Made by ``ampguard.wrap(prepared, accelerator=...)``. Public names it does not have are the
    guard's (``last_report``, ``history``, ``flush``, ...)."""

    optimizer: GuardedOptimizer

    def __init__(self, prepared: AcceleratedOptimizer, guard: GuardedOptimizer,
                 hooks: _AcceleratorHooks | None = None) -> None:
        # AcceleratedOptimizer.__init__ is not called: prepare() already placed the state on the
        # device, and the GradScaler step it would set up is the guard's now.
        self.optimizer = guard
        self.scaler = prepared.scaler
        self.accelerator_state = prepared.accelerator_state
        self.gradient_state = prepared.gradient_state
        self.device_placement = prepared.device_placement
        self._is_overflow = False
        self._hooks = hooks
        if hooks is not None:
            self._is_accelerate_prepared = True  # accelerate's mark: prepare() hands it back as it is

    @property
    def guard(self) -> GuardedOptimizer:
        """The :class:`~ampguard.GuardedOptimizer` inside."""
        return self.optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The guarded step on an accumulation boundary; nothing on the other micro-steps. No
        ``scaler.step``/``scaler.update``: the guard unscales, decides and sets the next scale."""
        if not self.gradient_state.sync_gradients:
            return None
        return self.optimizer.step(closure)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the guard skipped the last step (waits for its decision where it is still on
        the device: one host sync per step when a scheduler reads it)."""
        return self.optimizer.step_was_skipped

    def close(self) -> Any:
        """The guard's ``close()``; the last guard of the Accelerator also hands its ``backward``
        back. Idempotent. Returns the run's summary."""
        try:
            return self.optimizer.close()
        finally:
            if self._hooks is not None:
                self._hooks.remove(self.optimizer)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the guard's public surface.
        if name.startswith("_") or name == "optimizer":
            raise AttributeError(name)
        if name == "backward":
            raise AttributeError("use accelerator.backward(loss): it scales with the shared GradScaler and divides "
                                 "by gradient_accumulation_steps; the guard observes it")
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"GuardedAcceleratedOptimizer({self.optimizer!r})"


def resolve(prepared: torch.optim.Optimizer, accelerator: object | None, *, scaler: torch.amp.GradScaler | None,
            precision: Precision) -> tuple[torch.optim.Optimizer, torch.amp.GradScaler | None, Precision]:
    """Check ``ampguard.wrap(prepared, accelerator=accelerator, ...)`` and return what the guard is
    built with: the optimizer inside ``prepared``, the accelerator's GradScaler and the precision
    it runs. Changes nothing. Raises ``TypeError`` (not what ``accelerator.prepare`` returned; no
    ``accelerator=`` for a prepared optimizer), ``ValueError`` (an optimizer this Accelerator did
    not prepare; a scaler or precision that disagrees with the accelerator's),
    ``GuardStateError`` (already guarded), ``NotImplementedError`` (DeepSpeed, Megatron-LM, XLA)
    and ``IntegrationVersionError`` (outside the tested accelerate versions)."""
    require("accelerate")
    if not isinstance(prepared, AcceleratedOptimizer):
        raise TypeError(f"wrap(accelerator=...) expects what accelerator.prepare(optimizer) returned, got "
                        f"{type(prepared).__name__}: prepare first, then guard: `{_ORDER}`")
    if isinstance(prepared, GuardedAcceleratedOptimizer):
        raise GuardStateError("this optimizer is already guarded: ampguard.wrap() returned it. Wrap once, after "
                              f"prepare: `{_ORDER}` (opt.guard is the GuardedOptimizer). Nothing was changed.")
    if isinstance(prepared.optimizer, GuardedOptimizer):
        raise GuardStateError("the optimizer inside this AcceleratedOptimizer is already guarded (ampguard.wrap() "
                              f"before accelerate). Wrap once, after prepare: `{_ORDER}`. Nothing was changed.")
    if accelerator is None:
        if getattr(prepared, "_is_accelerate_prepared", False):  # accelerate's mark of what prepare() returned
            raise TypeError("ampguard.wrap() of what accelerator.prepare() returned needs the Accelerator too: "
                            f"`{_ORDER}` (the guard takes the optimizer's place in its save_state, "
                            "optimizer_step_was_skipped and schedulers). Nothing was changed.")
    elif not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator= expects an accelerate.Accelerator, got {type(accelerator).__name__}")
    elif not any(o is prepared for o in accelerator._optimizers):
        raise ValueError("this optimizer was not prepared by that Accelerator (it is not among the optimizers its "
                         f"prepare() returned): pass the Accelerator that prepared it: `{_ORDER}`. "
                         "Nothing was changed.")
    state = prepared.accelerator_state
    if state.distributed_type in _UNSUPPORTED:
        raise NotImplementedError(f"ampguard's accelerate integration does not support {state.distributed_type}: "
                                  "its backward, loss scaling and step are not accelerate's AcceleratedOptimizer's")
    acc_scaler = prepared.scaler
    if scaler is not None and scaler is not acc_scaler:
        raise ValueError("scaler= is not the accelerator's GradScaler: accelerator.backward() scales with "
                         "accelerator.scaler, so the guard must share it. Leave scaler= out. Nothing was changed.")
    resolved: Precision = "fp16" if acc_scaler is not None else (
        "bf16" if state.mixed_precision in ("bf16", "fp8") else "fp32")  # no scaler: accelerate trains fp16 in fp32
    if precision not in ("auto", resolved):
        described = (f"mixed_precision={state.mixed_precision!r} "
                     f"{'with' if acc_scaler is not None else 'without'} a GradScaler")
        raise ValueError(f"precision={precision!r}, but the accelerator runs {described}, which is {resolved!r} for "
                         "the guard. Leave precision= out ('auto'), or change Accelerator(mixed_precision=...). "
                         "Nothing was changed.")
    return prepared.optimizer, acc_scaler, resolved


def attach(prepared: AcceleratedOptimizer, guard: GuardedOptimizer,
           accelerator: Accelerator | None) -> GuardedAcceleratedOptimizer:
    """The :class:`GuardedAcceleratedOptimizer` around ``guard`` (built on what :func:`resolve`
    returned), in ``prepared``'s place in ``accelerator``. Called by ``ampguard.wrap`` once every
    check passed."""
    gradient_state = prepared.gradient_state

    def before_unscale(step: int) -> None:
        if not gradient_state.sync_gradients:
            raise GuardStateError(
                "the gradients were unscaled (accelerator.clip_grad_norm_/unscale_gradients) on a micro-step that "
                "does not step (accelerator.sync_gradients is False): the next backward would add scaled gradients "
                "to unscaled ones. Clip only on the step: `if accelerator.sync_gradients: "
                "accelerator.clip_grad_norm_(...)`. Nothing was changed.")

    guard.register_pre_unscale_hook(before_unscale)
    if accelerator is None:
        warnings.warn("ampguard: no accelerator= given, so accelerator.backward() is not observed and the reported "
                      "loss is unknown (None); call opt.observe_loss(loss) per micro-batch to report it",
                      RuntimeWarning, stacklevel=3)
        return GuardedAcceleratedOptimizer(prepared, guard)
    hooks = _AcceleratorHooks.add(accelerator, guard)
    wrapped = GuardedAcceleratedOptimizer(prepared, guard, hooks)
    _take_place(accelerator, prepared, wrapped, hooks)
    return wrapped


# ---------------------------------------------------------------------------------------- internals
def _take_place(accelerator: Accelerator, prepared: AcceleratedOptimizer, wrapped: GuardedAcceleratedOptimizer,
                hooks: _AcceleratorHooks) -> None:
    """Put ``wrapped`` where ``prepared`` was: in ``accelerator._optimizers`` (what ``save_state``,
    ``load_state``, ``optimizer_step_was_skipped`` and ``unscale_gradients`` read; accelerate has
    no public call to replace a prepared optimizer) and in the public ``optimizers`` list of each
    ``AcceleratedScheduler`` prepared with it; then hand the guard those it can step (:func:`_hold`)."""
    optimizers = accelerator._optimizers
    optimizers[:] = [wrapped if o is prepared else o for o in optimizers]
    for scheduler in accelerator._schedulers:
        held = getattr(scheduler, "optimizers", None)
        if isinstance(held, (list, tuple)) and held is not optimizers and any(o is prepared for o in held):
            scheduler.optimizers = [wrapped if o is prepared else o for o in held]
        hooks.hold(scheduler, wrapped)


_HELD = ("step", "get_last_lr", "state_dict")
"""The ``AcceleratedScheduler`` methods a held one has as instance attributes (:func:`_hold`)."""


def _hold(scheduler: Any, wrapped: GuardedAcceleratedOptimizer) -> bool:
    """Hand ``scheduler`` (an ``AcceleratedScheduler``) to ``wrapped``'s guard, where it holds that optimizer alone,
    steps with it (``step_scheduler_with_optimizer``) and wraps an ``LRScheduler`` built on it: the guard steps it
    once per *taken* step at its fixed points, as ``opt.schedule()`` does (``docs/schedules.md``), and its own
    ``step()`` on a step boundary does nothing. accelerate's ``step()`` reads ``step_was_skipped``, which on the
    sync-free path (a fused optimizer on CUDA) waits for the whole optimizer step every step, where the plain
    accelerate loop waits for nothing (it only learns whether ``optimizer.step`` was called; with a fused
    optimizer it always is). ``get_last_lr()`` first reads the last step's skip (the advance made ahead for it kept
    or undone) and ``state_dict()`` counts every pending report, so what they return is accelerate's. Instance
    attributes only (the class is not patched); the guard's ``close()`` hands it back. Returns whether it is held."""
    guard = wrapped.optimizer
    inner = getattr(scheduler, "scheduler", None)
    held = getattr(scheduler, "optimizers", None)
    if (not isinstance(held, (list, tuple)) or len(held) != 1 or held[0] is not wrapped
            or not getattr(scheduler, "step_with_optimizer", False) or any(n in scheduler.__dict__ for n in _HELD)
            or not isinstance(inner, torch.optim.lr_scheduler.LRScheduler)
            or isinstance(inner, torch.optim.lr_scheduler.ReduceLROnPlateau)
            or getattr(getattr(inner, "optimizer", None), "param_groups", None) is not guard.param_groups):
        return False  # accelerate's own step (it reads step_was_skipped: a wait per step on the sync-free path)
    cls = type(scheduler)

    def advance() -> None:  # accelerate's AcceleratedScheduler.step after its skip check (accelerate 1.x)
        times = 1 if scheduler.split_batches else AcceleratorState().num_processes
        for _ in range(times):
            if hasattr(inner, "total_steps") and inner._step_count > inner.total_steps:
                continue  # OneCycleLR without drop_last, as accelerate
            inner.step()

    wrapper = guard._outcome.schedules.add_scheduler(guard.optimizer, inner, advance)

    def step(*args: Any, **kwargs: Any) -> None:
        if not wrapper.registered:  # the guard closed: accelerate's own again
            cls.step(scheduler, *args, **kwargs)
            return
        if args or kwargs:
            raise TypeError(f"this AcceleratedScheduler is stepped by the guard (once per taken optimizer step), "
                            f"which passes nothing to {type(inner).__name__}.step(); got {args or kwargs}. Call "
                            "scheduler.step() with no arguments. Nothing was changed.")
        if not scheduler.gradient_state.sync_gradients:  # a micro-step: accelerate's own bookkeeping
            cls.step(scheduler)

    def get_last_lr() -> Any:  # the advance made ahead for the last step settled (its skip flag read)
        if wrapper.registered:
            guard._outcome.schedules.exact()
        return cls.get_last_lr(scheduler)

    def state_dict() -> Any:  # every pending report counted first
        if wrapper.registered:
            guard._outcome.catch_up()
        return cls.state_dict(scheduler)

    scheduler.step, scheduler.get_last_lr, scheduler.state_dict = step, get_last_lr, state_dict
    return True


class _AcceleratorHooks:
    """Instance attributes on one Accelerator, where accelerate has no hook (nothing global; the
    last of its guards to close removes them):

    - ``backward(loss)``: hands each loss, as accelerate back-propagates it, to the guards.
    - ``unscale_gradients()`` (what ``clip_grad_norm_``/``clip_grad_value_`` call first), only
      without a GradScaler: on a step boundary the guards measure the gradients before the caller
      clips (with one, accelerate's own ``scaler.unscale_`` already reaches the guard).
    - ``prepare_scheduler()`` (what ``prepare`` calls for a scheduler): a scheduler prepared after ``wrap`` is
      handed to the guard like one prepared before (:func:`_hold`).
    - ``save_state()``: refused (``CheckpointError``) before anything is written, or rotated out,
      when a guard's state holds a NaN/Inf (``integrity.refuse_unhealthy``). Under FSDP it saves the
      inner optimizers and each guard's own state per rank; ``load_state()`` reads them back
      (:func:`save_fsdp`, :func:`load_fsdp`)."""

    _ATTR = "_ampguard_hooks"

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.guards: list[weakref.ref[GuardedOptimizer]] = []
        """The guards on this Accelerator, held weakly: the patched methods live as long as the Accelerator, and a
        guard they held was never collected after ``accelerator.free_memory()`` (accelerate's way between runs, and
        ``find_executable_batch_size``'s between tries): it went on observing every loss, its hooks stayed on the
        model, and the last ``close()`` of the guards after it left the methods patched. A collected guard leaves
        (:meth:`_forget`)."""
        self.held: list[tuple[weakref.ref[GuardedOptimizer], weakref.ref[Any]]] = []
        """``(guard, AcceleratedScheduler)`` of each scheduler a guard steps (:func:`_hold`), both weakly: a held
        scheduler holds its guard (``scheduler.optimizers``)."""
        names = ("backward", "save_state", "load_state", "clip_grad_norm_", "prepare_scheduler") + (
            () if accelerator.scaler is not None else ("unscale_gradients",))
        self.previous = {name: accelerator.__dict__.get(name) for name in names}
        backward_, unscale_gradients_, save_state_, load_state_, clip_grad_norm_, prepare_scheduler_ = (
            self.previous.get(n) or types.MethodType(getattr(Accelerator, n), accelerator)
            for n in ("backward", "unscale_gradients", "save_state", "load_state", "clip_grad_norm_",
                      "prepare_scheduler"))

        def save_state(*args: Any, **kwargs: Any) -> Any:
            # Before accelerate touches the disk (it rotates old checkpoints out first): a state with a
            # NaN/Inf is refused, and the last good checkpoint stays (docs/integrity.md).
            for guard in self.open_guards():
                refuse_unhealthy(guard._verdict(fingerprints=False), "accelerator.save_state refused")
            if accelerator.distributed_type != DistributedType.FSDP:
                return save_state_(*args, **kwargs)
            return self._save_fsdp(save_state_, *args, **kwargs)

        def load_state(*args: Any, **kwargs: Any) -> Any:
            if accelerator.distributed_type != DistributedType.FSDP:
                return load_state_(*args, **kwargs)
            return self._load_fsdp(load_state_, *args, **kwargs)

        def backward(loss: Any, **kwargs: Any) -> Any:
            result = backward_(loss, **kwargs)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                steps = accelerator.gradient_accumulation_steps  # what accelerate back-propagated: loss / steps
                micro = loss.detach() if steps == 1 else loss.detach() / steps  # x / 1 is x: no kernel for it
                for guard in self.open_guards():
                    guard.observe_loss(micro, reduction="sum")
            return result

        def unscale_gradients(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None) -> Any:
            if accelerator.sync_gradients:
                chosen = accelerator._optimizers if optimizer is None else optimizer
                chosen = chosen if isinstance(chosen, (list, tuple)) else [chosen]
                for guard in self.open_guards():
                    if any(o is guard or getattr(o, "optimizer", None) is guard for o in chosen):
                        guard.unscale_()
            return unscale_gradients_(optimizer)

        def clip(parameters: Any, max_norm: float, norm_type: float = 2, **kwargs: Any) -> Any:
            # On a step boundary, the parameters of one guard: the guard's clip (on the fused fast
            # path folded into its step: no unscale_, no pass over the gradients here).
            # Frozen parameters do not count (the Trainer passes model.parameters()).
            # max_norm=inf (transformers 5's norm for its log, every step, with max_grad_norm=0) too: the guard's
            # measurement, no clip, where accelerate would unscale, take the norm and multiply by 1 (three passes).
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            if accelerator.sync_gradients and not kwargs and max_norm > 0:
                ids = {id(p) for p in params if p.requires_grad}
                for guard in self.open_guards():
                    if ids == guard._pipeline.param_ids():
                        return guard.clip_grad_norm_(max_norm, norm_type, parameters=params)
            return clip_grad_norm_(params, max_norm, norm_type, **kwargs)

        def prepare_scheduler(scheduler: Any) -> Any:
            prepared = prepare_scheduler_(scheduler)
            for _, wrapped in self._guarded_places():
                self.hold(prepared, wrapped)
            return prepared

        accelerator.prepare_scheduler = prepare_scheduler  # type: ignore[method-assign]
        accelerator.backward = backward  # type: ignore[method-assign]
        accelerator.save_state = save_state  # type: ignore[method-assign]
        accelerator.load_state = load_state  # type: ignore[method-assign]
        accelerator.clip_grad_norm_ = clip  # type: ignore[method-assign]
        if "unscale_gradients" in names:
            accelerator.unscale_gradients = unscale_gradients  # type: ignore[method-assign]

    def hold(self, scheduler: Any, wrapped: GuardedAcceleratedOptimizer) -> None:
        """Hand ``scheduler`` to ``wrapped``'s guard where it can be (:func:`_hold`)."""
        if _hold(scheduler, wrapped):
            self.held.append((weakref.ref(wrapped.optimizer), weakref.ref(scheduler)))

    def open_guards(self) -> list[GuardedOptimizer]:
        return [g for g in (ref() for ref in self.guards) if g is not None and not g._closed]

    def _guarded_places(self) -> list[tuple[int, GuardedAcceleratedOptimizer]]:
        """``(index in accelerator._optimizers, wrapper)`` of each open guard: the index accelerate
        names its optimizer files by."""
        guards = self.open_guards()
        return [(i, o) for i, o in enumerate(self.accelerator._optimizers)
                if isinstance(o, GuardedAcceleratedOptimizer) and any(o.optimizer is g for g in guards)]

    def _save_fsdp(self, save_state_: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """accelerate's ``save_state`` under FSDP (:func:`save_fsdp`), into the folder it returns."""
        return save_fsdp(self.accelerator, self._guarded_places(), lambda: save_state_(*args, **kwargs))

    def _load_fsdp(self, load_state_: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """accelerate's ``load_state`` under FSDP (:func:`load_fsdp`), from the folder it loaded (its load
        pre-hook names it)."""
        folder: list[str] = []
        handle = self.accelerator.register_load_state_pre_hook(lambda _models, input_dir: folder.append(input_dir))
        try:
            return load_fsdp(self.accelerator, self._guarded_places(), lambda: load_state_(*args, **kwargs),
                             lambda: folder[-1], "accelerator.load_state")
        finally:
            handle.remove()

    @classmethod
    def add(cls, accelerator: Accelerator, guard: GuardedOptimizer) -> _AcceleratorHooks:
        hooks = accelerator.__dict__.get(cls._ATTR)
        if hooks is None:
            hooks = cls(accelerator)
            setattr(accelerator, cls._ATTR, hooks)
        hooks.guards.append(weakref.ref(guard))
        weakref.finalize(guard, hooks._forget).atexit = False
        return hooks  # type: ignore[no-any-return]

    def remove(self, guard: GuardedOptimizer) -> None:
        """``guard`` leaves (its wrapper's ``close()``); the last to leave restores the Accelerator's methods."""
        self._leave(lambda g: g is guard)

    def _forget(self) -> None:
        """A guard was collected (its finalizer): it leaves as :meth:`remove` has it."""
        self._leave(lambda g: False)

    def _leave(self, leaving: Callable[[GuardedOptimizer], bool]) -> None:
        """The guards ``leaving`` names leave, and those collected: the schedulers they held get accelerate's own
        methods back, and the last to leave restores the Accelerator's."""
        def gone(ref: weakref.ref[GuardedOptimizer]) -> bool:
            g = ref()
            return g is None or leaving(g)

        for ref, scheduler_ref in self.held:
            scheduler = scheduler_ref()
            if gone(ref) and scheduler is not None:
                for name in _HELD:
                    scheduler.__dict__.pop(name, None)
        self.held = [(ref, s) for ref, s in self.held if not gone(ref) and s() is not None]
        self.guards = [ref for ref in self.guards if not gone(ref)]
        acc = self.accelerator
        if self.guards or acc.__dict__.get(self._ATTR) is not self:
            return
        for name, previous in self.previous.items():
            if previous is None:
                acc.__dict__.pop(name, None)
            else:
                setattr(acc, name, previous)
        del acc.__dict__[self._ATTR]


# ---------------------------------------------------------------------------------------- FSDP checkpoints
@contextlib.contextmanager
def inner_in_place(places: Sequence[tuple[int, GuardedAcceleratedOptimizer]]) -> Iterator[None]:
    """While a framework saves or loads under FSDP, each wrapper in ``places`` (``(index, wrapper)``) holds
    its guard's inner optimizer: torch's FSDP state-dict functions (``get_optimizer_state_dict``,
    ``FSDP.optim_state_dict``) read a plain optimizer's ``state_dict`` (``state`` and ``param_groups`` at the
    top; the guard's nests them) and initialise an empty state by calling ``step()``, which a guard would
    count as a step (or refuse, in fp16). The guards are put back whatever happens."""
    guards = [w.optimizer for _, w in places]
    try:
        for _, w in places:
            w.optimizer = w.optimizer.optimizer  # type: ignore[assignment]
        yield
    finally:
        for (_, w), g in zip(places, guards):
            w.optimizer = g


def _guard_file(accelerator: Accelerator, index: int) -> str:
    return f"ampguard_{index}_rank{accelerator.process_index}.pt"


def save_fsdp(accelerator: Accelerator, places: Sequence[tuple[int, GuardedAcceleratedOptimizer]],
              save: Callable[[], Any], folder: str | None = None) -> Any:
    """A framework's FSDP save (``save``) with the guards of ``places`` (``(index, wrapper)``): each guard's own
    state (``GuardedOptimizer._state_without_optimizer()``: the loss scale, counters, detectors, quarantine, the
    verdict) taken before anything is written; ``save`` run with the inner optimizers in place
    (:func:`inner_in_place`); then the states in this rank's files ``ampguard_<index>_rank<r>.pt`` of ``folder``
    (None: the folder ``save`` returned) and a barrier: the checkpoint is whole, every rank's file in it, when this
    returns. Returns what ``save`` returned. collective."""
    states = [(i, w.optimizer._state_without_optimizer()) for i, w in places]
    with inner_in_place(places):
        result = save()
    for i, state in states:
        torch.save(state, os.path.join(result if folder is None else folder, _guard_file(accelerator, i)))
    accelerator.wait_for_everyone()
    return result


def load_fsdp(accelerator: Accelerator, places: Sequence[tuple[int, GuardedAcceleratedOptimizer]],
              load: Callable[[], Any], folder: Callable[[], str], caller: str) -> Any:
    """A framework's FSDP load (``load``, which loads the model and the inner optimizers in place) with the inner
    optimizers in place (:func:`inner_in_place`), then each guard's state from this rank's file in ``folder()``
    (asked after ``load``), checked and agreed by every rank before any guard is restored
    (:func:`~ampguard.integrations._resume.restore_agreed`: one rank's refusal is every rank's; a folder without
    guard files, an unguarded run's, leaves the guards' own state, with a warning). Returns what ``load``
    returned. collective."""
    with inner_in_place(places):
        result = load()
    where = folder()
    saved: list[tuple[GuardedOptimizer, Any]] = []
    for i, w in places:
        path = os.path.join(where, _guard_file(accelerator, i))
        # plain values only: no code runs
        saved.append((w.optimizer, torch.load(path, weights_only=True) if os.path.exists(path) else None))
    restore_agreed(saved, where, caller)
    return result
