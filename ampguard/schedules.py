"""Skip-aware LR schedules, with no host sync.

A skipped step must not advance an LR schedule or an average of the weights. Learning whether
a step was skipped costs a host sync on the sync-free path (fused optimizer on CUDA), so:

- **Schedulers** registered with :meth:`GuardedOptimizer.schedule` are stepped by the guard,
  once per *taken* step, at the guard's fixed points (:func:`ampguard.actions.carry_out`),
  where the step's report has been decoded anyway. Where the step synchronised or decides on
  the host (CPU; non-fused optimizers on CUDA), that is right after the step. On the sync-free
  path step N's report is decoded at the start of step N+1's ``step()``, before its inner
  update reads the LR: the LR every update sees is the eager loop's, bitwise. The advance
  counts taken steps (``history.steps_reported - skipped_total``) against those already applied, so
  readers that decode early (``last_report``...) change nothing.
- **EMA** (:class:`ampguard.ema.EMA`) is updated inside ``step()``, right after the inner step,
  on device (see :mod:`ampguard.ema`).

See ``docs/schedules.md``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .ema import EMA
from .errors import GuardStateError

__all__ = ["Schedules"]

_LRScheduler = torch.optim.lr_scheduler.LRScheduler


class Schedules:
    """The guard's registered schedulers and EMAs (one per guard, :attr:`GuardedOptimizer._schedules`)."""

    def __init__(self) -> None:
        self.schedulers: list[_LRScheduler] = []
        self.emas: list[EMA] = []
        self.applied = 0
        """Taken steps the schedulers have been stepped for."""

    @staticmethod
    def taken(guard: Any) -> int:
        """Taken steps among the decoded reports (no decode here)."""
        rep = guard._reporter
        return rep.history.steps_reported - rep.skipped_total  # type: ignore[no-any-return]

    def advance(self, guard: Any) -> None:
        """Step every scheduler once per taken step decoded since the last call. Decodes nothing:
        the caller has (a fixed point, ``flush()``, ``state_dict()``)."""
        taken = self.taken(guard)
        while self.applied < taken:
            for scheduler in self.schedulers:
                _base(scheduler).step(scheduler)  # the scheduler's own step (a user's call is refused)
            self.applied += 1
        if self.applied > taken:  # cannot happen through the guard's calls; never step backwards
            self.applied = taken

    def resync(self, guard: Any) -> None:
        """After a restore: the schedulers' own state is the truth (see ``docs/schedules.md``)."""
        self.applied = self.taken(guard)

    def state(self) -> dict[str, Any]:
        """The registered schedulers' and EMAs' state (for the ladder's snapshot; not copied here).
        Each entry keeps its object, so a scheduler or EMA registered later is left alone."""
        return {"schedulers": [(s, _base(s).state_dict(s)) for s in self.schedulers],
                "emas": [(e, e.state_dict()) for e in self.emas]}

    def restore(self, state: dict[str, Any], guard: Any) -> None:
        """A ladder rollback: put back :meth:`state`'s values, then count taken steps from here
        (the rolled-back steps stay in the history, but their advance is undone)."""
        for scheduler, sd in state["schedulers"]:
            if any(scheduler is s for s in self.schedulers):
                _base(scheduler).load_state_dict(scheduler, sd)
        for ema, sd in state["emas"]:
            if any(ema is e for e in self.emas):
                ema.load_state_dict(sd)
        self.resync(guard)

    def add_scheduler(self, guard: Any, scheduler: Any) -> None:
        _check_scheduler(guard, scheduler)
        guard._reporter.decode()  # registering waits for pending reports (once, not per step)
        self.advance(guard)  # the schedulers already registered catch up; the new one starts now
        cls = type(scheduler)
        scheduler.__class__ = _scheduled_class(cls)
        _OWNERS[scheduler] = weakref.ref(guard)
        self.schedulers.append(scheduler)

    def add_ema(self, guard: Any, ema: EMA) -> None:
        if not isinstance(ema, EMA):
            raise TypeError(f"track_ema() expects an ampguard.EMA, got {type(ema).__name__}")
        if any(e is ema for e in self.emas):
            raise ValueError("this EMA is already tracked by this guard")
        ours = {id(p) for group in guard.optimizer.param_groups for p in group["params"]}
        if ema._params and not any(id(p) in ours for p in ema._params):
            raise ValueError("the EMA averages parameters of which none is in this guard's optimizer: was it built "
                             "on another model? Nothing was changed.")
        self.emas.append(ema)

    def update_emas(self, skip: torch.Tensor, host_skip: bool | None) -> None:
        for ema in self.emas:
            ema.update(skip if host_skip is None else host_skip)

    def release(self) -> None:
        """Hand the schedulers their own class back (``close()``)."""
        for scheduler in self.schedulers:
            scheduler.__class__ = _base(scheduler)
            _OWNERS.pop(scheduler, None)
        self.schedulers.clear()


# ---------------------------------------------------------------------- the scheduler's class
_OWNERS: weakref.WeakKeyDictionary[Any, weakref.ReferenceType[Any]] = weakref.WeakKeyDictionary()
_CLASSES: dict[type, type] = {}


def _base(scheduler: Any) -> Any:
    cls = type(scheduler)
    return cls.__mro__[1] if getattr(cls, "_ampguard_scheduled", False) else cls


def _scheduled_step(self: Any, *args: Any, **kwargs: Any) -> None:
    raise GuardStateError(
        f"{type(self).__name__}.step() called on a scheduler registered with opt.schedule(): the guard steps it "
        "itself, once per taken optimizer step (skipped steps hold the LR). Remove your scheduler.step() call. "
        "Nothing was changed.")


def _scheduled_state_dict(self: Any) -> dict[str, Any]:
    """The scheduler's own state_dict, after any advance still pending (a decoded taken step),
    so it can be saved before or after ``opt.state_dict()``. Waits for pending reports."""
    ref = _OWNERS.get(self)
    guard = ref() if ref is not None else None
    if guard is not None and not guard._closed:
        guard._reporter.decode()
        guard._schedules.advance(guard)
    return _base(self).state_dict(self)  # type: ignore[no-any-return]


def _scheduled_reduce_ex(self: Any, protocol: Any) -> Any:
    """Pickled (and deep-copied) as the scheduler's own class: a copy is not registered."""
    return _rebuild, (_base(self), dict(self.__dict__))


def _rebuild(cls: Any, state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _scheduled_class(cls: type) -> type:
    """``cls`` whose ``step()`` is refused and whose ``state_dict()`` applies a pending advance.
    A class change, not instance attributes: ``LRScheduler.state_dict`` saves ``__dict__``."""
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = _CLASSES[cls] = type(cls.__name__, (cls,), {
            "step": _scheduled_step, "state_dict": _scheduled_state_dict, "__reduce_ex__": _scheduled_reduce_ex,
            "_ampguard_scheduled": True,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        })
    return sub


def _check_scheduler(guard: Any, scheduler: Any) -> None:
    if not isinstance(scheduler, _LRScheduler):
        raise TypeError(f"schedule() expects a torch.optim.lr_scheduler.LRScheduler, got {type(scheduler).__name__}")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError("ReduceLROnPlateau steps on a metric the guard does not have: keep calling its "
                        "step(metric) yourself (it is per epoch/eval, not per optimizer step)")
    if getattr(type(scheduler), "_ampguard_scheduled", False):
        raise ValueError("this scheduler is already registered with opt.schedule()")
    target = getattr(scheduler, "optimizer", None)
    if target is None or getattr(target, "param_groups", None) is not guard.optimizer.param_groups:
        raise ValueError("the scheduler was built on another optimizer: build it on the guard (or the optimizer it "
                         "wraps) before opt.schedule(scheduler)")
