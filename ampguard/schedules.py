"""Skip-aware LR schedules, with no host sync.

A skipped step must not advance an LR schedule or an average of the weights. Learning whether
a step was skipped costs a host sync on the sync-free path (fused optimizer on CUDA), so:

- **Schedulers** registered with :meth:`GuardedOptimizer.schedule` are stepped by the guard,
  once per *taken* step, at the guard's fixed points (:meth:`ampguard.outcome.Outcome.settle`),
  where the step's report has been decoded anyway, or its payload read while it waits for its
  batch (a healthy step, so a taken one). Where the step synchronised or decides on the host
  (CPU; non-fused optimizers on CUDA), that is right after the step. On the sync-free path the
  schedulers advance ahead, at the end of ``step()`` as if the step was taken
  (:meth:`Schedules.step_ahead`: what a loop reads between steps is the eager loop's after a
  taken step), and the fixed point keeps or undoes that advance. A registered scheduler keeps
  the guard's report lag at one step (without one, reports are decoded two steps late:
  ``GuardedOptimizer._report_lag``): step N's report is decoded at the start of step N+1's
  ``step()``, before its inner update reads the LR: the LR every update sees is the eager
  loop's, bitwise. The advance counts taken steps (``history.steps_reported - skipped_total``)
  against those already applied, so readers that decode early (``last_report``...) change
  nothing.
- ``opt.schedule(scheduler)`` returns a :class:`ScheduledLR`, a wrapper the loop keeps in place
  of the scheduler: its ``step()`` is refused (the guard steps the scheduler), its
  ``state_dict()`` counts the pending reports first and its ``get_last_lr()`` the last step's
  skip. The scheduler itself is left as it was (no class change, nothing patched), and nothing
  here is process-wide.
- **EMA** (:class:`ampguard.ema.EMA`) is updated inside ``step()``, right after the inner step,
  on device (see :mod:`ampguard.ema`).

See ``docs/schedules.md``.
"""

from __future__ import annotations

import copy
import dataclasses
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

    @property
    def unresolved_from(self) -> int | None: ...

    def decode(self) -> None: ...

    def last_skipped(self) -> bool | None: ...


@dataclasses.dataclass
class _Ahead:
    """One advance made ahead for ``step`` (:meth:`Schedules.step_ahead`): what it changed, as it was before."""

    step: int
    states: list[tuple[_LRScheduler, dict[str, Any]]]
    """Each scheduler's ``state_dict()`` before the advance."""
    groups: list[tuple[dict[str, Any], dict[str, Any]]]
    """Each param group the schedulers set, and its values (not ``params``) before the advance."""
    known: bool = False
    """A reader learnt the step was taken (:meth:`Schedules.exact`): nothing left to learn before the fixed point."""


class Schedules:
    """The guard's registered schedulers and EMAs (one per guard, held by its
    :class:`~ampguard.outcome.Outcome`)."""

    def __init__(self, records: Records) -> None:
        self.records = records
        self.schedulers: list[ScheduledLR] = []
        self.emas: list[EMA] = []
        self.applied = 0
        """Advances applied to the schedulers: one per taken step counted, and one per step advanced ahead."""
        self._ahead: list[_Ahead] = []
        """Advances made ahead for steps whose outcome the host does not know yet, oldest first."""

    @property
    def taken(self) -> int:
        """Taken steps among the decoded reports and the healthy ones waiting for their batch (read already: a
        healthy step is a taken one; :meth:`ampguard.reporter.Reporter.quiet`). No decode here."""
        records = self.records
        return records.history.steps_reported - records.skipped_total + records.taken_waiting

    def advance(self) -> None:
        """Step every scheduler once per taken step decoded since the last call, and settle the advances made
        ahead (:meth:`step_ahead`) for the steps now known: kept where those steps were taken, undone where one
        was skipped (the schedulers' state put back, then stepped once per taken step). Decodes nothing: the
        caller has (a fixed point, ``flush()``, ``state_dict()``)."""
        taken, ahead = self.taken, self._ahead
        if ahead:
            first = self.records.unresolved_from
            known = sum(first is None or a.step < first for a in ahead)
            confirmed = self.applied - len(ahead)
            if taken - confirmed == known:  # each known one was taken (the rule: a skip is rare)
                del ahead[:known]
                return
            later = [a.step for a in ahead[known:]]
            self._put_back(ahead[0])
            ahead.clear()
            self.applied = confirmed
            while self.applied < taken:
                self._step_all()
            for step in later:
                self.step_ahead(step)
            return
        while self.applied < taken:
            self._step_all()
        if self.applied > taken:  # cannot happen through the guard's calls; never step backwards
            self.applied = taken

    def step_ahead(self, step: int) -> None:
        """Right after ``step``'s inner update was queued, its outcome not known on the host (the sync-free path):
        advance the schedulers as if it was taken, so that ``param_groups`` and the schedulers show the next
        update's LR between steps as in the eager loop. The next fixed point keeps it, or undoes it where the
        step was skipped, before the next update reads the LR (:meth:`advance`). Host work only: each
        scheduler's ``state_dict()`` and its param groups' values are kept to undo it."""
        if not self.schedulers:
            return
        states = [(w.scheduler, _saved(w.scheduler)) for w in self.schedulers]
        groups, seen = [], set()
        for w in self.schedulers:
            for group in w.scheduler.optimizer.param_groups:
                if id(group) not in seen:
                    seen.add(id(group))
                    groups.append((group, {k: v.clone() if isinstance(v, torch.Tensor) else v
                                           for k, v in group.items() if k != "params"}))
        self._ahead.append(_Ahead(step, states, groups))
        try:
            self._step_all()
        except BaseException:  # a scheduler's own error: every scheduler as it was, then the error
            self._put_back(self._ahead.pop())
            raise

    def step_known(self, step: int, skipped: bool) -> None:
        """Right after ``step``'s inner update was queued, its skip read on the host by the step itself (a non-fused
        optimizer's one sync) and its report not yet decoded: a taken step's advance made now, as :meth:`step_ahead`
        makes it and known already (:meth:`exact` has nothing to wait for), which the next fixed point keeps; a
        skipped step holds the LR. The schedulers then show what the eager loop's do between steps."""
        if skipped or not self.schedulers:
            return
        self.step_ahead(step)
        self._ahead[-1].known = True

    def exact(self) -> None:
        """Before a read of a scheduler's own values (``get_last_lr()``): the advance made ahead for the latest
        step settled, waiting for that step's skip flag only (:meth:`ampguard.reporter.Reporter.last_skipped`;
        its early copy where reads every step turned it on), not for its whole report; else :meth:`catch_up`."""
        ahead = self._ahead
        if not ahead or all(a.known for a in ahead):
            return
        if len(ahead) == 1 and self.records.unresolved_from == ahead[0].step:  # the latest step, alone unknown
            skipped = self.records.last_skipped()
            if skipped is not None:
                if skipped:
                    self._put_back(ahead.pop())
                    self.applied -= 1
                else:
                    ahead[0].known = True
                return
        self.catch_up()

    def catch_up(self) -> None:
        """Decode what has arrived, then :meth:`advance` (a registered scheduler's ``state_dict()``)."""
        self.records.decode()
        self.advance()

    def resync(self) -> None:
        """After a restore: the schedulers' own state is the truth (see ``docs/schedules.md``)."""
        self._ahead.clear()
        self.applied = self.taken

    def _step_all(self) -> None:
        for wrapper in self.schedulers:
            wrapper.advance()  # the scheduler's own step (the wrapper's is refused)
        self.applied += 1

    def _put_back(self, ahead: _Ahead) -> None:
        """Undo every advance from ``ahead`` on: the schedulers' state and their param groups' values as they were
        before it (the caller drops those advances from :attr:`_ahead` and sets :attr:`applied`)."""
        for scheduler, state in ahead.states:
            scheduler.load_state_dict(state)
        for group, values in ahead.groups:
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and isinstance(group.get(key), torch.Tensor):
                    group[key].copy_(value)  # in place, as the schedulers set a tensor LR
                else:
                    group[key] = value

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
        """``close()`` (after its flush): the wrappers hand ``step()`` back to their schedulers."""
        for wrapper in self.schedulers:
            wrapper._owner = None
        self.schedulers.clear()
        self._ahead.clear()

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
    scheduler's own, after every pending report is counted (so it can be saved before or after
    ``opt.state_dict()``; it waits for pending reports). ``get_last_lr()`` is the scheduler's, once
    the last step's skip is known (a wait for that flag alone on the sync-free path: :meth:`Schedules.exact`).
    Everything else (``last_epoch``, ``load_state_dict()``...) is the scheduler's as it stands: between
    steps on the sync-free path, advanced for the last step as if it was taken (:meth:`Schedules.step_ahead`).
    ``.scheduler`` is yours, unchanged:
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
        return self._schedules() is not None

    def _schedules(self) -> Schedules | None:
        """The guard's schedules while it steps the scheduler; None once handed back or the guard is gone."""
        return self._owner() if self._owner is not None else None

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
        owner = self._schedules()
        if owner is not None:
            owner.catch_up()
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float | torch.Tensor]:
        owner = self._schedules()
        if owner is not None:  # the advance made ahead for the last step settled: its skip flag read
            owner.exact()
        return self.scheduler.get_last_lr()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "scheduler":  # not forwarded (and not set yet while unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _alone, (self.scheduler,)

    def __repr__(self) -> str:
        return f"ScheduledLR({type(self.scheduler).__name__})"


def _saved(scheduler: _LRScheduler) -> dict[str, Any]:
    """``scheduler.state_dict()``, to put back with ``load_state_dict``: torch's own schedulers rebind what their
    ``step()`` changes (a shallow dict is enough), others are deep-copied (a list changed in place)."""
    state = scheduler.state_dict()
    return state if type(scheduler).__module__.startswith("torch.optim") else copy.deepcopy(state)


def _alone(scheduler: _LRScheduler) -> _LRScheduler:
    """A pickled or copied :class:`ScheduledLR` comes back as its scheduler alone."""
    return scheduler
