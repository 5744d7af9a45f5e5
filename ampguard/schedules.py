"""Skip-aware LR schedules, with no host sync.

A skipped step must not advance an LR schedule or an average of the weights. Learning whether
a step was skipped costs a host sync on the sync-free path (fused optimizer on CUDA), so:

- **Schedulers** registered with :meth:`GuardedOptimizer.schedule` are stepped by the guard,
  once per *taken* step, at the guard's fixed points (:meth:`ampguard.outcome.Outcome.settle`),
  where the step's report has been decoded anyway, or its payload read while it waits for its batch (a healthy
  step, so a taken one). Where the step synchronised or decides on
  the host (CPU; non-fused optimizers on CUDA), that is right after the step. On the sync-free
  path a registered scheduler keeps the guard's report lag at one step (without one, reports are
  decoded two steps late: ``GuardedOptimizer._report_lag``): step N's report is decoded at the
  start of step N+1's ``step()``, before its inner update reads the LR: the LR every update
  sees is the eager loop's, bitwise. The advance counts taken steps
  (``history.steps_reported - skipped_total``) against those already applied, so readers
  that decode early (``last_report``...) change nothing.
- ``opt.schedule(scheduler)`` returns a :class:`ScheduledLR`, a wrapper the loop keeps in place
  of the scheduler: its ``step()`` is refused (the guard steps the scheduler) and its
  ``state_dict()`` applies a pending advance first. The scheduler itself is left as it was (no
  class change, nothing patched), and nothing here is process-wide.
- **EMA** (:class:`ampguard.ema.EMA`) is updated inside ``step()``, right after the inner step,
  on device (see :mod:`ampguard.ema`).

See ``docs/schedules.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .ema import EMA
from .errors import GuardStateError
from .records import History
from .stats import Dec

__all__ = ["Records", "ScheduledLR", "Schedules"]

_LRScheduler = torch.optim.lr_scheduler.LRScheduler


class Records(Protocol):
    """What the schedules read of the guard's records (:class:`ampguard.reporter.Reporter`)."""

    history: History
    skipped_total: int

    @property
    def taken_waiting(self) -> int: ...

    def decode(self) -> None: ...


class Schedules:
    """The guard's registered schedulers and EMAs (one per guard, held by its
    :class:`~ampguard.outcome.Outcome`)."""

    def __init__(self, records: Records) -> None:
        self.records = records
        self.schedulers: list[ScheduledLR] = []
        self.emas: list[EMA] = []
        self.applied = 0
        """Taken steps the schedulers have been stepped for."""

    @property
    def taken(self) -> int:
        """Taken steps among the decoded reports and the healthy ones waiting for their batch (read already: a
        healthy step is a taken one; :meth:`ampguard.reporter.Reporter.quiet`). No decode here."""
        records = self.records
        return records.history.steps_reported - records.skipped_total + records.taken_waiting

    def advance(self) -> None:
        """Step every scheduler once per taken step decoded since the last call. Decodes nothing:
        the caller has (a fixed point, ``flush()``, ``state_dict()``)."""
        taken = self.taken
        while self.applied < taken:
            for wrapper in self.schedulers:
                wrapper.advance()  # the scheduler's own step (the wrapper's is refused)
            self.applied += 1
        if self.applied > taken:  # cannot happen through the guard's calls; never step backwards
            self.applied = taken

    def catch_up(self) -> None:
        """Decode what has arrived, then :meth:`advance` (a registered scheduler's ``state_dict()``)."""
        self.records.decode()
        self.advance()

    def resync(self) -> None:
        """After a restore: the schedulers' own state is the truth (see ``docs/schedules.md``)."""
        self.applied = self.taken

    def state(self) -> dict[str, Any]:
        """The registered schedulers' and EMAs' state (for the ladder's snapshot; not copied here).
        Each entry keeps its object, so a scheduler or EMA registered later is left alone."""
        return {"schedulers": [(w.scheduler, w.scheduler.state_dict()) for w in self.schedulers],
                "emas": [(e, e.state_dict()) for e in self.emas]}

    def restore(self, state: dict[str, Any]) -> None:
        """A ladder rollback: put back :meth:`state`'s values, then count taken steps from here
        (the rolled-back steps stay in the history, but their advance is undone)."""
        for scheduler, sd in state["schedulers"]:
            if any(scheduler is w.scheduler for w in self.schedulers):
                scheduler.load_state_dict(sd)
        for ema, sd in state["emas"]:
            if any(ema is e for e in self.emas):
                ema.load_state_dict(sd)
        self.resync()

    def add_scheduler(self, optimizer: torch.optim.Optimizer, scheduler: _LRScheduler,
                      advance: Callable[[], None] | None = None) -> ScheduledLR:
        """Register ``scheduler`` (built on ``optimizer``, the guard's inner optimizer, or the guard).
        ``advance``: what one taken step does to it (default: its own ``step()``; accelerate's
        ``AcceleratedScheduler`` steps it once per process, :mod:`ampguard.integrations.accelerate`)."""
        self._check_scheduler(optimizer, scheduler)
        self.catch_up()  # registering waits for pending reports (once, not per step); the others catch up
        wrapper = ScheduledLR(scheduler, self, advance)
        self.schedulers.append(wrapper)
        return wrapper

    def add_ema(self, optimizer: torch.optim.Optimizer, ema: EMA) -> None:
        if not isinstance(ema, EMA):
            raise TypeError(f"track_ema() expects an ampguard.EMA, got {type(ema).__name__}")
        if any(e is ema for e in self.emas):
            raise ValueError("this EMA is already tracked by this guard")
        ours = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if ema._params and not any(id(p) in ours for p in ema._params):
            raise ValueError("the EMA averages parameters of which none is in this guard's optimizer: was it built "
                             "on another model? Nothing was changed.")
        self.emas.append(ema)

    def update_emas(self, decision: torch.Tensor, skipped: bool | None) -> None:
        """Right after the inner step: each EMA, gated by the decision's skip flag (on device), or
        by the host decision's (``skipped``: a host bool; None on the device path)."""
        skip = decision[Dec.SKIP] if skipped is None else skipped
        for ema in self.emas:
            ema.update(skip)

    def release(self) -> None:
        """``close()``: the wrappers hand ``step()`` back to their schedulers."""
        for wrapper in self.schedulers:
            wrapper._owner = None
        self.schedulers.clear()

    def _check_scheduler(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        if isinstance(scheduler, ScheduledLR) or any(scheduler is w.scheduler for w in self.schedulers):
            raise ValueError("this scheduler is already registered with opt.schedule(); keep using what that call "
                             "returned")
        if not isinstance(scheduler, _LRScheduler):
            raise TypeError("schedule() expects a torch.optim.lr_scheduler.LRScheduler, got "
                            f"{type(scheduler).__name__}")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError("ReduceLROnPlateau steps on a metric the guard does not have: keep calling its "
                            "step(metric) yourself (it is per epoch/eval, not per optimizer step)")
        target = getattr(scheduler, "optimizer", None)
        if target is None or getattr(target, "param_groups", None) is not optimizer.param_groups:
            raise ValueError("the scheduler was built on another optimizer: build it on the guard (or the optimizer "
                             "it wraps) before opt.schedule(scheduler)")


class ScheduledLR:
    """What :meth:`GuardedOptimizer.schedule` returns: ``scheduler``, stepped by the guard once per
    taken optimizer step. Keep it in place of the scheduler.

    ``step()`` raises :class:`GuardStateError` (a second step per iteration is the silent bug this
    prevents) until ``opt.close()``, after which it is the scheduler's own. ``state_dict()`` is the
    scheduler's own, after any advance still pending (so it can be saved before or after
    ``opt.state_dict()``; it waits for pending reports). Everything else (``get_last_lr()``,
    ``last_epoch``, ``load_state_dict()``...) is the scheduler's. ``.scheduler`` is yours, unchanged:
    its own ``step()`` is not refused, so do not call it. Pickled and deep-copied as the scheduler
    alone (a copy is not registered)."""

    def __init__(self, scheduler: _LRScheduler, owner: Schedules, advance: Callable[[], None] | None = None) -> None:
        self.scheduler = scheduler
        self._owner: weakref.ReferenceType[Schedules] | None = weakref.ref(owner)
        """The guard's schedules (weak: the guard owns them); None once handed back by ``close()``."""
        self._advance = advance
        """What one taken step does (:meth:`advance`); None: the scheduler's own ``step()``."""

    @property
    def registered(self) -> bool:
        """Whether the guard still steps the scheduler (False once ``close()`` handed it back)."""
        return self._owner is not None and self._owner() is not None

    def advance(self) -> None:
        """One taken step's advance, as the guard applies it (:meth:`Schedules.advance`)."""
        if self._advance is not None:
            self._advance()
        else:
            self.scheduler.step()

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.registered:  # handed back by close(), or the guard is gone
            self.scheduler.step(*args, **kwargs)
            return
        raise GuardStateError(
            f"step() called on a {type(self.scheduler).__name__} registered with opt.schedule(): the guard steps it "
            "itself, once per taken optimizer step (skipped steps hold the LR). Remove your scheduler.step() call. "
            "Nothing was changed.")

    def state_dict(self) -> dict[str, Any]:
        owner = self._owner() if self._owner is not None else None
        if owner is not None:
            owner.catch_up()
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float | torch.Tensor]:
        return self.scheduler.get_last_lr()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "scheduler":  # not forwarded (and not set yet while unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _alone, (self.scheduler,)

    def __repr__(self) -> str:
        return f"ScheduledLR({type(self.scheduler).__name__})"


def _alone(scheduler: _LRScheduler) -> _LRScheduler:
    """A pickled or copied :class:`ScheduledLR` comes back as its scheduler alone."""
    return scheduler
