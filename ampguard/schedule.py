"""Skip-aware LR schedules and weight EMA, with no host sync.

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
- **EMA** (:class:`EMA`) is updated inside ``step()``, right after the inner step, on device:
  ``torch.where`` on the decision's skip flag keeps the average of a skipped step, no sync.

See ``docs/schedules.md``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from .errors import GuardStateError

__all__ = ["EMA", "Schedules"]

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


# ---------------------------------------------------------------------- EMA
class EMA:
    """An exponential moving average of a model's floating-point parameters, updated only on
    the steps the guard takes: ``ema = ema + (1 - decay) * (param - ema)`` (``torch.lerp``,
    the formula of ``torch.optim.swa_utils.get_ema_multi_avg_fn``), starting from the weights
    at construction.

    Register it with ``opt.track_ema(ema)``: ``step()`` updates it right after the inner step,
    gated on device by the decision's skip flag (``torch.where``), with no host sync. Kept in
    each parameter's own dtype and device. Buffers (BatchNorm statistics) are not averaged.

    Without a guard, :meth:`update` takes the skip flag itself.
    """

    def __init__(self, model: torch.nn.Module, decay: float = 0.999) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay={decay!r}; expected a number in [0, 1]")
        self.decay = float(decay)
        named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
        self.names: tuple[str, ...] = tuple(n for n, _ in named)
        self._params: list[torch.Tensor] = [p for _, p in named]
        with torch.no_grad():
            self._shadow: list[torch.Tensor] = [p.detach().clone() for p in self._params]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self._params):
            groups.setdefault((p.device, p.dtype), []).append(i)
        self._groups = list(groups.items())
        """(device, dtype) -> indices: one foreach call per group."""

    @property
    def averaged(self) -> dict[str, torch.Tensor]:
        """The averaged parameters by name (the EMA's own tensors: do not modify)."""
        return dict(zip(self.names, self._shadow))

    @torch.no_grad()
    def update(self, skip: torch.Tensor | bool | None = None) -> None:
        """Fold the current parameters into the average, unless ``skip``. ``skip``: a 0-d tensor
        (> 0: skipped; read on device with ``torch.where``, no sync), a host bool, or None (update)."""
        weight = 1.0 - self.decay
        if skip is None or isinstance(skip, bool):
            if skip:
                return
            for _, idx in self._groups:
                torch._foreach_lerp_([self._shadow[i] for i in idx], [self._params[i].detach() for i in idx], weight)
            return
        for (device, _), idx in self._groups:
            keep = (skip > 0).to(device, non_blocking=True)
            shadow = [self._shadow[i] for i in idx]
            new = torch._foreach_lerp(shadow, [self._params[i].detach() for i in idx], weight)
            for s, n in zip(shadow, new):
                torch.where(keep, s, n, out=s)  # bitwise: the old average, or the eager update

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module | None = None) -> None:
        """Write the averaged weights into ``model``'s parameters (default: the averaged model's)."""
        for p, s in zip(self._targets(model), self._shadow):
            p.copy_(s)

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module | None = None) -> Iterator[None]:
        """``with ema.applied():`` the model holds the averaged weights (for eval); its own
        weights come back on exit (kept aside in a copy meanwhile)."""
        targets = self._targets(model)
        with torch.no_grad():
            saved = [p.detach().clone() for p in targets]
            for p, s in zip(targets, self._shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(targets, saved):
                    p.copy_(b)

    def state_dict(self) -> dict[str, Any]:
        """``{"decay": float, "averaged": {name: tensor}}`` (the EMA's own tensors, as
        ``nn.Module.state_dict`` returns its own)."""
        return {"decay": self.decay, "averaged": OrderedDict(zip(self.names, self._shadow))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (copied into this EMA's tensors). Checked first:
        a failed load changes nothing."""
        if not isinstance(state_dict, dict) or "averaged" not in state_dict or "decay" not in state_dict:
            raise ValueError("EMA.load_state_dict() expects a dict made by EMA.state_dict() ('decay', 'averaged')")
        averaged = state_dict["averaged"]
        if not isinstance(averaged, dict) or set(averaged) != set(self.names):
            got = sorted(averaged) if isinstance(averaged, dict) else type(averaged).__name__
            raise ValueError(f"EMA state holds parameters {got!s:.200}; this EMA averages {sorted(self.names)!s:.200}")
        for name, s in zip(self.names, self._shadow):
            t = averaged[name]
            if not isinstance(t, torch.Tensor) or t.shape != s.shape:
                raise ValueError(f"EMA state for {name!r} has shape {getattr(t, 'shape', None)}; expected {s.shape}")
        decay = state_dict["decay"]
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA state decay={decay!r}; expected a number in [0, 1]")
        with torch.no_grad():
            for name, s in zip(self.names, self._shadow):
                s.copy_(averaged[name])
        self.decay = float(decay)

    def _targets(self, model: torch.nn.Module | None) -> list[torch.Tensor]:
        if model is None:
            return self._params
        params = dict(model.named_parameters())
        missing = [n for n in self.names if n not in params]
        if missing:
            raise ValueError(f"the model has no parameter(s) {missing[:5]}: not the architecture this EMA averages")
        return [params[n] for n in self.names]

    def __repr__(self) -> str:
        return f"EMA(decay={self.decay}, parameters={len(self.names)})"
