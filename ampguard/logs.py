"""The guard speaks through Python :mod:`logging`: the logger ``"ampguard"``.

Library convention: ampguard adds no handler and sets no level on it; your logging configuration
decides what is shown. With none at all, Python's last-resort handler prints WARNING and above to
stderr, so a run in trouble is never silent; ``logging.basicConfig(level=logging.INFO)`` also
shows the INFO messages (loss-scale overflows, the run's summary at ``close()``).

:class:`Voice` hears every decoded report at the guard's fixed points (``Outcome.settle``,
``flush``), never where a report is read, and says, once each and rate-limited:

- every anomaly, at a level by kind (:data:`LEVELS`), with step, rank and what to do; the same kind
  again at most once per :data:`REPEAT_EVERY` steps (with a count of those not shown);
- the loss scale reaching its floor (the ``scale_floor`` anomaly, ERROR);
- more than :data:`SKIP_RATE` of the last :data:`SKIP_WINDOW` steps skipped (WARNING);
- half of ``GuardConfig.max_consecutive_skips`` skipped steps in a row (WARNING), before the
  :class:`~ampguard.NonFiniteError` at the limit;
- forensics' findings (module, phase, cause), once per finding;
- the loss the guard never saw, and an autocast dtype that disagrees with the guard's precision
  (also as a ``warnings.warn``), once per run.

The shared decisions are logged by rank 0 only (every rank holds the same reports; the messages
name the ranks where a value originated); which rank speaks is decided once, at construction.
A healthy step costs one attribute store and one test here: nothing is formatted unless
something happened, and nothing reads the device.

:meth:`Voice.summary` is the run as ``ampguard report`` prints it
(:func:`ampguard.runlog.summary`). Its counts are kept exactly as the reports are heard; the
reports themselves (the skipped, anomalous and scale-changing ones) only the first and the last
:data:`KEEP` of them, and the last :data:`KEEP` anomalies: a long run of skipped steps keeps the
voice's memory flat.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from .metrics import LOSS
from .records import SKIP_REASONS, Anomaly, RunInfo, StepReport
from .vocab import AnomalyKind, Cause, Phase, SkipReason

__all__ = ["KEEP", "LEVELS", "REPEAT_EVERY", "SKIP_RATE", "SKIP_WINDOW", "Voice", "advice_for", "found_advice",
           "latest_found_advice", "logger", "tally"]

logger = logging.getLogger("ampguard")
"""The library's logger (no handler, no level of its own)."""

SKIP_WINDOW = 100
"""Steps over which the skip rate is judged (the judgement starts once that many were reported)."""
SKIP_RATE = 0.25
"""Skip rate over :data:`SKIP_WINDOW` steps above which a WARNING is logged. An fp16 warm-up from
GradScaler's initial scale 65536 skips up to ~16-20 steps while the scale calibrates: below it."""
REPEAT_EVERY = 100
"""Steps between two messages of one kind (the first of each kind is always logged)."""
KEEP = 64
"""Notable reports (besides the first) and anomalies the voice keeps for the summary's tables: the last ones."""

LEVELS: dict[str, int] = {
    AnomalyKind.NONFINITE_LOSS: logging.WARNING,
    AnomalyKind.NONFINITE_GRAD: logging.WARNING,
    # fp16: the loss scale doing its job (an overflow backs it off); too many of them show as a
    # skip rate over SKIP_RATE, or as the scale reaching its floor.
    AnomalyKind.OVERFLOW: logging.INFO,
    AnomalyKind.GRAD_SPIKE: logging.WARNING,
    AnomalyKind.LOSS_SPIKE: logging.WARNING,
    AnomalyKind.SCALE_FLOOR: logging.ERROR,
    AnomalyKind.RANK_DIVERGENCE: logging.ERROR,
    AnomalyKind.ROLLBACK: logging.WARNING,
    AnomalyKind.ABORT: logging.ERROR,
    AnomalyKind.NO_GRADIENTS: logging.ERROR,
    AnomalyKind.FP8_NONFINITE: logging.WARNING,
}
"""Level of each anomaly kind's message."""

ADVICE: dict[str, str] = {
    AnomalyKind.NONFINITE_LOSS: "the loss itself was NaN/inf, so no loss scale helps: check this batch and the "
                                "loss (a log of 0, a division by 0, labels out of range); opt.quarantine holds the "
                                "batch_ids of such steps",
    AnomalyKind.NONFINITE_GRAD: "a gradient went NaN/inf: wrap(model=...) lets forensics name the module; lower the "
                                "learning rate or fix the input if it persists",
    AnomalyKind.OVERFLOW: "an fp16 overflow at this loss scale: the scale backs off; occasional ones are normal",
    AnomalyKind.GRAD_SPIKE: "a gradient-norm spike: look at this step's batch; clip_grad_norm or zclip bound it",
    AnomalyKind.LOSS_SPIKE: "a loss spike: look at this step's batch and the learning rate",
    AnomalyKind.SCALE_FLOOR: "fp16 overflows at the smallest loss scale allowed: this run will not learn in fp16 "
                             "as it is; train in bf16 (precision='bf16') or fp32, or find the overflowing module "
                             "(wrap(model=...), opt.anomalies)",
    AnomalyKind.RANK_DIVERGENCE: "ranks disagree: check that every rank runs the same code and data order",
    AnomalyKind.ROLLBACK: "restored the last good snapshot; if it keeps happening, lower the learning rate",
    AnomalyKind.ABORT: "training stops: read the diagnosis and opt.anomalies",
    AnomalyKind.NO_GRADIENTS: "the loss reached none of the optimizer's parameters: is the optimizer built on this "
                              "model's parameters (model.parameters() of the model that computed the loss)? Is the "
                              "output detached (.detach(), torch.no_grad(), .item())?",
    AnomalyKind.FP8_NONFINITE: "one non-finite element poisons a whole fp8 cast (torchao scales by max/amax): "
                               "find where the NaN/Inf entered (GuardConfig(sentinel='top'), wrap(model=...)); if it "
                               "keeps coming from one layer, keep that layer in bf16 (convert_to_float8_training's "
                               "module_filter_fn)",
}
"""What to do about each anomaly kind (appended to its message)."""

KIND_OF_REASON: dict[str, str] = {SkipReason.NONFINITE_LOSS: AnomalyKind.NONFINITE_LOSS,
                                   SkipReason.NO_GRADIENTS: AnomalyKind.NO_GRADIENTS,
                                   SkipReason.NONFINITE_FP8: AnomalyKind.FP8_NONFINITE,
                                   SkipReason.GRAD_SPIKE: AnomalyKind.GRAD_SPIKE,
                                   SkipReason.LOSS_SPIKE: AnomalyKind.LOSS_SPIKE}
"""The anomaly kind whose advice fits a skip reason (non-finite gradients otherwise)."""


def found_advice(anomaly: Anomaly) -> str | None:
    """What to do about where forensics localised non-finite values, where that says more than the anomaly kind's
    advice (:data:`ADVICE`): a module's forward that overflows in the run's low precision and is finite in fp32
    (no loss scale reaches it: the scale multiplies the loss after the forward), one that is non-finite in fp32
    too (its own math or its input), or a module's backward that made NaN/inf of a finite gradient (a derivative
    with no finite value there, or grown values: the learning rate, an unbounded update). None otherwise (a backward
    overflow is the loss scale's to handle)."""
    if anomaly.module is None or anomaly.kind == AnomalyKind.FP8_NONFINITE:
        return None
    if anomaly.phase == Phase.BACKWARD and anomaly.cause == Cause.NAN:
        return (f"module {anomaly.module}'s backward turned a finite incoming gradient into NaN/inf: its math has "
                "no finite derivative there (a square root or a norm at 0, a division by a value near 0), or what it "
                "saved in the forward or its weights have grown (a learning rate too high: lower it, or bound the "
                "update with clip_grad_norm or zclip)")
    if anomaly.phase != Phase.FORWARD:
        return None
    if anomaly.cause == Cause.OVERFLOW:
        return (f"module {anomaly.module}'s forward overflows in low precision and is finite in fp32 (forensics "
                "recomputed it), so no loss scale helps: the scale multiplies the loss after the forward. Run that "
                "module outside autocast (in fp32), or train in bf16 (precision='bf16'); if it is new, find what grew "
                "there (its weights or its inputs: a learning rate too high grows them)")
    if anomaly.cause == Cause.NAN:
        return (f"module {anomaly.module}'s forward is non-finite in fp32 too: its own math (a log of 0, a division "
                "by 0, a square root of a negative) or its input; check that module and this batch")
    return None


def latest_found_advice(anomalies: Sequence[Anomaly]) -> str | None:
    """:func:`found_advice` of the latest of ``anomalies`` that forensics localised to a module (an fp8 anomaly's
    module is where the fp8 monitor saw the cast, not a finding); None where there is none, or it has no advice."""
    for anomaly in reversed(anomalies):
        if anomaly.module is not None and anomaly.kind != AnomalyKind.FP8_NONFINITE:
            return found_advice(anomaly)
    return None


def advice_for(reason: object, anomalies: Sequence[Anomaly] = ()) -> str:
    """What to do about a run of skipped steps, the last one skipped for ``reason`` (a :class:`SkipReason`):
    :func:`latest_found_advice` of ``anomalies`` (the run's), where it has advice; else the advice of the anomaly
    kind that fits ``reason``. Before stop 68 it was always the latter: a lasting fp16 overflow in an attention's
    forward (a non-finite loss on every step) was told to check the batch and the loss for a log of 0, while
    forensics had named the attention."""
    return latest_found_advice(anomalies) or ADVICE[KIND_OF_REASON.get(str(reason), AnomalyKind.NONFINITE_GRAD)]


_MEMORY = Path("(this process: opt.summary())")


def tally(keys: Iterable[object]) -> str:
    """``"nonfinite_grad 3, grad_spike 1"``: how often each key occurs, most frequent first (ties:
    first seen first); ``""`` for none."""
    return ", ".join(f"{k} {n}" for k, n in Counter(str(k) for k in keys).most_common())


@dataclasses.dataclass(slots=True)
class _Counts:
    """What the summary counts over the reports the voice heard (runlog's rank summary, exactly)."""

    logged: int = 0
    skipped: int = 0
    by_reason: Counter[str] = dataclasses.field(default_factory=Counter)
    loss_steps: int = 0
    grad_steps: int = 0
    grad_tensors: int = 0
    scale_min: float = math.inf
    scale_max: float = -math.inf

    def add(self, r: StepReport, rank: int, world: int) -> None:
        self.logged += 1
        if r.skipped:
            self.skipped += 1
            self.by_reason[str(r.reason)] += 1
        if (rank in r.nonfinite_ranks) if r.nonfinite_ranks else world == 1:  # runlog.reading.origins
            self.loss_steps += bool(r.nonfinite_loss)
            self.grad_steps += r.nonfinite_grads > 0
            self.grad_tensors += r.nonfinite_grads
        for s in (r.loss_scale, r.next_loss_scale):
            if math.isfinite(s):
                self.scale_min, self.scale_max = min(self.scale_min, s), max(self.scale_max, s)


@dataclasses.dataclass(slots=True)
class _Said:
    """One message kind's rate limit: the step it was last logged at, and how many were held back."""

    step: int
    held: int = 0


class Voice:
    """What the guard tells the ``ampguard`` logger, and the run's summary. See the module docstring."""

    def __init__(self, *, rank: int, world_size: int, precision: str, scaled: bool,
                 max_consecutive_skips: int | None) -> None:
        self.rank, self.world_size = rank, world_size
        self.speaks = rank == 0
        """The shared decisions are logged by rank 0 only (decided once)."""
        self.precision, self.scaled = precision, scaled
        self.limit = max_consecutive_skips
        self.first: StepReport | None = None
        self.kept: deque[StepReport] = deque(maxlen=KEEP)
        """The last :data:`KEEP` notable reports after the first: skipped, anomalous or
        scale-changing ones (stripped of per-parameter values)."""
        self.counts = _Counts()
        """Counted over the first and every notable report."""
        self.anomalies: deque[tuple[Anomaly, SkipReason | None]] = deque(maxlen=KEEP)
        self.kinds: Counter[str] = Counter()
        """Anomalies heard, by kind."""
        self.last: StepReport | None = None
        self.consecutive = 0
        self._skips: deque[tuple[int, str]] = deque()
        """Step and reason of the skips within the last :data:`SKIP_WINDOW` steps."""
        self._said: dict[Any, _Said] = {}
        self._findings: set[tuple[Any, ...]] = set()
        self._warned: set[str] = set()
        self.dtype_checked = False
        """The first loss's activation dtype was checked (:meth:`check_activation_dtype`): callers skip
        the call after it (one attribute read on the loop's hot path)."""

    # ------------------------------------------------------------------ hearing reports (fixed points)
    def hear(self, decoded: Iterable[tuple[StepReport, list[Anomaly]]]) -> None:
        """Fold the reports about to be exported in, in step order, and say what they call for."""
        for report, anomalies in decoded:
            self.last = report
            if anomalies or report.skipped or report.scale_backoff or report.scale_growth or self.first is None:
                self._notable(report, anomalies)
            elif self.consecutive:
                self.consecutive = 0

    def _notable(self, report: StepReport, anomalies: list[Anomaly]) -> None:
        stripped = dataclasses.replace(report, param_norms=None, group_zero_fractions=None,
                                       module_grad_norms=None, module_update_ratios=None)
        if self.first is None:
            self.first = stripped
        else:
            self.kept.append(stripped)
        self.counts.add(report, self.rank, self.world_size)
        for anomaly in anomalies:
            self.anomalies.append((anomaly, report.reason))
            self.kinds[str(anomaly.kind)] += 1
            self._say_anomaly(anomaly, report)
        if not report.skipped:
            self.consecutive = 0
            return
        if report.reason != SkipReason.ROLLBACK:
            self.consecutive += 1
        step = report.step
        skips = self._skips
        skips.append((step, str(report.reason)))
        while skips[0][0] <= step - SKIP_WINDOW:
            skips.popleft()
        if step + 1 >= SKIP_WINDOW and len(skips) > SKIP_RATE * SKIP_WINDOW:
            self._say("skip_rate", step, logging.WARNING, lambda: (
                f"{len(skips)} of the last {SKIP_WINDOW} steps were skipped (over {SKIP_RATE:.0%}; "
                f"{tally(reason for _, reason in skips)}). The run learns from few of its batches: look at "
                "opt.anomalies (or `ampguard report` on its event log) for where it started"))
        if self.limit is not None and self.consecutive == max(1, self.limit // 2) and self.consecutive < self.limit:
            self._say("consecutive", step, logging.WARNING, lambda: (
                f"{self.consecutive} steps in a row skipped (last: {report.reason}); training stops with "
                f"NonFiniteError at {self.limit} (GuardConfig.max_consecutive_skips). What to do: "
                f"{advice_for(report.reason, [a for a, _ in self.anomalies if a.step > step - self.consecutive])}"))

    def _say_anomaly(self, anomaly: Anomaly, report: StepReport) -> None:
        kind = str(anomaly.kind)
        where = f" (from rank(s) {list(anomaly.ranks)})" if anomaly.ranks else ""
        found = found_advice(anomaly)  # where forensics localised it: about that module, not the kind in general
        advice = found or ADVICE.get(kind)
        said = self._say(kind, anomaly.step, LEVELS.get(kind, logging.WARNING),
                         lambda: f"{kind}{where}: {anomaly.detail}" + (f". What to do: {advice}" if advice else ""))
        if (anomaly.module is not None or anomaly.cause is not None) and kind != AnomalyKind.FP8_NONFINITE:
            # (an fp8 anomaly's module is where the fp8 monitor saw the cast, not a forensics finding)
            key = (anomaly.module, anomaly.phase, anomaly.cause)
            if key not in self._findings:
                self._findings.add(key)
                # the finding's advice, unless the anomaly's message said it just now (an anomaly of a kind said in
                # the last REPEAT_EVERY steps is held back, and its finding is then where the advice is read)
                tail = f". What to do: {found}" if found and not said else ""
                self._log(logging.WARNING, anomaly.step,
                          f"forensics found where the first non-finite value arose: module {anomaly.module or '-'}, "
                          f"phase {anomaly.phase or '-'}, cause {anomaly.cause or '-'} (first seen on this step; "
                          "opt.anomalies has every step it explains)" + tail)

    def _say(self, key: Any, step: int, level: int, message: str | Callable[[], str]) -> bool:
        """Log ``message`` (made only when logged) unless ``key`` was logged less than
        :data:`REPEAT_EVERY` steps ago. Returns whether it was logged (held back: False)."""
        said = self._said.get(key)
        if said is not None and step - said.step < REPEAT_EVERY:
            said.held += 1
            return False
        text = message if isinstance(message, str) else message()
        if said is not None and said.held:
            text += f" [{said.held} more like it since step {said.step} not shown]"
        self._said[key] = _Said(step)
        self._log(level, step, text)
        return True

    def say_stop(self, error: BaseException, step: int) -> None:
        """Training stops (the error raised at this fixed point): said at ERROR, always."""
        self._log(logging.ERROR, step, f"training stops: {error}")

    def _log(self, level: int, step: int, message: str) -> None:
        if self.speaks and logger.isEnabledFor(level):
            where = f"rank {self.rank}" if self.world_size > 1 else "rank 0"
            logger.log(level, "step %d, %s: %s", step, where, message,
                       extra={"ampguard_step": step, "ampguard_rank": self.rank})

    # ------------------------------------------------------------------ loop mismatches (warned once)
    def warn_once(self, key: str, step: int, message: str, *, stacklevel: int) -> None:
        """A mismatch between the loop and the guard: logged (WARNING) and ``warnings.warn`` once per run."""
        if key in self._warned:
            return
        self._warned.add(key)
        self._log(logging.WARNING, step, message)
        warnings.warn(f"ampguard: {message}", RuntimeWarning, stacklevel=stacklevel + 1)

    def no_loss(self, step: int, *, stacklevel: int) -> None:
        """``step()`` with no loss given for it (a backward the guard did not run): said once per run."""
        if "no_loss" not in self._warned:
            self.warn_once("no_loss", step,
                           "step() on gradients from a backward the guard did not see, and no loss was given: every "
                           "report's loss is unknown (None), and the loss curve, the loss-spike detector and "
                           f"{LOSS.name} have nothing to show. Call opt.backward(loss) instead of loss.backward() / "
                           "scaler.scale(loss).backward(), or give the loss with opt.observe_loss(loss)",
                           stacklevel=stacklevel + 1)

    def check_activation_dtype(self, loss: torch.Tensor, device_type: str, expected: torch.dtype, step: int,
                               *, stacklevel: int) -> None:
        """On the first loss given to the guard: does the loop's autocast run a low-precision dtype
        other than the guard's? Read from the autocast state, the loss's dtype and the dtypes the
        loss's autograd graph carries near the loss (host metadata only: no sync). Once per run."""
        if self.dtype_checked:
            return
        self.dtype_checked = True
        seen = _activation_dtype(loss, device_type)
        if seen is None or seen == expected:
            return
        name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[seen]
        if seen == torch.float16:
            fix = ("wrap(..., precision='fp16') (the guard makes a GradScaler, or pass yours), or autocast with "
                   "dtype=torch.bfloat16")
            risk = "fp16 activations without loss scaling: small gradients underflow to zero and nothing scales them"
        else:
            fix = "wrap(..., precision='bf16') with no GradScaler, or autocast with dtype=torch.float16"
            risk = "the guard's fp16 rules (loss scaling, overflow backoff) run on a bf16 loop"
        self.warn_once("autocast_dtype", step,
                       f"the loop's autocast runs {name} but the guard runs precision={self.precision!r}: {risk}. "
                       f"Fix: {fix}", stacklevel=stacklevel + 1)

    # ------------------------------------------------------------------ the run's summary
    def summary(self, info: RunInfo, steps: int, closed: bool) -> Any:
        """The run as ``ampguard report`` summarises it (:class:`ampguard.runlog.RunSummary`),
        from the reports heard so far: every count exact; its anomalies are the last :data:`KEEP`.
        ``steps``: ``step()`` calls so far."""
        from .runlog.reading import LoggedAnomaly, RankLog, Run
        from .runlog.summary import summary

        reports = [r for r in (self.first, *self.kept) if r is not None]
        counts = dataclasses.replace(self.counts, by_reason=Counter(self.counts.by_reason))
        if self.last is not None and (not reports or reports[-1].step != self.last.step):
            reports.append(self.last)
            counts.add(self.last, self.rank, self.world_size)
        log = RankLog(self.rank, reports=reports, closed=closed, close_steps=steps)
        fields = [f.name for f in dataclasses.fields(Anomaly)]
        anomalies = [LoggedAnomaly(**{n: getattr(a, n) for n in fields}, reason=reason, logged_by=(self.rank,))
                     for a, reason in self.anomalies]
        facts = {"run_id": info.run_id, "world_size": info.world_size, "precision": info.precision,
                 "backend": info.backend, "device": info.device, "versions": dict(info.versions)}
        result = summary(Run(path=_MEMORY, info=facts, ranks={self.rank: log}, anomalies=anomalies))
        scaled = counts.logged and counts.scale_min <= counts.scale_max
        rank = dataclasses.replace(
            result.ranks[self.rank], logged_steps=counts.logged, skipped=counts.skipped,
            scale_min=counts.scale_min if scaled else None, scale_max=counts.scale_max if scaled else None,
            nonfinite_loss_steps=counts.loss_steps, nonfinite_grad_steps=counts.grad_steps,
            nonfinite_grad_tensors=counts.grad_tensors)
        order = [k for k in SKIP_REASONS if k in counts.by_reason] + sorted(
            k for k in counts.by_reason if k not in SKIP_REASONS)
        return dataclasses.replace(result, skipped=counts.skipped, ranks={self.rank: rank},
                                   skipped_by_reason={k: counts.by_reason[k] for k in order},
                                   anomalies_by_kind=dict(self.kinds))

    def say_summary(self, text: str, step: int) -> None:
        self._log(logging.INFO, step, "run summary\n" + text)


def _activation_dtype(loss: torch.Tensor, device_type: str) -> torch.dtype | None:
    """A low-precision dtype (float16/bfloat16) the loop computes in, if one shows: the autocast
    dtype when autocast is on around this call, the loss's own dtype, or the first low-precision
    dtype among the outputs of the autograd nodes nearest the loss (at most 64 of them)."""
    low = (torch.float16, torch.bfloat16)
    try:
        if torch.is_autocast_enabled(device_type):
            autocast = torch.get_autocast_dtype(device_type)
            if autocast in low:
                return autocast
    except (RuntimeError, TypeError, AttributeError):  # an autocast device type torch does not know
        pass
    if loss.dtype in low:
        return loss.dtype
    nodes, seen, todo = 0, set(), [loss.grad_fn]
    while todo and nodes < 64:
        node = todo.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes += 1
        for meta in getattr(node, "_input_metadata", ()):  # torch's per-node output metadata (host only)
            dtype = getattr(meta, "dtype", None)
            if dtype in low:
                return dtype  # type: ignore[no-any-return]
        todo.extend(f for f, _ in node.next_functions)
    return None
