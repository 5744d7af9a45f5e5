"""ampguard inside Hugging Face accelerate.

Guard the optimizer that ``accelerator.prepare`` returned; the training loop stays accelerate's::

    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    optimizer = ampguard.wrap(optimizer, model=model)   # the one added line

:func:`wrap_prepared` (what ``ampguard.wrap`` calls for an ``AcceleratedOptimizer``) puts a
:class:`~ampguard.GuardedOptimizer` inside the ``AcceleratedOptimizer`` and turns that same object
into a :class:`GuardedAcceleratedOptimizer`, so ``accelerator._optimizers``, the
``AcceleratedScheduler`` and ``save_state``/``load_state``, which hold it, see the guard:

- ``optimizer.step()`` runs the guarded step on accumulation boundaries
  (``accelerator.sync_gradients``) and does nothing on the other micro-steps. The guard unscales
  with the accelerator's own ``GradScaler`` (shared: ``accelerator.backward`` scales with it),
  decides, steps or skips, and sets the next loss scale itself.
- ``optimizer.step_was_skipped`` (so ``accelerator.optimizer_step_was_skipped``) is the guard's:
  the ``AcceleratedScheduler`` holds the learning rate exactly on the skipped steps.
- ``accelerator.clip_grad_norm_`` unscales through the guard first (``scaler.unscale_`` is the
  guard's ``unscale_``): clipping sees unscaled gradients and the report's ``grad_norm`` is the
  norm before clipping. Clipping on a micro-step that does not step is refused.
- ``state_dict``/``load_state_dict`` are the guard's: ``accelerator.save_state``/``load_state``
  carry the guard's counters with the optimizer.
- The guard's readers (``last_report``, ``history``, ``anomalies``, ``skipped_steps``,
  ``step_count``, ``flush``, ``close``, ...) are reachable on the returned object;
  ``optimizer.guard`` is the :class:`~ampguard.GuardedOptimizer`.

The reported loss: the integration observes every ``accelerator.backward(loss)`` of the
Accelerator that prepared the optimizer (it wraps that instance's ``backward``; ``close()`` undoes
it) and records ``loss / gradient_accumulation_steps``, what accelerate back-propagates, summed
over the step's micro-batches: the loss of the optimizer step (for equal micro-batches, the mean
of their losses). With several optimizers on one Accelerator each guard sees every backward.

Wrapping before ``prepare`` (``accelerator.prepare(ampguard.wrap(optimizer, ...))``): accelerate
reads ``_is_accelerate_prepared`` of the optimizer before it builds anything, and the guard answers
through :func:`on_prepare`: when the guard's scaler is the accelerator's (or neither has one) and
the precisions agree, the ``AcceleratedOptimizer`` is adopted, as :func:`wrap_prepared` would have
built it, before the first step's gradients are read; otherwise ``prepare`` raises
:class:`~ampguard.GuardStateError` naming the order to use, before the optimizer is prepared.
"""

from __future__ import annotations

import gc
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import GuardStateError
from ..guard import GuardedOptimizer
from ..vocab import Precision
from ._versions import require

require("accelerate")

from accelerate import Accelerator  # noqa: E402  (after the version check)
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import GradientState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["GuardedAcceleratedOptimizer", "on_prepare", "wrap_prepared"]

_ORDER = "optimizer = ampguard.wrap(accelerator.prepare(optimizer), model=model)"
_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


class GuardedAcceleratedOptimizer(AcceleratedOptimizer):
    """An ``AcceleratedOptimizer`` whose inner optimizer is a :class:`~ampguard.GuardedOptimizer`.
    Made by :func:`wrap_prepared`, which re-classes the prepared object in place. Public names it
    does not have are the guard's (``last_report``, ``history``, ``flush``, ...)."""

    optimizer: GuardedOptimizer

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

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def close(self) -> None:
        """The guard's ``close()``; also stops observing ``accelerator.backward``. Idempotent."""
        try:
            self.optimizer.close()
        finally:
            _AcceleratorHooks.remove(self.optimizer)

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


def wrap_prepared(
    acc_opt: Any,
    *,
    model: torch.nn.Module | None = None,
    scaler: torch.amp.GradScaler | None = None,
    precision: Precision = "auto",
    config: Any = None,
    exporters: Sequence[Any] = (),
    backend: Any = None,
    on_rollback: Callable[[Any, int], None] | None = None,
    on_abort: Callable[[Any, str], None] | None = None,
) -> GuardedAcceleratedOptimizer:
    """Guard the optimizer inside ``acc_opt`` (what ``accelerator.prepare`` returned) with the
    accelerator's own scaler and precision; re-class ``acc_opt`` in place and return it.

    ``scaler``: leave it out (or pass ``accelerator.scaler``): the guard shares the accelerator's.
    ``precision``: "auto" takes the accelerator's (fp16 with its GradScaler, bf16, or fp32 for
    ``mixed_precision="no"``); another value must agree with it. The other arguments are
    :func:`ampguard.wrap`'s. Raises (before anything changes) ``GuardStateError`` when ``acc_opt``
    is already guarded, ``ValueError`` on a scaler or precision that disagrees with the
    accelerator's, ``NotImplementedError`` under DeepSpeed, Megatron-LM or XLA, and
    ``IntegrationVersionError`` outside the tested accelerate versions.
    """
    from ..factory import wrap

    require("accelerate")
    if not isinstance(acc_opt, AcceleratedOptimizer):
        raise TypeError(f"wrap_prepared() expects what accelerator.prepare() returned, got {type(acc_opt).__name__}")
    if isinstance(acc_opt, GuardedAcceleratedOptimizer):
        raise GuardStateError("this optimizer is already guarded: ampguard.wrap() returned it. Wrap once, after "
                              f"prepare: `{_ORDER}` (opt.guard is the GuardedOptimizer). Nothing was changed.")
    if isinstance(acc_opt.optimizer, GuardedOptimizer):
        raise GuardStateError("the optimizer inside this AcceleratedOptimizer is already guarded (ampguard.wrap() "
                              f"before accelerator.prepare()). Wrap once: `{_ORDER}`. Nothing was changed.")
    state = acc_opt.accelerator_state
    _check_supported(state.distributed_type)
    acc_scaler = acc_opt.scaler
    if scaler is not None and scaler is not acc_scaler:
        raise ValueError("scaler= is not the accelerator's GradScaler: accelerator.backward() scales with "
                         "accelerator.scaler, so the guard must share it. Leave scaler= out. Nothing was changed.")
    resolved = _accelerator_precision(acc_scaler, state.mixed_precision)
    if precision not in ("auto", resolved):
        raise ValueError(f"precision={precision!r}, but the accelerator runs {_describe(acc_scaler, state)}, which "
                         f"is {resolved!r} for the guard. Leave precision= out ('auto'), or change "
                         "Accelerator(mixed_precision=...). Nothing was changed.")
    guard = wrap(acc_opt.optimizer, model=model, scaler=acc_scaler, precision=resolved, config=config,
                 exporters=exporters, backend=backend, on_rollback=on_rollback, on_abort=on_abort)
    accelerator = _find_accelerator(acc_opt)
    if accelerator is None:
        warnings.warn("ampguard: no Accelerator holds this optimizer, so accelerator.backward() is not observed "
                      "and the reported loss is unknown (None); call opt.observe_loss(loss) per micro-batch to "
                      "report it",
                      RuntimeWarning, stacklevel=3)
    _hook(guard, accelerator, adopt=False)
    acc_opt.optimizer = guard
    acc_opt.__class__ = GuardedAcceleratedOptimizer
    return acc_opt  # type: ignore[no-any-return]


def on_prepare(guard: GuardedOptimizer, frame: types.FrameType | None) -> None:
    """accelerate's ``prepare_optimizer`` is about to wrap ``guard`` (``frame`` is the frame that
    read ``guard._is_accelerate_prepared``; anything else reading it changes nothing). Raise
    :class:`GuardStateError` when the guard cannot run inside this accelerator; otherwise arrange
    for the ``AcceleratedOptimizer`` about to be built to be adopted before the first step's
    gradients are read."""
    accelerator = frame.f_locals.get("self") if frame is not None else None
    if not isinstance(accelerator, Accelerator) or frame is None or frame.f_locals.get("optimizer") is not guard:
        return
    if any(o.optimizer is guard for o in accelerator._optimizers):
        raise GuardStateError(f"this guard is already inside a prepared optimizer; prepare once: `{_ORDER}`. "
                              "Nothing was changed.")
    state = accelerator.state
    _check_supported(state.distributed_type)
    problem = None
    if guard.scaler is not accelerator.scaler:
        problem = ("the guard's GradScaler is not the accelerator's: accelerator.backward() would scale with one and "
                   "the guard unscale with the other")
    elif guard.precision != _accelerator_precision(accelerator.scaler, state.mixed_precision):
        problem = f"the guard runs {guard.precision!r} and the accelerator {_describe(accelerator.scaler, state)}"
    if problem is not None:
        raise GuardStateError(f"accelerator.prepare() of an optimizer that ampguard.wrap() guarded before: {problem}. "
                              f"Guard after prepare, with the accelerator's scaler and precision: `{_ORDER}`. "
                              "Nothing was changed.")
    _hook(guard, accelerator, adopt=True)


# ---------------------------------------------------------------------------------------- internals
def _check_supported(distributed_type: Any) -> None:
    if distributed_type in _UNSUPPORTED:
        raise NotImplementedError(f"ampguard's accelerate integration does not support {distributed_type}: its "
                                  "backward, loss scaling and step are not accelerate's AcceleratedOptimizer's")


def _accelerator_precision(scaler: Any, mixed_precision: str) -> Precision:
    """The guard's precision for what accelerate runs: fp16 only with a GradScaler (accelerate
    builds none, and no fp16 autocast, on CPU: that trains in fp32)."""
    if scaler is not None:
        return "fp16"
    return "bf16" if mixed_precision in ("bf16", "fp8") else "fp32"


def _describe(scaler: Any, state: Any) -> str:
    return f"mixed_precision={state.mixed_precision!r} {'with' if scaler is not None else 'without'} a GradScaler"


def _find_accelerator(acc_opt: AcceleratedOptimizer) -> Accelerator | None:
    """The Accelerator whose ``_optimizers`` list holds ``acc_opt`` (accelerate keeps no other
    link). Three passes over the garbage collector's objects, once per wrap."""
    lists = [r for r in gc.get_referrers(acc_opt) if isinstance(r, list)]
    if not lists:
        return None
    owners = gc.get_referrers(*lists)
    for owner in owners:
        if isinstance(owner, Accelerator) and any(owner._optimizers is lst for lst in lists):
            return owner
    dicts = [o for o in owners if isinstance(o, dict) and any(o.get("_optimizers") is lst for lst in lists)]
    if dicts:
        for owner in gc.get_referrers(*dicts):
            if isinstance(owner, Accelerator) and any(owner.__dict__ is d for d in dicts):
                return owner
    return None


def _hook(guard: GuardedOptimizer, accelerator: Accelerator | None, *, adopt: bool) -> None:
    """What both ways in share: the scaler routes accelerate's own ``scaler.step``/``update``
    calls to the guard (AcceleratedOptimizer's, until adopted), every ``accelerator.backward``
    reports its loss, and a pre-unscale hook refuses unscaling on a micro-step that does not step.
    ``adopt``: the guard was made before ``prepare``; the hook re-classes the AcceleratedOptimizer
    it sits in, the first time the gradients are read (``unscale_`` or ``step``)."""
    if guard._scaler is not None:
        guard._scaler.route_steps = True
    gradient_state = GradientState()
    pending = [accelerator] if adopt and accelerator is not None else []

    def before_unscale(step: int) -> None:
        if not gradient_state.sync_gradients:
            raise GuardStateError(
                "the gradients were unscaled (accelerator.clip_grad_norm_/unscale_gradients) on a micro-step that "
                "does not step (accelerator.sync_gradients is False): the next backward would add scaled gradients "
                "to unscaled ones. Clip only on the step: `if accelerator.sync_gradients: "
                "accelerator.clip_grad_norm_(...)`. Nothing was changed.")
        if pending:
            for acc_opt in pending.pop()._optimizers:
                if acc_opt.optimizer is guard and type(acc_opt) is AcceleratedOptimizer:
                    acc_opt.__class__ = GuardedAcceleratedOptimizer

    guard.register_pre_unscale_hook(before_unscale)
    if accelerator is not None:
        _AcceleratorHooks.add(accelerator, guard)


class _AcceleratorHooks:
    """Instance patches on one Accelerator (nothing global; undone when its last guard closes):

    - ``backward(loss)``: hands each loss, as accelerate back-propagates it, to the guards.
    - ``unscale_gradients()`` (what ``clip_grad_norm_``/``clip_grad_value_`` call first): on a step
      boundary, the guards measure the gradients (and, in fp16, unscale them) before the caller
      clips, in every precision (accelerate itself unscales only in fp16)."""

    _ATTR = "_ampguard_hooks"

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.guards: list[GuardedOptimizer] = []
        self.previous = {name: accelerator.__dict__.get(name) for name in ("backward", "unscale_gradients")}
        backward_, unscale_gradients_ = (self.previous[n] or types.MethodType(getattr(Accelerator, n), accelerator)
                                         for n in ("backward", "unscale_gradients"))

        def backward(loss: Any, **kwargs: Any) -> Any:
            result = backward_(loss, **kwargs)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                micro = loss.detach() / accelerator.gradient_accumulation_steps  # what accelerate back-propagated
                for guard in self.open_guards():
                    guard.observe_loss(micro, reduction="sum")
            return result

        def unscale_gradients(optimizer: Any = None) -> Any:
            if accelerator.sync_gradients:
                chosen = accelerator._optimizers if optimizer is None else optimizer
                chosen = chosen if isinstance(chosen, (list, tuple)) else [chosen]
                for guard in self.open_guards():
                    if any(o is guard or getattr(o, "optimizer", None) is guard for o in chosen):
                        guard.unscale_()
            return unscale_gradients_(optimizer)

        accelerator.backward = backward  # type: ignore[method-assign]
        accelerator.unscale_gradients = unscale_gradients  # type: ignore[method-assign]

    def open_guards(self) -> list[GuardedOptimizer]:
        return [g for g in self.guards if not g._closed]

    @classmethod
    def add(cls, accelerator: Accelerator, guard: GuardedOptimizer) -> None:
        hooks = accelerator.__dict__.get(cls._ATTR)
        if hooks is None:
            hooks = cls(accelerator)
            setattr(accelerator, cls._ATTR, hooks)
        hooks.guards.append(guard)
        _OBSERVED[guard] = hooks

    @classmethod
    def remove(cls, guard: GuardedOptimizer) -> None:
        hooks = _OBSERVED.pop(guard, None)
        if hooks is None:
            return
        hooks.guards = [g for g in hooks.guards if g is not guard]
        if not hooks.guards:
            acc = hooks.accelerator
            for name, previous in hooks.previous.items():
                if previous is None:
                    acc.__dict__.pop(name, None)
                else:
                    setattr(acc, name, previous)
            acc.__dict__.pop(cls._ATTR, None)


_OBSERVED: weakref.WeakKeyDictionary[GuardedOptimizer, _AcceleratorHooks] = weakref.WeakKeyDictionary()
"""guard -> the hooks of the Accelerator it is in (until close)."""
