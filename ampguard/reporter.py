"""From a step's device vector to :class:`StepReport` and :class:`Anomaly` records on the host.

:meth:`Reporter.enqueue` copies a step's payload off the device without waiting for it.
:meth:`Reporter.decode` turns every payload that has arrived into records, in step order: it
decodes the decision once into a typed :class:`~ampguard.stats.Decision`, builds the report and
the anomalies, and keeps counters, history, quarantine and the escalation ladder's window up to
date. Decoding has no effect outside this object: it is what the guard's *readers*
(``last_report``, ``history``, ...) run, so a rank that reads early changes nothing. What a
report asks the guard to *do* (arm forensics, snapshot, roll back, stop, export) is queued as
:class:`Actions` and carried out by the guard at fixed points inside ``step()``, at the same
step on every rank.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .config import GuardConfig
from .errors import NonFiniteError
from .escalation import Ladder, consecutive_diagnosis
from .exporters.base import MultiExporter
from .forensics.arming import annotate
from .forensics.localizer import Finding
from .forensics.sentinel import Sentinel
from .indicators import Indicators
from .policies import uses_clipping, uses_grad_detector
from .records import Anomaly, History, StepReport
from .stats import DECISION_K, LOCAL_K, Decision, Loc, origin_ranks
from .vocab import AnomalyKind, Phase, SkipReason

__all__ = ["Actions", "Reporter"]


class MemoryPeaks:
    """Peak allocated/reserved bytes of one CUDA device, from the caching allocator's host-side
    counters (no device sync). ``per_step=False`` only reads: the high-water mark, and the user's
    own ``torch.cuda.max_memory_allocated()`` untouched. ``per_step=True`` resets the peaks after
    each read (process-global: see ``GuardConfig.memory_peak_per_step``). ``stats``/``reset``:
    torch's functions (a test can hand in an allocator of its own)."""

    def __init__(self, device: Any, *, per_step: bool, stats: Callable[[Any], dict[str, Any]] | None = None,
                 reset: Callable[[Any], None] | None = None) -> None:
        self.device, self.per_step = device, per_step
        # One nested-stats call (torch.cuda.max_memory_allocated flattens and sorts every statistic).
        self._stats = stats or torch.cuda.memory_stats_as_nested_dict
        self._reset = reset or torch.cuda.reset_peak_memory_stats

    def read(self) -> tuple[int, int]:
        stats = self._stats(self.device)
        peaks = (int(stats["allocated_bytes"]["all"]["peak"]), int(stats["reserved_bytes"]["all"]["peak"]))
        if self.per_step:
            self._reset(self.device)
        return peaks


class _Pending:
    __slots__ = ("batch_ids", "buf", "event", "index", "indicators", "memory", "step")

    def __init__(self, step: int, buf: torch.Tensor, event: Any, memory: tuple[int, int] | None,
                 index: list[int], batch_ids: list[Any], indicators: bool = False) -> None:
        self.step, self.buf, self.event, self.memory = step, buf, event, memory
        self.index, self.batch_ids, self.indicators = index, batch_ids, indicators


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
        track_memory: MemoryPeaks | None,
    ) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.names = names
        self.exporter = exporter
        self.scaled = scaled
        self.ladder = ladder
        self.can_snapshot = can_snapshot
        self.track_memory = track_memory
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
        """The leading indicators, whose values follow the norms on sampled steps."""
        self._blocks: dict[int, str] = {}
        self.actions = Actions()
        self._pending: deque[_Pending] = deque()
        self._unexported: list[tuple[StepReport, list[Anomaly]]] = []

    # ------------------------------------------------------------------ device -> host
    def enqueue(self, step: int, payload: torch.Tensor, index: list[int], batch_ids: list[Any], *,
                indicators: bool = False) -> None:
        """Start copying ``payload`` to the host (non_blocking into pinned memory on CUDA).
        ``indicators``: the payload ends with the step's leading indicators (a sampled step)."""
        if payload.device.type == "cuda":
            buf = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
            buf.copy_(payload, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:  # a host payload is the step's own fresh tensor (cat): no copy needed
            buf, event = payload.cpu(), None
        memory = self.track_memory.read() if self.track_memory is not None else None
        self._pending.append(_Pending(step, buf, event, memory, index, batch_ids, indicators))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def idle(self) -> bool:
        """Nothing pending, nothing decoded and not yet exported or acted on: a fixed point has
        nothing to do (after a step whose report was decoded at once)."""
        a = self.actions
        return not (self._pending or self._unexported or a.reports or a.snapshots or a.abort is not None
                    or a.stop is not None or a.blocks)

    def clear_pending(self) -> None:
        self._pending.clear()

    def decode(self) -> None:
        """Turn every pending payload into records, in step order. Waits only for those copies."""
        while self._pending:
            pending = self._pending.popleft()
            if pending.event is not None:
                pending.event.synchronize()  # that step's copy only; usually done already
            values = pending.buf.tolist()
            extra: list[float] | None = None
            if pending.indicators and self.indicators is not None:  # the payload's last 2 x modules
                cut = len(values) - 2 * len(self.indicators.modules)
                values, extra = values[:cut], values[cut:]
            report, anomalies = self.build(pending.step, values, pending.index)
            if extra is not None and self.indicators is not None:
                report = self.indicators.attach(report, extra)
            if pending.memory is not None:
                report = dataclasses.replace(
                    report, memory_allocated_peak=pending.memory[0], memory_reserved_peak=pending.memory[1]
                )
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

    def export_pending(self) -> None:
        """Hand every decoded record to the exporters (local I/O only)."""
        for report, anomalies in self._unexported:
            self.exporter.export(report, anomalies)
        self._unexported.clear()

    # ------------------------------------------------------------------ building
    def build(self, step: int, values: list[float], index: list[int]) -> tuple[StepReport, list[Anomaly]]:
        d = Decision.decode(values[:DECISION_K])
        world = self.world_size
        g = values[DECISION_K : DECISION_K + world * LOCAL_K]
        rows = [g[r * LOCAL_K : (r + 1) * LOCAL_K] for r in range(world)]
        names = self.names()
        # Attribution by construction: the k-th norm belongs to parameter index[k].
        norms = [math.nan] * len(names)
        tail = DECISION_K + world * LOCAL_K
        for i, n in zip(index, values[tail:]):
            norms[i] = n
        numerics = values[tail + len(index) :]  # a sampled step's [zero fraction, headroom, per group...]
        bad_params = tuple(names[i] for i in sorted(index) if not math.isfinite(norms[i]))
        ranks = origin_ranks(rows) if world > 1 else ()
        every = self.config.param_norms_every
        want_norms = d.grad_nonfinite or (every is not None and step % every == 0)
        unknown = math.isnan(d.loss) and not d.loss_nonfinite  # NaN without the flag: no loss was given
        report = StepReport(
            step=step, skipped=d.skip, reason=d.reason, loss=None if unknown else d.loss, loss_scale=d.scale,
            next_loss_scale=d.next_scale, grad_norm=d.grad_norm, nonfinite_grads=d.nonfinite_tensors,
            nonfinite_loss=d.loss_nonfinite, nonfinite_ranks=ranks,
            clip_coef=d.clip_coef if uses_clipping(self.config) else 1.0,
            grad_spike=d.grad_spike, loss_spike=d.loss_spike, world_size=world, rank=self.rank,
            param_norms=tuple(norms) if want_norms else None, wall_time=time.time(),
            scale_backoff=d.backoff, scale_growth=d.growth,
            spike_threshold=d.spike_threshold if uses_grad_detector(self.config) else None,
            clip_threshold=d.clip_threshold if self.config.zclip else None,
        )
        if numerics:
            report = dataclasses.replace(
                report, grad_zero_fraction=numerics[0], group_zero_fractions=tuple(numerics[2:]),
                headroom_log2=numerics[1] if self.scaled else None)
        anomalies = self._anomalies(report, d, ranks, bad_params, rows)
        if self.sentinel is not None and anomalies and report.nonfinite:
            anomalies[0] = self._sentinel_named(step, anomalies[0], rows, ranks)
        return report, anomalies

    def _sentinel_named(self, step: int, first: Anomaly, rows: list[list[float]], ranks: tuple[int, ...]) -> Anomaly:
        """The first non-finite anomaly of a step, with the block (or input) the sentinel flagged
        first on the first rank where the values originated (every rank decodes the same rows)."""
        assert self.sentinel is not None  # internal: called when on
        order = [*ranks, *(r for r in range(len(rows)) if r not in ranks)]
        hit = next(((r, rows[r][Loc.SENTINEL]) for r in order if rows[r][Loc.SENTINEL] >= 0), None)
        name = self.sentinel.name(hit[1]) if hit is not None else None
        if hit is None or name is None:
            return first
        where = f" on rank {hit[0]}" if self.world_size > 1 else ""
        if name == "":
            return dataclasses.replace(first, module=None, phase=Phase.INPUT, detail=(
                f"{first.detail}. Sentinel{where}: the model's input was non-finite before any block ran"))
        self._blocks[step] = name
        return dataclasses.replace(first, module=name, phase=Phase.FORWARD, detail=(
            f"{first.detail}. Sentinel{where}: {name} is the first watched block whose output was non-finite "
            "(forensics hooks arm inside it)"))

    def _anomalies(self, report: StepReport, d: Decision, ranks: tuple[int, ...],
                   bad_params: tuple[str, ...], rows: list[list[float]]) -> list[Anomaly]:
        step, out = report.step, []
        scale_txt = ""
        if self.scaled:
            if d.backoff:
                scale_txt = f"; loss scale backed off {d.scale:g} -> {d.next_scale:g}"
            elif d.grad_nonfinite:
                scale_txt = f"; loss scale kept at {d.scale:g} (hysteresis={self.config.hysteresis})"
            elif d.skip:
                scale_txt = f"; loss scale held at {d.scale:g} (the gradients were finite)"
        where = f" on rank(s) {list(ranks)}" if ranks else ""
        if d.loss_nonfinite:
            out.append(Anomaly(step, AnomalyKind.NONFINITE_LOSS, f"loss was {d.loss}{where}; step skipped{scale_txt}",
                               ranks, bad_params[:8]))  # phase: None until forensics or the sentinel shows one
        elif d.grad_nonfinite:
            kind = AnomalyKind.OVERFLOW if self.scaled else AnomalyKind.NONFINITE_GRAD
            what = f"{d.nonfinite_tensors} gradient tensor(s) non-finite"
            if kind == AnomalyKind.OVERFLOW:
                what += f" at loss scale {d.scale:g}"
            first = f" (first: {', '.join(bad_params[:3])})" if bad_params else ""
            out.append(Anomaly(step, kind, f"{what}{first}{where}; step skipped{scale_txt}", ranks, bad_params[:8]))
        if d.no_grads:
            idle = tuple(r for r, row in enumerate(rows) if row[Loc.NO_GRADS] > 0) if self.world_size > 1 else ()
            on = f" (rank(s) {list(idle)})" if idle else ""
            held = "; loss scale held" if self.scaled else ""
            out.append(Anomaly(step, AnomalyKind.NO_GRADIENTS, "no parameter received a gradient: is the model's "
                               f"output detached?{on} Step skipped on every rank{held}", idle))
        act = "skipped" if report.skipped else "taken (on_spike='warn')"
        if report.grad_spike:
            if self.config.spike_detector == "zscore":
                what = (f"mean + {self.config.spike_zscore:g} std = {d.spike_threshold:.4g} of the last "
                        f"~{self.config.spike_window} healthy steps")
            else:
                what = f"{self.config.grad_spike_factor}x its running average"
            out.append(Anomaly(step, AnomalyKind.GRAD_SPIKE, f"gradient norm {report.grad_norm:.4g} exceeded "
                               f"{what}; step {act}", ranks))
        if report.loss_spike:
            out.append(Anomaly(step, AnomalyKind.LOSS_SPIKE, f"loss {report.loss:.4g} exceeded "
                               f"{self.config.loss_spike_factor}x its running average; step {act}", ranks))
        k = self.config.spike_warmup
        for flagged, who, did in ((d.rebaseline, "the spike detectors", "flagged"),
                                  (d.zclip_rebaseline, "ZClip", "clipped")):
            if flagged:
                out.append(Anomaly(step, AnomalyKind.REBASELINE, f"{who} {did} {k} steps in a row (spike_warmup): "
                                   "the level moved, so their statistics were re-based on those steps and the next "
                                   "steps are judged against that level"))
        if d.floor:
            out.append(Anomaly(step, AnomalyKind.SCALE_FLOOR, f"loss scale reached the floor min_scale="
                               f"{self.config.min_scale:g}: fp16 overflows persist at the smallest allowed "
                               "scale, the model likely needs bf16/fp32 or a fix", ranks))
        return out
