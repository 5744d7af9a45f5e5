"""What reports ask the guard to do, carried out at its fixed points inside ``step()``.

Decoding a report (:mod:`ampguard.reporter`) only records; these functions act: export,
arm or disarm forensics, take the ladder's snapshots, call ``on_abort``, raise the error that
stops training, roll back. They run at the same step on every rank, so an action that is a
collective (an FSDP state dict, a user's checkpoint) cannot deadlock.
"""

from __future__ import annotations

import math
import time
from typing import Any

from .records import StepReport
from .vocab import SkipReason

__all__ = ["carry_out", "export", "rollback_step"]


def carry_out(guard: Any, next_forward: int) -> None:
    """Decode what has arrived, export it, and do what it asks (see the module docstring).
    ``next_forward``: the step whose forward has not run yet (hooks armed now see it whole)."""
    rep = guard._reporter
    if rep.idle():  # nothing arrived, decoded or asked since the last fixed point (CPU, synced steps)
        return
    rep.decode()
    guard._schedules.advance(guard)  # opt.schedule(): once per decoded taken step, before the next inner step
    export(guard)
    actions = rep.take_actions()
    for report in actions.reports:
        guard._forensics.after_report(report, next_forward, actions.blocks.get(report.step))
    ladder = rep.ladder
    if ladder is not None:
        if guard.model is not None:
            for step in actions.snapshots:
                ladder.take_snapshot(guard.model, guard.optimizer, step, guard._schedules)
        if actions.abort is not None and ladder.on_abort is not None:
            ladder.on_abort(guard, actions.abort[0])
    if actions.escalation is not None:
        guard._voice.say_stop(actions.escalation, guard.step_count)
        raise actions.escalation


def export(guard: Any) -> None:
    """Hand the decoded records to the ``ampguard`` logger (:class:`ampguard.logs.Voice`, which
    also keeps what the run's summary needs) and to the exporters."""
    rep = guard._reporter
    rep.export_pending(guard._voice.hear)


def rollback_step(guard: Any) -> None:
    """A rollback decided at the start of this step (lagged report): restore, and spend this
    step on it, identically on every rank (no collective runs on this step anywhere)."""
    rep = guard._reporter
    rep.ladder.rollback(guard, guard.model, guard.optimizer)
    guard.backend.zero_grad(guard.optimizer, True)
    scale = guard.get_scale()
    report = StepReport(step=guard.step_count, skipped=True, reason=SkipReason.ROLLBACK, loss=math.nan,
                        loss_scale=scale, next_loss_scale=scale, grad_norm=math.nan, nonfinite_grads=0,
                        nonfinite_loss=False, world_size=guard.backend.world_size, rank=guard.backend.rank,
                        wall_time=time.time())
    rep.record(report, [], consecutive=False)
    export(guard)
    rep.take_actions()
    guard._batch_ids = []
    guard._end_step()
