"""From a step's device vector to :class:`StepReport` and :class:`Anomaly` records on the host.

:meth:`Reporter.enqueue` copies a step's payload off the device without waiting for it.
:meth:`Reporter.decode` turns every payload that has arrived into records, in step order: it
cuts each payload once by its header (:class:`~ampguard.payload.Layout`), builds the report
once from its parts, then the anomalies, and keeps counters, history, quarantine and the
escalation ladder's window up to date. Decoding has no effect outside this object: it is what the guard's *readers*
(``last_report``, ``history``, ...) run, so a rank that reads early changes nothing. What a
report asks the guard to *do* (arm forensics, snapshot, roll back, stop, export) is queued as
:class:`Actions` and carried out by the guard at fixed points inside ``step()``, at the same
step on every rank.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from .config import GuardConfig
from .errors import NonFiniteError
from .escalation import Ladder, consecutive_diagnosis
from .exporters.base import MultiExporter
from .forensics.arming import annotate
from .forensics.localizer import Finding
from .forensics.sentinel import UNREAD, Sentinel
from .fp8 import WIDTH, Fp8Monitor
from .indicators import Indicators
from .integrity import listed, nonfinite_names
from .payload import Landing, Layout, Packed, Unpacked
from .policies import uses_grad_detector
from .records import Anomaly, Fp8Cast, History, StepReport
from .stats import REASONS, Dec, Loc, origin_ranks
from .vocab import AnomalyKind, Phase, SkipReason

__all__ = ["REPORT_BATCH", "Actions", "Reporter"]


REPORT_BATCH = 16
"""Healthy steps' reports a fixed point leaves undecoded, at most, minus one (:meth:`Reporter.quiet`): they are
decoded, logged and exported up to 16 at a time, each in a warm loop (on the 2-core CPU a report decoded alone at
its step took ~55 us, in a batch ~16: docs/design.md, "What stop 45 taught"). ``AMPGUARD_REPORT_BATCH=0``: 1."""

REPORT_WAIT_S = 1.0
"""Seconds a healthy report may wait for its batch (:meth:`Reporter.quiet`): a run of slow steps exports each
one at its fixed point, so dashboards and alerts never see a run stand still for 16 long steps."""

_FREE_PER_SIZE = 4 + REPORT_BATCH
"""Decoded pinned buffers kept per payload length: a batch's, and the report lag's (a payload is a few hundred
bytes to a few KiB)."""

_C_TYPES = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double}
"""A host payload's floats read where they lie (:meth:`Reporter._peek`), by its dtype."""

_FLAGS = slice(Dec.SKIP, Dec.ZCLIP_REBASELINE + 1)
"""The decision's flags (:class:`~ampguard.stats.Dec`): a report with one of them set asks for something."""


class _Pending:
    __slots__ = ("batch_ids", "buf", "early", "event", "index", "layout", "since", "skip", "step", "unpacked")

    def __init__(self, step: int, buf: torch.Tensor | None, layout: Layout | None, event: Any, index: list[int],
                 batch_ids: list[Any], unpacked: Unpacked | None = None, skip: bool | None = None,
                 early: tuple[torch.Tensor, Any] | None = None) -> None:
        self.step, self.buf, self.layout, self.event = step, buf, layout, event
        self.index, self.batch_ids, self.unpacked = index, batch_ids, unpacked
        self.skip = skip
        """The skip as the host knew it at the step (a host decision), or None (decided on the device)."""
        self.early = early
        """The device decision's skip flag, copied to the host ahead of the inner step (:meth:`Reporter.copy_skip`),
        and the event of that copy; None where it was not copied."""
        self.since = time.monotonic()


@dataclasses.dataclass(slots=True)
class Actions:
    """What decoded reports ask of the guard, carried out at its next fixed point."""

    reports: list[StepReport] = dataclasses.field(default_factory=list)
    """Decoded, not yet acted on (forensics arming follows them)."""
    snapshots: list[int] = dataclasses.field(default_factory=list)
    """Steps after which the ladder wants a snapshot."""
    abort: tuple[str, StepReport] | None = None
    """The ladder's diagnosis, and the report it stopped at."""
    stop: NonFiniteError | None = None
    """The error that stops training, raised at the fixed point (consecutive skips, abort)."""
    blocks: dict[int, str] = dataclasses.field(default_factory=dict)
    """Step -> the block the sentinel named on it (forensics hooks arm inside it)."""


class Reporter:
    """Pending payloads, decoding, and every host-side record of the run."""

    def __init__(
        self,
        *,
        config: GuardConfig,
        rank: int,
        world_size: int,
        names: Callable[[], tuple[str, ...]],
        exporter: MultiExporter,
        scaled: bool,
        ladder: Ladder | None,
        can_snapshot: bool,
    ) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.names = names
        self.exporter = exporter
        self.scaled = scaled
        self.ladder = ladder
        self.can_snapshot = can_snapshot
        self.history = History(config.history_size)
        self.anomalies: deque[Anomaly] = deque(maxlen=config.max_anomalies)
        self.skipped_total = 0
        self.consecutive_skips = 0
        self.quarantine: list[Any] = []
        self.findings: dict[int, Finding] = {}
        """Forensics' findings by step, waiting for their step's report."""
        self.divergence: Anomaly | None = None
        """A consistency check's finding, until its step is reported."""
        self.sentinel: Sentinel | None = None
        """The opt-in sentinel, whose slot of the gathered vector names a block on its own step."""
        self.indicators: Indicators | None = None
        """The leading indicators, whose values end the payload on sampled steps."""
        self.fp8: Fp8Monitor | None = None
        """fp8 monitoring (``wrap(fp8=...)``): its casts end every step's payload."""
        self._blocks: dict[int, str] = {}
        self.actions = Actions()
        self._pending: deque[_Pending] = deque()
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        """Pinned buffers (and their events) whose payload was decoded, by length, for the next copies."""
        self._unexported: list[tuple[StepReport, list[Anomaly]]] = []
        self._quiet = 0
        """How many of the first pending payloads :meth:`quiet` found healthy (each is read once)."""
        self.early_skip = False
        """Whether each device decision's skip flag is copied to the host ahead of the inner step (:meth:`copy_skip`).
        Turned on by :meth:`last_skipped` once it had to wait for the payloads of two steps in a row (a framework
        reading ``step_was_skipped`` every step: the transformers Trainer, a held scheduler in Lightning's manual
        optimization): from then on such a read waits for the decision, not for the optimizer's kernels queued
        behind it, which a host blocked there would leave the device without work after."""
        self._early: list[tuple[torch.Tensor, Any]] = []
        """Two pinned one-float buffers and their events, used in turn by :meth:`copy_skip`."""
        self._waited_at = -2
        """The step whose payload :meth:`last_skipped` last had to wait for."""

    # ------------------------------------------------------------------ device -> host
    def copy_skip(self, step: int, decision: torch.Tensor) -> tuple[torch.Tensor, Any] | None:
        """With :attr:`early_skip` on, start copying the device decision's skip flag to the host, between the
        decision and the inner step (one non_blocking copy of one float and an event; nothing otherwise). Returns
        the buffer and its event, for the step's :meth:`enqueue`; None where nothing was copied."""
        if not self.early_skip or decision.device.type != "cuda":
            return None
        if not self._early:
            self._early = [(torch.empty(1, dtype=decision.dtype, pin_memory=True), torch.cuda.Event())
                           for _ in range(2)]
        slot = self._early[step % 2]  # in turn: the previous step's flag stays readable while this one's copies
        slot[0].copy_(decision[Dec.SKIP:Dec.SKIP + 1], non_blocking=True)
        slot[1].record()
        return slot

    def enqueue(self, step: int, packed: Packed | Unpacked, index: list[int], batch_ids: list[Any],
                skip: bool | None = None, early: tuple[torch.Tensor, Any] | None = None) -> None:
        """Start copying the step's payload to the host (non_blocking into pinned memory on CUDA);
        a payload already unpacked on the host (the CPU) waits for no copy. ``index``: the parameter
        of each per-tensor norm (``GradGroups.index``). ``skip``: the host decision's skip (None: decided on
        the device), which :meth:`last_skipped` answers with at once; ``early``: what :meth:`copy_skip` returned
        for this step."""
        if isinstance(packed, Unpacked):
            self._pending.append(_Pending(step, None, None, None, index, batch_ids, packed, skip))
            return
        payload = packed.vector
        if packed.landing is not None:  # the step graph copies it to the host itself: nothing to launch
            self._pending.append(_Pending(step, None, packed.layout, packed.landing, index, batch_ids, None, skip,
                                          early))
            return
        if payload.device.type == "cuda":
            free = self._free.get(payload.numel())
            if free:  # a pinned buffer and event whose copy was decoded: reused (no pinned allocation)
                buf, event = free.pop()
            else:
                buf, event = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True), torch.cuda.Event()
            buf.copy_(payload, non_blocking=True)
            event.record()
        else:  # a host payload is the step's own fresh tensor (cat): no copy needed
            buf, event = payload.cpu(), None
        self._pending.append(_Pending(step, buf, packed.layout, event, index, batch_ids, None, skip, early))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def idle(self, before: int | None = None) -> bool:
        """Nothing to decode (before step ``before``: see :meth:`decode`), nothing decoded and not
        yet exported or acted on: a fixed point has nothing to do."""
        due = bool(self._pending) and (before is None or self._pending[0].step < before)
        return not (due or self._asked())

    def _asked(self) -> bool:
        """Something decoded and not yet exported or acted on since the last fixed point."""
        a = self.actions
        return bool(self._unexported or a.reports or a.snapshots or a.abort is not None or a.stop is not None
                    or a.blocks)

    def quiet(self, before: int | None, batch: int) -> bool:
        """Whether a fixed point may leave the due payloads (those of the steps before ``before``; None: all)
        undecoded: nothing decoded or asked since the last one, fewer than ``batch`` of them, the oldest younger
        than :data:`REPORT_WAIT_S`, and each one healthy (:meth:`_healthy`). Each payload is read once, where it
        lies (no copy, no sync: one still on its way is not healthy yet, and :meth:`decode` waits for it as it
        always has)."""
        if self._asked():
            return False
        pending, k = self._pending, self._quiet
        if pending and time.monotonic() - pending[0].since >= REPORT_WAIT_S:
            return False
        while k < len(pending) and (before is None or pending[k].step < before):
            if k + 1 >= batch or not self._healthy(pending[k]):
                return False
            k += 1
            self._quiet = k
        return True

    @property
    def taken_waiting(self) -> int:
        """Steps whose payloads :meth:`quiet` read healthy and left waiting for their batch: taken steps, each (its
        skip flag is 0), which a registered scheduler steps for at once (:meth:`ampguard.schedules.Schedules.taken`)."""
        return self._quiet

    @property
    def unresolved_from(self) -> int | None:
        """The first step whose outcome the host has not read (its payload neither decoded nor read healthy by
        :meth:`quiet`); None: every step's is. Steps before it are counted in the history or :attr:`taken_waiting`."""
        k = self._quiet
        return self._pending[k].step if k < len(self._pending) else None

    def _healthy(self, p: _Pending) -> bool:
        """A payload whose report asks for nothing: no flag of the decision set (no skip, overflow, spike, scale
        change or re-baseline), every parameter checked finite (this rank's and, with several ranks, every
        rank's), and no finding, block or divergence waiting for its step."""
        step = p.step
        if step in self.findings or step in self._blocks or (self.divergence is not None
                                                              and self.divergence.step == step):
            return False
        head = self._peek(p, wait=False)
        if head is None:
            return False
        d, rows, params = head
        return (not d[Dec.REASON] and not any(d[_FLAGS]) and (not params or math.isfinite(sum(params)))
                and not (self.world_size > 1 and any(row[Loc.PARAMS_NONFINITE] for row in rows)))

    @staticmethod
    def _peek(p: _Pending, *, wait: bool) -> tuple[Sequence[float], list[Sequence[float]], Sequence[float]] | None:
        """A pending payload's :meth:`~ampguard.payload.Layout.head` (decision, rows, params), read where it lies: a
        host payload as it is, a pinned buffer's floats in place (no copy, no tensor op, not the per-tensor norms:
        :meth:`decode` reads the whole payload once) once its copy has arrived. None: still on its way (``wait``:
        waited for, as a decode waits), or a dtype read otherwise."""
        u = p.unpacked
        if u is not None:
            return u.decision, u.rows, u.params
        if isinstance(p.event, Landing):  # copied by the step graph itself: its floats, once landed
            if not p.event.query():
                if not wait:
                    return None
                p.event.synchronize()
            assert p.event.values is not None and p.layout is not None  # internal: landed, enqueued packed
            return p.layout.head(cast(Sequence[float], p.event.values))
        assert p.buf is not None and p.layout is not None  # internal: enqueued packed
        if p.event is not None and not p.event.query():
            if not wait:
                return None
            p.event.synchronize()  # that step's copy only, as decode() waits for it
        c_type = _C_TYPES.get(p.buf.dtype)
        if c_type is None:
            return None
        floats = (c_type * p.buf.numel()).from_address(p.buf.data_ptr())
        return p.layout.head(cast(Sequence[float], floats))  # its slices are lists

    def last_skipped(self) -> bool | None:
        """Whether the latest step skipped, from its payload where it still waits to be decoded (its copy waited
        for if still on its way, as reading its report would): the decision's skip flag, what its report's
        ``skipped`` will say. None where the latest report is decoded (or recorded without a payload, as a
        rollback's), or nothing is pending: read the history then. A host decision's skip is known without a wait;
        a device decision's waits for its payload, or for its skip flag alone where :meth:`copy_skip` copied it
        (reads that waited for two steps' payloads in a row turn that copy on: :attr:`early_skip`)."""
        if not self._pending:
            return None
        p = self._pending[-1]
        if self.history.steps_reported > p.step:
            return None
        if p.skip is not None:
            return p.skip
        if p.event is not None and not p.event.query():
            if p.early is not None:
                flag, event = p.early
                event.synchronize()  # the decision's copy only: the optimizer's kernels behind it go on
                return flag.tolist()[0] > 0
            if p.step == self._waited_at + 1:
                self.early_skip = True  # read every step: from the next step on, copy the flag ahead
            self._waited_at = p.step
        head = self._peek(p, wait=True)
        return None if head is None else head[0][Dec.SKIP] > 0

    def clear_pending(self) -> None:
        self._pending.clear()
        self._quiet = 0

    def decode(self, before: int | None = None) -> None:
        """Turn the pending payloads into records, in step order: all of them, or those of the
        steps before ``before`` (a later step's copy may still be on its way; it is not waited
        for). Waits only for the copies it decodes."""
        while self._pending and (before is None or self._pending[0].step < before):
            pending = self._pending.popleft()
            self._quiet = max(self._quiet - 1, 0)
            payload = pending.unpacked
            landing = pending.event if isinstance(pending.event, Landing) else None
            if landing is not None:  # copied by the step graph itself: its floats, as Python floats
                landing.synchronize()
                assert landing.values is not None and pending.layout is not None  # internal: landed, enqueued packed
                payload = pending.layout.unpack(landing.values[:])
            if payload is None:
                assert pending.buf is not None and pending.layout is not None  # internal: enqueued packed
                if pending.event is not None and not pending.event.query():
                    pending.event.synchronize()  # that step's copy only, still in flight: the host is ahead
                # the one read of the payload: one copy out of the pinned buffer, then the floats (tolist on the pinned
                # buffer itself took ~1 us an element on the H100's host, 300 us a step for GPT-2 350M's payload)
                buf = pending.buf if pending.event is None else pending.buf.clone()
                payload = pending.layout.unpack(buf.tolist())
                if pending.event is not None:  # read: the buffer and its event serve a later step
                    free = self._free.setdefault(pending.buf.numel(), [])
                    if len(free) < _FREE_PER_SIZE:
                        free.append((pending.buf, pending.event))
            report, anomalies = self.build(pending.step, payload, pending.index)
            self.record(report, anomalies, pending.batch_ids)

    def record(self, report: StepReport, anomalies: list[Anomaly], batch_ids: Sequence[Any] = (), *,
               consecutive: bool = True) -> None:
        """Fold one report into the records (history, counters, quarantine, the ladder's window).
        ``consecutive=False``: a rollback's own step, which does not count as a skip in a row."""
        if self.divergence is not None and self.divergence.step == report.step:
            anomalies.append(self.divergence)
            self.divergence = None
        anomalies = annotate(anomalies, self.findings.pop(report.step, None))
        block = self._blocks.pop(report.step, None)
        if block is not None:
            self.actions.blocks[report.step] = block
        if report.nonfinite and batch_ids:
            self.quarantine.extend(batch_ids)
        if self.ladder is not None and report.reason != SkipReason.ROLLBACK:
            seen = self.ladder.observe(report, can_snapshot=self.can_snapshot, anomalies=[*self.anomalies, *anomalies])
            anomalies.extend(seen.anomalies)
            if seen.snapshot:
                self.actions.snapshots.append(report.step)
            if seen.diagnosis is not None and self.actions.stop is None:
                self.actions.abort = (seen.diagnosis, report)
                self.actions.stop = NonFiniteError(seen.diagnosis, report)
        self.history.append(report)
        self.anomalies.extend(anomalies)
        self._unexported.append((report, anomalies))
        self.actions.reports.append(report)
        if report.skipped:
            self.skipped_total += 1
            self.consecutive_skips += 1 if consecutive else 0
        else:
            self.consecutive_skips = 0
        limit = self.config.max_consecutive_skips
        if limit is not None and self.consecutive_skips >= limit and self.actions.stop is None:
            self.actions.stop = NonFiniteError(
                consecutive_diagnosis(report, self.consecutive_skips, limit, self.anomalies), report)

    def take_actions(self) -> Actions:
        actions, self.actions = self.actions, Actions()
        return actions

    def export_pending(self, hear: Callable[[Sequence[tuple[StepReport, list[Anomaly]]]], None] | None = None) -> None:
        """Hand every decoded record not handed out yet, once and in step order, to ``hear`` (the
        ``ampguard`` logger: :meth:`ampguard.logs.Voice.hear`), then to the exporters (local I/O only)."""
        if hear is not None:
            hear(self._unexported)
        for report, anomalies in self._unexported:
            self.exporter.export(report, anomalies)
        self._unexported.clear()

    # ------------------------------------------------------------------ building
    def build(self, step: int, payload: Unpacked, index: list[int]) -> tuple[StepReport, list[Anomaly]]:
        """The step's report, built once from its unpacked payload, and its anomalies."""
        d, rows, world, config = payload.decision, payload.rows, self.world_size, self.config
        names = self.names()
        every = config.param_norms_every
        want_norms = d[Dec.GRAD_NONFINITE] > 0 or (every is not None and step % every == 0)
        # Norms >= 0: their sum is finite exactly when every norm is (one C loop); a healthy step that
        # does not report them makes no per-parameter list.
        finite = math.isfinite(sum(payload.norms))
        norms: list[float] = []
        if want_norms or not finite:
            # Attribution by construction: the k-th norm belongs to parameter index[k].
            norms = [math.nan] * len(names)
            for i, n in zip(index, payload.norms):
                norms[i] = n
        bad_params = () if finite else tuple(names[i] for i in sorted(index) if not math.isfinite(norms[i]))
        ranks = origin_ranks(rows) if world > 1 else ()
        loss_nonfinite = d[Dec.LOSS_NONFINITE] > 0
        unknown = math.isnan(d[Dec.LOSS]) and not loss_nonfinite  # NaN without the flag: no loss was given
        numerics = payload.numerics  # a sampled step's [zero fraction, headroom, per group...]
        modules = self.indicators.modules if self.indicators is not None else ()
        tail = payload.indicators if len(payload.indicators) == 2 * len(modules) else ()
        casts, fp8_ranks = self._fp8_casts(step, payload.fp8, rows)
        report = StepReport(
            step=step, skipped=d[Dec.SKIP] > 0, reason=REASONS[int(d[Dec.REASON])],
            loss=None if unknown else d[Dec.LOSS], loss_scale=d[Dec.SCALE], next_loss_scale=d[Dec.NEXT_SCALE],
            grad_norm=d[Dec.GRAD_NORM],
            nonfinite_grads=int(d[Dec.NONFINITE_TENSORS]), nonfinite_loss=loss_nonfinite, nonfinite_ranks=ranks,
            clip_coef=d[Dec.CLIP_COEF],  # 1.0 where nothing clipped (also a clip_grad_norm_ call's)
            grad_spike=d[Dec.GRAD_SPIKE] > 0, loss_spike=d[Dec.LOSS_SPIKE] > 0, world_size=world, rank=self.rank,
            param_norms=tuple(norms) if want_norms else None, wall_time=time.time(),
            scale_backoff=d[Dec.BACKOFF] > 0, scale_growth=d[Dec.GROWTH] > 0,
            grad_zero_fraction=numerics[0] if numerics else None,
            group_zero_fractions=tuple(numerics[2:]) if numerics else None,
            headroom_log2=numerics[1] if numerics and self.scaled else None,
            module_grad_norms=tuple(zip(modules, tail[: len(modules)])) if tail else None,
            module_update_ratios=tuple(zip(modules, tail[len(modules) :])) if tail else None,
            spike_threshold=d[Dec.SPIKE_THRESHOLD] if uses_grad_detector(config) else None,
            clip_threshold=d[Dec.CLIP_THRESHOLD] if config.zclip is not None else None,
            fp8=casts,
        )
        anomalies = self._anomalies(report, d, ranks, bad_params, rows)
        if fp8_ranks:  # before the gradients' anomaly: the cast is where the non-finite values came from
            anomalies.insert(1 if report.nonfinite_loss else 0, self._fp8_anomaly(report, casts or (), fp8_ranks))
        if self.sentinel is not None and anomalies and report.nonfinite:
            # the first anomaly other than the fp8 one, whose module and phase stay the cast's
            at = next((i for i, a in enumerate(anomalies) if a.kind != AnomalyKind.FP8_NONFINITE), 0)
            named = self._sentinel_named(step, anomalies[at], rows, ranks)
            if named.kind == AnomalyKind.FP8_NONFINITE:
                named = dataclasses.replace(named, module=anomalies[at].module, phase=anomalies[at].phase)
            anomalies[at] = named
        poisoned = nonfinite_names(payload.params, names)
        if poisoned:  # several ranks: named here, acted on from the next step's gathered flag, on every rank
            anomalies.extend(self._poisoned(report, poisoned, act=world == 1))
        bad_ranks = tuple(r for r, row in enumerate(rows) if row[Loc.PARAMS_NONFINITE] > 0) if world > 1 else ()
        if bad_ranks:
            anomalies.extend(self._poisoned(report, (), ranks=bad_ranks))
        return report, anomalies

    def _fp8_casts(self, step: int, flat: Sequence[float],
                   rows: list[Sequence[float]]) -> tuple[tuple[Fp8Cast, ...] | None, tuple[int, ...]]:
        """This rank's fp8 casts (on a sampled step, or a step where a cast went non-finite on some rank: else
        None, no host work), and the ranks where one did."""
        monitor = self.fp8
        if monitor is None or not flat:
            return None, ()
        ranks = tuple(r for r, row in enumerate(rows) if row[Loc.FP8_NONFINITE] > 0)
        if not ranks and step % monitor.numerics_every:
            return None, ()
        return monitor.decode([flat[k : k + WIDTH] for k in range(0, len(flat), WIDTH)]), ranks

    def _fp8_anomaly(self, report: StepReport, casts: Sequence[Fp8Cast], ranks: tuple[int, ...]) -> Anomaly:
        """The anomaly of a step where an fp8 cast's amax or scale was non-finite: the module, role and values
        of this rank's bad casts (the first in the model's order first), or the ranks where they were."""
        bad = [c for c in casts if not c.finite]
        on = f" on rank(s) {list(ranks)}" if self.world_size > 1 else ""
        held = f"; loss scale held at {report.loss_scale:g}" if self.scaled and not report.scale_backoff else ""
        if not bad:  # another rank's
            return Anomaly(report.step, AnomalyKind.FP8_NONFINITE, f"an fp8 cast's amax or scale was non-finite{on}; "
                           f"step skipped on every rank{held}", ranks)
        first = bad[0]
        others = tuple(f"{c.module} {c.role}" for c in bad[1:])
        more = f" (and {len(others)} more: {listed(others)})" if others else ""
        if math.isnan(first.amax):
            why = (f"a NaN reached {first.module}'s {first.role}: torchao's scale max/amax is NaN, so the whole "
                   "cast is NaN")
        elif math.isinf(first.amax):
            why = (f"an Inf reached {first.module}'s {first.role}: torchao's scale max/amax is 0, which zeroes "
                   "every finite element of that tensor (or row) and turns the Inf into NaN")
            if self.scaled:  # fp16: the likely Inf is a value beyond 65504 (a cast, a scaled gradient)
                why += " (in fp16 a value beyond 65504 is Inf: an fp16 overflow before this cast is the likely source)"
        else:
            why = "the scale itself was not finite and positive"
        # module and phase are where the cast is; the cause is left to forensics (its recompute can tell)
        phase = Phase.BACKWARD if first.role == "grad_output" else Phase.FORWARD
        return Anomaly(report.step, AnomalyKind.FP8_NONFINITE,
                       f"fp8 cast non-finite{on}: {Fp8Monitor.describe(first)}{more}; {why}; step skipped on every "
                       f"rank{held}", ranks, module=first.module, phase=phase)

    def _poisoned(self, report: StepReport, params: tuple[str, ...], *, act: bool = True,
                  ranks: tuple[int, ...] = ()) -> list[Anomaly]:
        """A checked step whose update left non-finite parameters: the ladder's rollback where it
        can roll back, else a stop (NonFiniteError at the next fixed point). ``act=False``: the anomaly
        only (several ranks: this rank's names, the action from the gathered flag). ``ranks``: the ranks
        whose flag the step gathered (their last checked update, before this step), on every rank alike."""
        why = "(AdamW with eps=0 on a zero gradient, an LR or a schedule gone inf, a bit flip...)"
        if ranks:
            what = (f"parameters non-finite on rank(s) {list(ranks)} after their last checked update, before step "
                    f"{report.step} (that rank's own nonfinite_params anomaly names them) {why}")
        else:
            how = "from finite gradients" if not report.nonfinite else "on a non-finite step"
            what = (f"{len(params)} parameter(s) non-finite after step {report.step}'s update {how}: "
                    f"{listed(params)} {why}")
        if not act:
            return [Anomaly(report.step, AnomalyKind.NONFINITE_PARAMS, f"{what}; every rank acts on it at the next "
                            "step, when the flag has been gathered", (self.rank,), params=params[:8])]
        ladder = self.ladder
        rollback = ladder.request_rollback(report.step, "non-finite parameters") if ladder is not None else None
        action = "rolling back" if rollback is not None else "training stops"
        if rollback is None and self.actions.stop is None:
            self.actions.stop = NonFiniteError(f"training stopped at step {report.step}: {what}. Every later loss "
                                               "would be non-finite; resume from the last healthy checkpoint "
                                               "(opt.verify() before saving)", report)
        found = Anomaly(report.step, AnomalyKind.NONFINITE_PARAMS, f"{what}; {action}", ranks, params=params[:8])
        return [found] if rollback is None else [found, rollback]

    def _sentinel_named(self, step: int, first: Anomaly, rows: list[Sequence[float]],
                        ranks: tuple[int, ...]) -> Anomaly:
        """The first non-finite anomaly of a step, with the block (or input) the sentinel flagged
        first on the first rank where the values originated (every rank decodes the same rows)."""
        assert self.sentinel is not None  # internal: called when on
        order = [*ranks, *(r for r in range(len(rows)) if r not in ranks)]
        hit = next(((r, rows[r][Loc.SENTINEL]) for r in order if rows[r][Loc.SENTINEL] >= 0), None)
        rank: int | None
        if hit is not None:
            rank, name = hit[0], self.sentinel.name(hit[1])
            if name is None:
                return first
            said = f"{name} is the first watched block whose output was non-finite (forensics hooks arm inside it)"
        else:  # no watched block non-finite: the last block's output, read through the loss only?
            rank = next((r for r in order if rows[r][Loc.SENTINEL] == UNREAD and rows[r][Loc.LOSS_NONFINITE] > 0), None)
            if rank is None:
                return first
            name = self.sentinel.last
            said = (f"every watched block's output was finite and the loss was not: {name}, the model's last block, "
                    f"or the loss computed from its output (the model's output, read through the loss; forensics "
                    f"hooks arm inside {name})")
        where = f" on rank {rank}" if self.world_size > 1 else ""
        if name == "":
            return dataclasses.replace(first, module=None, phase=Phase.INPUT, detail=(
                f"{first.detail}. Sentinel{where}: the model's input was non-finite before any block ran"))
        self._blocks[step] = name
        return dataclasses.replace(first, module=name, phase=Phase.FORWARD,
                                   detail=f"{first.detail}. Sentinel{where}: {said}")

    def _anomalies(self, report: StepReport, d: Sequence[float], ranks: tuple[int, ...],
                   bad_params: tuple[str, ...], rows: list[Sequence[float]]) -> list[Anomaly]:
        """``d``: the decision (:class:`~ampguard.stats.Dec`), for what the report does not hold."""
        step, out, scale = report.step, [], report.loss_scale
        grad_nonfinite = d[Dec.GRAD_NONFINITE] > 0  # non-finite tensors, or GradScaler's found_inf
        scale_txt = ""
        if self.scaled:
            if report.scale_backoff:
                scale_txt = f"; loss scale backed off {scale:g} -> {report.next_loss_scale:g}"
            elif grad_nonfinite:
                scale_txt = f"; loss scale kept at {scale:g} (hysteresis={self.config.hysteresis})"
            elif report.skipped:
                scale_txt = f"; loss scale held at {scale:g} (the gradients were finite)"
        where = f" on rank(s) {list(ranks)}" if ranks else ""
        if report.nonfinite_loss:
            out.append(Anomaly(step, AnomalyKind.NONFINITE_LOSS, f"loss was {report.loss}{where}; step skipped"
                               f"{scale_txt}", ranks, bad_params[:8]))  # phase: None until forensics or the sentinel
        elif grad_nonfinite:
            kind = AnomalyKind.OVERFLOW if self.scaled else AnomalyKind.NONFINITE_GRAD
            what = f"{report.nonfinite_grads} gradient tensor(s) non-finite"
            if kind == AnomalyKind.OVERFLOW:
                what += f" at loss scale {scale:g}"
            first = f" (first: {', '.join(bad_params[:3])})" if bad_params else ""
            out.append(Anomaly(step, kind, f"{what}{first}{where}; step skipped{scale_txt}", ranks, bad_params[:8]))
        if d[Dec.NO_GRADS] > 0:
            idle = tuple(r for r, row in enumerate(rows) if row[Loc.NO_GRADS] > 0) if self.world_size > 1 else ()
            on = f" (rank(s) {list(idle)})" if idle else ""
            held = "; loss scale held" if self.scaled else ""
            out.append(Anomaly(step, AnomalyKind.NO_GRADIENTS, "no parameter received a gradient: is the model's "
                               f"output detached?{on} Step skipped on every rank{held}", idle))
        act = "skipped" if report.skipped else "taken (Spikes.action='warn')"
        if report.grad_spike:
            sp = self.config.spikes
            if sp.grad_zscore is not None:
                what = (f"mean + {sp.grad_zscore:g} std = {d[Dec.SPIKE_THRESHOLD]:.4g} of the last "
                        f"~{sp.window} healthy steps")
            else:
                what = f"{sp.grad_factor}x its running average"
            out.append(Anomaly(step, AnomalyKind.GRAD_SPIKE, f"gradient norm {report.grad_norm:.4g} exceeded "
                               f"{what}; step {act}", ranks))
        if report.loss_spike:
            out.append(Anomaly(step, AnomalyKind.LOSS_SPIKE, f"loss {report.loss:.4g} exceeded "
                               f"{self.config.spikes.loss_factor}x its running average; step {act}", ranks))
        zc = self.config.zclip
        for flagged, who, did, k, knob in (
                (d[Dec.REBASELINE] > 0, "the spike detectors", "flagged", self.config.spikes.warmup, "Spikes.warmup"),
                (d[Dec.ZCLIP_REBASELINE] > 0, "ZClip", "clipped", zc.warmup if zc is not None else 0, "ZClip.warmup")):
            if flagged:
                out.append(Anomaly(step, AnomalyKind.REBASELINE, f"{who} {did} {k} steps in a row ({knob}): "
                                   "the level moved, so their statistics were re-based on those steps and the next "
                                   "steps are judged against that level"))
        if d[Dec.FLOOR] > 0:
            out.append(Anomaly(step, AnomalyKind.SCALE_FLOOR, f"loss scale reached the floor min_scale="
                               f"{self.config.min_scale:g}: fp16 overflows persist at the smallest allowed "
                               "scale, the model likely needs bf16/fp32 or a fix", ranks))
        return out
