"""The escalation ladder past skip and backoff: snapshot, roll back, stop.

Driven only by agreed :class:`~ampguard.records.StepReport` values, at the guard's fixed
materialisation points, so every rank climbs the same rung at the same step.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .config import Escalation
from .integrity import amax_per_tensor
from .logs import advice_for, tally
from .records import Anomaly, StepReport
from .vocab import AnomalyKind

if TYPE_CHECKING:
    from .schedules import Schedules

__all__ = ["Ladder", "OnAbort", "OnRollback", "Observed", "consecutive_diagnosis"]

OnRollback = Callable[..., None]
"""``on_rollback(opt, step)``, ``opt`` the :class:`~ampguard.guard.GuardedOptimizer`: restore a
checkpoint of your own (the ladder's rung 3). Called by :meth:`ampguard.outcome.Outcome.rollback`."""
OnAbort = Callable[..., None]
"""``on_abort(opt, diagnosis)``, ``opt`` the :class:`~ampguard.guard.GuardedOptimizer`: called
before training stops (the ladder's last rung), by :meth:`ampguard.outcome.Outcome.settle`."""


def _to(obj: Any, device: str | None) -> Any:
    """Deep copy of a state_dict with every tensor cloned (to ``device`` when given)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.to(device, copy=True) if device is not None else t.clone()
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to(v, device) for v in obj)
    return obj


@dataclasses.dataclass(frozen=True, slots=True)
class Observed:
    """What one report means for the ladder."""

    anomalies: list[Anomaly]
    diagnosis: str | None
    """Set when training must stop."""
    snapshot: bool
    """Take a snapshot of the model after this step (at the guard's next fixed point)."""


class Ladder:
    """Counts non-finite steps in a sliding window and decides when to roll back or stop.

    :meth:`observe` only decides (it is run when a report is decoded, which may be early on one
    rank); snapshots, rollbacks and ``on_abort`` are carried out at the guard's fixed points
    (:class:`ampguard.outcome.Outcome`).
    """

    def __init__(
        self,
        config: Escalation,
        *,
        on_rollback: OnRollback | None,
        on_abort: OnAbort | None,
    ) -> None:
        self.config = config
        self.on_rollback = on_rollback
        self.on_abort = on_abort
        self.recent: deque[int] = deque()  # steps of non-finite reports within the window
        self.rollbacks = 0
        self.snapshot: dict[str, Any] | None = None
        self.snapshot_step: int | None = None
        self.pending_rollback: Anomaly | None = None
        self.pending_snapshot: int | None = None
        """A step after which a snapshot is wanted and not yet taken (the guard takes it)."""

    def observe(self, report: StepReport, *, can_snapshot: bool, anomalies: Sequence[Anomaly]) -> Observed:
        """Fold one report in. ``anomalies``: those recorded so far (for the diagnosis)."""
        c = self.config
        while self.recent and self.recent[0] <= report.step - c.window:
            self.recent.popleft()
        if not report.nonfinite:
            every = c.snapshot_every
            want = every is not None and not report.skipped and (report.step + 1) % every == 0 and can_snapshot
            if want:
                self.pending_snapshot = report.step
            return Observed([], None, want)
        self.recent.append(report.step)
        if len(self.recent) < c.rollback_after:
            return Observed([], None, False)
        count = len(self.recent)
        self.recent.clear()
        anomaly = self.request_rollback(report.step, f"{count} non-finite steps within {c.window} steps",
                                        report.nonfinite_ranks)
        if anomaly is not None:
            return Observed([anomaly], None, False)
        why = ("no snapshot to roll back to (set Escalation.snapshot_every or pass on_rollback)"
               if not self.can_roll_back() else f"{self.rollbacks} rollback(s) did not help")
        diagnosis = self.diagnose(report, count, why, anomalies)
        return Observed([Anomaly(report.step, AnomalyKind.ABORT, diagnosis, report.nonfinite_ranks)], diagnosis, False)

    def can_roll_back(self) -> bool:
        """There is something to roll back to: ``on_rollback``, a snapshot, or one wanted but not yet
        taken (it is taken before the rollback is carried out)."""
        return self.on_rollback is not None or self.snapshot is not None or self.pending_snapshot is not None

    def request_rollback(self, step: int, why: str, ranks: tuple[int, ...] = ()) -> Anomaly | None:
        """Ask for a rollback at the next fixed point, because of ``why`` (a phrase), on ``step``:
        the ``rollback`` anomaly, or None where none can be done (nothing to roll back to, or
        ``max_rollbacks`` spent). Decides only; the outcome carries it out."""
        c = self.config
        if self.rollbacks >= c.max_rollbacks or not self.can_roll_back():
            return None
        last = self.pending_snapshot if self.pending_snapshot is not None else self.snapshot_step
        target = "your on_rollback checkpoint" if self.on_rollback else f"the snapshot after step {last}"
        self.pending_rollback = Anomaly(step, AnomalyKind.ROLLBACK, f"{why}: rolling back to {target} "
                                        f"(rollback {self.rollbacks + 1} of {c.max_rollbacks})", ranks)
        return self.pending_rollback

    def diagnose(self, report: StepReport, count: int, why: str, anomalies: Sequence[Anomaly]) -> str:
        window = self.config.window
        advice = advice_for(report.reason, [a for a in anomalies if a.step > report.step - window])
        return (f"training stopped at step {report.step}: {count} non-finite steps within {window} steps "
                f"and {why}. What to do: {advice}. " + _last(report, anomalies))

    @torch.no_grad()
    def take_snapshot(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                      schedules: Schedules | None = None) -> None:
        """Copy the model and optimizer state, and the state of the schedulers and EMAs registered
        with ``opt.schedule()``/``opt.track_ema()`` (``schedules``), so a rollback rewinds them too."""
        self.pending_snapshot = None
        params = list(model.parameters())
        if params and not torch.isfinite(amax_per_tensor(params)).all():  # one read; a snapshot syncs anyway
            return  # never snapshot poison (an update from finite gradients can leave NaN weights): keep the last
        device = self.config.snapshot_device
        self.snapshot = {"model": _to(model.state_dict(), device), "optimizer": _to(optimizer.state_dict(), device),
                         "schedules": None if schedules is None else _to(schedules.state(), device)}
        self.snapshot_step = step

    @torch.no_grad()
    def rollback(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """Count the rollback; restore the snapshot's model and optimizer state and return its
        schedules' state (for :meth:`ampguard.schedules.Schedules.restore`), or, with ``on_rollback``
        (which the caller calls), restore nothing and return None. Carried out by
        :meth:`ampguard.outcome.Outcome.rollback` only."""
        self.pending_rollback = None
        self.rollbacks += 1
        if self.on_rollback is not None:
            return None
        assert self.snapshot is not None and model is not None  # internal: observe() checked
        model.load_state_dict(_to(self.snapshot["model"], None))
        optimizer.load_state_dict(_to(self.snapshot["optimizer"], None))
        saved = self.snapshot.get("schedules")
        return None if saved is None else _to(saved, None)  # type: ignore[no-any-return]

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = deque(int(s) for s in state.get("recent", ()))
        self.rollbacks = int(state.get("rollbacks", 0))


def _last(report: StepReport, anomalies: Sequence[Anomaly]) -> str:
    """The last report, and where forensics localised the last non-finite values (if anywhere)."""
    located = [a for a in anomalies if a.module is not None][-3:]
    where = "; ".join(f"step {a.step}: {a.module or '(model)'} {a.phase} ({a.cause})" for a in located)
    return (f"Last report: reason={report.reason}, loss={report.loss}, grad_norm={report.grad_norm}, "
            f"loss_scale={report.loss_scale}, ranks={list(report.nonfinite_ranks) or 'local'}."
            + (f" Localised: {where}." if where else ""))


def consecutive_diagnosis(report: StepReport, count: int, limit: int, anomalies: Sequence[Anomaly]) -> str:
    """Why training stops after ``count`` skipped steps in a row (``GuardConfig.max_consecutive_skips``
    = ``limit``): what the skips were, what that means, what to do."""
    run = [a for a in anomalies if a.step > report.step - count]
    seen = tally(a.kind for a in run) or "none recorded"
    advice = advice_for(report.reason, run)
    return (f"{count} consecutive steps skipped (GuardConfig.max_consecutive_skips={limit}): the run cannot learn "
            f"as it is. Anomalies over those steps: {seen}. What to do: {advice}. " + _last(report, anomalies)
            + " opt.anomalies (or `ampguard report` on the event log) has every step; "
            "GuardConfig(max_consecutive_skips=None) turns this stop off.")
