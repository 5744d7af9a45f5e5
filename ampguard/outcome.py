"""The one owner of a step's outcome: records, forensics, the ladder, the schedules, the voice.

Decoding a report (:mod:`ampguard.reporter`) only records. :class:`Outcome` acts on what the
records ask for, at the guard's *fixed points* inside ``step()``, the same step on every rank, so
an action that is a collective (an FSDP state dict, a user's checkpoint) cannot deadlock:

- :meth:`Outcome.settle` (at the start of ``step()``, and at its end where the step synchronised
  or decided on the host): decode, advance the registered schedulers, export, arm or disarm
  forensics, take the ladder's snapshots, call ``on_abort``, raise the error that stops training,
  and carry out a rollback the ladder asked for.
- :meth:`Outcome.rollback`: the one rollback. A rollback is a step of its own: it is recorded
  as a skipped report (reason ``rollback``) on the step after the one whose report asked for it.
  On the sync-free path that report is decoded at the start of the next ``step()``, whose
  gradients the rollback then drops; where the step synchronised, at the end of the very
  ``step()`` that took the bad step, which then also ends the rollback's step: ``step_count``
  moves by two in that call and the next ``backward()`` belongs to the step after the rollback.
  Either way: restore, zero the gradients, record the report, end the step.

It holds the guard by a weak reference (the guard owns it), for the guard's user callbacks
(``on_rollback(opt, step)``, ``on_abort(opt, diagnosis)``) and its step counter.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .backends.base import AttachedGuard, Backend
from .escalation import Ladder, OnAbort, OnRollback
from .exporters.base import MultiExporter
from .forensics.arming import Forensics
from .logs import Voice
from .records import Anomaly, History, RunInfo, StepReport
from .reporter import REPORT_BATCH, Reporter
from .schedules import Schedules
from .switches import implementation_switches
from .vocab import SkipReason

if TYPE_CHECKING:
    from .config import GuardConfig
    from .runlog.summary import RunSummary

__all__ = ["Loop", "Outcome", "Readers"]


class Loop(AttachedGuard, Protocol):
    """What the outcome needs of its guard (:class:`~ampguard.guard.GuardedOptimizer`, which the
    user callbacks receive): what a backend reads of it (model, optimizer, device, precision) and
    its other parts, to build the records, and its step, to spend one on a rollback."""

    @property
    def config(self) -> GuardConfig: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def scaler(self) -> torch.amp.GradScaler | None: ...
    @property
    def param_names(self) -> tuple[str, ...]: ...
    @property
    def step_count(self) -> int: ...

    def get_scale(self) -> float: ...

    def _end_step(self) -> None: ...


class Outcome:
    """What a guard's steps come to, and the fixed points where it is acted on (module docstring)."""

    def __init__(self, guard: Loop, *, records: Reporter, forensics: Forensics, schedules: Schedules,
                 voice: Voice, exporter: MultiExporter, backend: Backend) -> None:
        self.records = records
        """Pending payloads, decoded reports, counters, quarantine; the ladder's window."""
        self.schedules = schedules
        """``opt.schedule()``'s schedulers and ``opt.track_ema()``'s averages."""
        self.voice = voice
        """What the guard tells the ``ampguard`` logger, and the run's summary."""
        self.forensics, self.exporter, self.backend = forensics, exporter, backend
        self.batch_ids: list[Any] = []
        """This step's ``backward(batch_id=...)`` values (a fresh list per step: the records keep the old one)."""
        self._guard = weakref.ref(guard)  # the guard owns this object: no cycle (see build())
        self._model, self._optimizer = guard.model, guard.optimizer
        self._batch = REPORT_BATCH if implementation_switches().report_batch else 1
        """Healthy reports a fixed point may leave undecoded, plus one (1: none; :meth:`Reporter.quiet`)."""

    @classmethod
    def build(cls, guard: Loop, *, exporter: MultiExporter, on_rollback: OnRollback | None,
              on_abort: OnAbort | None) -> Outcome:
        """The guard's records, ladder, forensics, schedules and voice, from its configuration."""
        cfg, backend = guard.config, guard.backend
        ladder = Ladder(cfg.escalation, on_rollback=on_rollback, on_abort=on_abort) if cfg.escalation else None
        # A weak reference: the records must not keep their guard alive. With a cycle, `del opt, model` left
        # the model (a DDP model, its reducer and process group) to the cyclic collector, which may run only
        # at interpreter exit, after dist.destroy_process_group().
        guard_ref = weakref.ref(guard)
        records = Reporter(config=cfg, rank=backend.rank, world_size=backend.world_size,
                           names=lambda: guard_ref().param_names,  # type: ignore[union-attr]
                           exporter=exporter, scaled=guard.scaler is not None, ladder=ladder,
                           can_snapshot=guard.model is not None)
        forensics = Forensics(model=guard.model, config=cfg, backend=backend, fp16=guard.scaler is not None,
                              findings=records.findings, device=guard.device)
        records.sentinel = forensics.sentinel
        voice = Voice(rank=backend.rank, world_size=backend.world_size, precision=guard.precision,
                      scaled=guard.scaler is not None, max_consecutive_skips=cfg.max_consecutive_skips)
        return cls(guard, records=records, forensics=forensics, schedules=Schedules(records), voice=voice,
                   exporter=exporter, backend=backend)

    @property
    def ladder(self) -> Ladder | None:
        return self.records.ladder

    def _batching(self) -> bool:
        """Whether healthy reports may wait for their batch (:data:`~ampguard.reporter.REPORT_BATCH`): not where
        a decoded healthy report is acted on: the ladder (its snapshots), armed forensics (disarmed after clean
        steps). A registered scheduler steps for the waiting healthy steps, which were taken (:meth:`settle`)."""
        return not (self.records.ladder is not None or self.forensics.armed)

    # ------------------------------------------------------------------ reading (no action)
    def decoded(self) -> Reporter:
        """The records, with every report that has reached the host decoded (readers: no action)."""
        self.records.decode()
        return self.records

    def catch_up(self) -> None:
        """Decode what has arrived and apply the schedulers' advance for it (``flush()``,
        ``state_dict()``, a registered scheduler's ``state_dict()``): local, no action."""
        self.records.decode()
        self.schedules.advance()

    def export(self) -> None:
        """Hand the decoded records to the voice (:class:`ampguard.logs.Voice`, which also keeps
        what the run's summary needs) and to the exporters."""
        self.records.export_pending(self.voice.hear)

    def flush(self) -> None:
        """Decode, advance the schedulers, export, and wait for the exporters' writes (``opt.flush()``)."""
        self.catch_up()
        self.export()
        self.exporter.flush()

    def summary(self, info: RunInfo, steps: int, *, closed: bool) -> RunSummary:
        """The run's summary (:meth:`ampguard.logs.Voice.summary`), also logged at INFO."""
        from .runlog.summary import format_summary

        result = self.voice.summary(info, steps, closed)
        self.voice.say_summary(format_summary(result), steps)
        return result

    def close(self) -> None:
        """``opt.close()``, after its flush and after the guard let go of what it attached (forensics' and the
        backend's hooks among it: ``guard._let_go``): hand the schedulers back, close the exporters."""
        self.schedules.release()
        self.exporter.close()

    # ------------------------------------------------------------------ the fixed points
    def settle(self, next_forward: int, before: int | None = None) -> bool:
        """Decode what has arrived, export it, and do what it asks (module docstring). Returns
        True when it rolled back, which spends the guard's current step. ``next_forward``: the
        step whose forward has not run yet (forensics hooks armed now see it whole). ``before``:
        decode only the reports of the steps before it (the guard's report lag; None: all)."""
        rep = self.records
        if rep.idle(before):  # nothing due, decoded or asked since the last fixed point (CPU, synced steps)
            return False
        if self._batch > 1 and self._batching() and rep.quiet(before, self._batch):  # healthy ones wait for a batch
            self.schedules.advance()  # they were taken: registered schedulers step for them before the next update
            return False
        rep.decode(before)
        self.schedules.advance()  # once per decoded taken step, before the next inner step
        self.export()
        asked = rep.take_actions()
        for report in asked.reports:
            self.forensics.after_report(report, next_forward, asked.blocks.get(report.step))
        ladder = self.ladder
        if ladder is not None:
            if self._model is not None:
                for step in asked.snapshots:
                    ladder.take_snapshot(self._model, self._optimizer, step, self.schedules)
            if asked.abort is not None and ladder.on_abort is not None:
                ladder.on_abort(self._loop(), asked.abort[0])
        if asked.stop is not None:
            self.voice.say_stop(asked.stop, self._loop().step_count)
            raise asked.stop
        if ladder is not None and ladder.pending_rollback is not None:
            self.rollback()
            return True
        return False

    @torch.no_grad()
    def rollback(self) -> None:
        """Carry out the rollback the ladder asked for, on the guard's current step (see the
        module docstring): restore the snapshot (or call ``on_rollback(opt, opt.step_count)``;
        the loss scale is *not* restored: the backed-off scale is part of the recovery), zero
        the gradients, record a skipped ``rollback`` report, end the step. The same on every
        rank (no collective runs on this step anywhere)."""
        ladder, guard = self.ladder, self._loop()
        assert ladder is not None  # internal: settle() checked
        restored = ladder.rollback(self._model, self._optimizer)  # counted; the snapshot restored, if no callback
        if ladder.on_rollback is not None:
            ladder.on_rollback(guard, guard.step_count)
        if restored is not None:
            self.schedules.restore(restored)
        else:  # on_rollback restored (or not) the schedulers: theirs is the truth
            self.schedules.resync()
        self.backend.zero_grad(self._optimizer, True)
        scale = guard.get_scale()
        report = StepReport(step=guard.step_count, skipped=True, reason=SkipReason.ROLLBACK, loss=math.nan,
                            loss_scale=scale, next_loss_scale=scale, grad_norm=math.nan, nonfinite_grads=0,
                            nonfinite_loss=False, world_size=self.backend.world_size, rank=self.backend.rank,
                            wall_time=time.time())
        self.records.record(report, [], consecutive=False)
        self.export()
        self.records.take_actions()
        guard._end_step()  # clears the batch ids, the loss, the measurement; the next step begins

    def _loop(self) -> Loop:
        guard = self._guard()
        assert guard is not None  # internal: only called from the guard's own methods
        return guard



class Readers:
    """The guard's results, read only (mixed into :class:`~ampguard.guard.GuardedOptimizer`):
    they decode what has reached the host and never act, so a rank that reads early changes
    nothing (the fixed points are :meth:`Outcome.settle`'s)."""

    _outcome: Outcome

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` skipped the inner optimizer. Reading it right after a step
        that did not synchronise (fused optimizer on CUDA) waits for that step's decision. It reads the skip
        flag where the step's payload lies and decodes nothing (a framework reads it every step: accelerate's
        ``optimizer_step_was_skipped``), so healthy reports still wait for their batch."""
        skipped = self._outcome.records.last_skipped()
        if skipped is not None:
            return skipped
        last = self.last_report
        return bool(last and last.skipped)

    @property
    def last_report(self) -> StepReport | None:
        """The last step's :class:`StepReport` (waits for it like ``step_was_skipped``)."""
        history = self._outcome.decoded().history
        return history[-1] if len(history) else None

    @property
    def history(self) -> History:
        """The last ``config.history_size`` reports; ``history[s]`` is step ``s``'s."""
        return self._outcome.decoded().history

    @property
    def anomalies(self) -> Sequence[Anomaly]:
        """Anomalies recorded so far, oldest first (the last ``config.max_anomalies``)."""
        return tuple(self._outcome.decoded().anomalies)

    @property
    def skipped_steps(self) -> int:
        """Number of skipped steps among the reported ones."""
        return self._outcome.decoded().skipped_total

    @property
    def quarantine(self) -> list[Any]:
        """``batch_id``s of the micro-batches of non-finite steps (see ``backward(batch_id=...)``)."""
        return self._outcome.records.quarantine
