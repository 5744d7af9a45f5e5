"""Reading a run's JSONL event logs back into :class:`Run`: one :class:`RankLog` per rank and the
anomalies merged over the ranks that logged them (:func:`load_run`).

The reader is tolerant of a run still in progress or killed mid-way: a truncated last line is
skipped (and counted in :attr:`Run.problems`), a missing ``close`` record is fine. What is not
an ampguard event log at all (a missing path, an empty directory, a file whose first record is
not a JSON object with an ``"event"`` key) raises :class:`RunLogError`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

from ..errors import AmpGuardError
from ..records import Anomaly, StepReport
from ..vocab import SkipReason
from . import fields as R

__all__ = ["LoggedAnomaly", "NoEventsYet", "Progress", "RankLog", "Run", "RunLogError", "load_run"]

_T = TypeVar("_T")
_RECORD_START = re.compile(r'\{\s*"event"\s*:')
"""Where a record starts: ``"event"`` is every record's first key, and inside a JSON string its
quotes would be escaped, so this only matches a record's opening."""


class RunLogError(AmpGuardError, ValueError):
    """The path is not a readable ampguard event log (missing, empty, or another format)."""


class NoEventsYet(RunLogError):
    """The path exists but holds no event yet: a directory without ``*.jsonl`` files, or logs
    without a complete record (a run just starting). ``ampguard report --follow`` waits on it."""


Progress = Callable[[int, int], None]
"""``progress(done, total)``: how far :func:`load_run` got, in units of its choosing."""


class _Meter:
    """Calls ``progress(done, total)`` as reading advances, about every 0.5% (and at the end)."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.done = progress, max(total, 1), 0
        self._next = 0

    def add(self, n: float) -> None:
        if self.progress is None:
            return
        self.done = min(self.done + int(n), self.total)
        if self.done >= self._next:
            self._next = self.done + self.total // 200
            self.progress(self.done, self.total)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress(self.total, self.total)


@dataclasses.dataclass(frozen=True, slots=True)
class LoggedAnomaly(Anomaly):
    """An :class:`~ampguard.Anomaly` as logged, merged over the ranks that logged it (each rank logs
    the same decision). ``ranks`` are the ranks where it originated (``()`` on one process)."""

    reason: SkipReason | None = None
    """The step's skip reason (None when the step was not skipped)."""
    logged_by: tuple[int, ...] = ()
    """Ranks whose log holds this anomaly."""


class _Column(Generic[_T]):
    """A read-only view of one :class:`~ampguard.StepReport` field over ``RankLog.reports``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, log: None, owner: type) -> _Column[_T]: ...

    @overload
    def __get__(self, log: RankLog, owner: type | None = None) -> list[_T]: ...

    def __get__(self, log: RankLog | None, owner: type | None = None) -> list[_T] | _Column[_T]:
        return self if log is None else [getattr(r, self.name) for r in log.reports]


@dataclasses.dataclass(slots=True)
class RankLog:
    """One rank's step series, ordered by step (one report per step; later records win)."""

    rank: int
    paths: list[Path] = dataclasses.field(default_factory=list)
    reports: list[StepReport] = dataclasses.field(default_factory=list)
    closed: bool = False
    """A ``close`` record was seen (the run ended cleanly on this rank)."""
    close_steps: int | None = None
    """Steps the rank reported, from its ``close`` record."""
    every_step: bool = False
    """Healthy steps are logged too (``JsonlExporter(every_step=True)``); otherwise only skipped ones."""

    # Column views, for plotting and tests: ``log.loss`` is ``[r.loss for r in log.reports]``.
    step = _Column[int]()
    loss = _Column[float]()
    loss_scale = _Column[float]()
    grad_norm = _Column[float]()
    skipped = _Column[bool]()
    reason = _Column[SkipReason | None]()
    nonfinite_grads = _Column[int]()

    @property
    def steps_seen(self) -> int:
        """Steps this rank reported: the ``close`` count, else one past the last step logged."""
        last = self.reports[-1].step + 1 if self.reports else 0
        return max(last, self.close_steps or 0)


@dataclasses.dataclass(slots=True)
class Run:
    """A run read back from its event logs."""

    path: Path
    info: dict[str, Any]
    """The ``run`` record (run_id, world_size, precision, backend, device, param_names, versions)."""
    ranks: dict[int, RankLog]
    anomalies: list[LoggedAnomaly]
    problems: list[str] = dataclasses.field(default_factory=list)
    """What was skipped or looked wrong while reading (truncated last line, missing ranks...)."""
    other_runs: list[str] = dataclasses.field(default_factory=list)
    """Run ids also present in the logs but not read (see ``load_run(run_id=...)``)."""

    @property
    def run_id(self) -> str:
        return str(self.info.get("run_id", "?"))

    @property
    def world_size(self) -> int:
        return int(self.info.get("world_size", len(self.ranks) or 1))

    @property
    def closed(self) -> bool:
        return bool(self.ranks) and all(r.closed for r in self.ranks.values())


# ---------------------------------------------------------------------------------- what the steps say
def decided_steps(run: Run) -> dict[int, StepReport]:
    """One report per step logged on any rank, by step: the decision is the same on every rank, so
    skips are counted over the union of the steps the ranks logged."""
    decided: dict[int, StepReport] = {}
    for log in run.ranks.values():
        for r in log.reports:
            decided.setdefault(r.step, r)
    return decided


def origins(r: StepReport, rank: int, world: int) -> tuple[int, ...]:
    """The ranks a step's non-finite values came from, as seen in ``rank``'s report."""
    if r.nonfinite_ranks:
        return r.nonfinite_ranks
    return (rank,) if world == 1 else ()


# ---------------------------------------------------------------------------------- records
def _merge_anomaly(merged: dict[tuple[int, str], dict[str, Any]], fields: dict[str, Any], rank: int) -> None:
    """Fold one rank's anomaly (:func:`records.anomaly_fields`) into ``merged``."""
    key = (fields["step"], str(fields["kind"]))
    origin = rank in fields["ranks"]
    cur = merged.get(key)
    if cur is None:
        merged[key] = {**fields, "logged_by": {rank}, "_origin": origin}
        return
    cur["logged_by"].add(rank)
    if origin and not cur["_origin"]:
        # The rank the fault came from localised it on its own data: its diagnosis wins.
        merged[key] = {**fields, "logged_by": cur["logged_by"], "_origin": True}
        return
    for name in ("module", "phase", "cause"):  # keep what any rank knew
        if cur.get(name) is None and fields.get(name) is not None:
            cur[name] = fields[name]


def _anomaly(merged: dict[str, Any]) -> LoggedAnomaly:
    fields = {k: v for k, v in merged.items() if k != "_origin"}
    return LoggedAnomaly(**{**fields, "logged_by": tuple(sorted(fields["logged_by"]))})


# ---------------------------------------------------------------------------------- files
def _read_file(path: Path, problems: list[str], strict: bool, meter: _Meter) -> list[dict[str, Any]] | None:
    """The records of one file; None (with a problem noted) or RunLogError when it is not an event log."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise RunLogError(f"cannot read {path}: {e.strerror or e}") from None
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    complete = text.endswith("\n")
    records: list[dict[str, Any]] = []
    first = True
    for i, line in enumerate(lines, start=1):
        meter.add(len(line) + 1)
        if not line.strip():
            continue
        is_last = i == len(lines) or (i == len(lines) - 1 and complete)
        rec = R.parse_line(line)
        if rec is None and not (is_last and not complete):
            rec = _after_torn_record(line)
            if rec is not None:
                # A run killed (or out of disk) mid-write, and the next run appended to the same
                # file without ending that line: the fragment is lost, the record after it is not.
                problems.append(f"{path}: line {i} starts with a torn record (a run killed or out of disk "
                                "mid-write); kept the record written after it")
                first = False
                records.append(rec)
                continue
        if first and rec is None:
            if is_last and not complete and len(lines) == 1:
                # A log whose very first line is still being written: nothing to read yet.
                problems.append(f"{path}: only a partial first line (run just starting?); skipped")
                return []
            msg = f"{path} is not an ampguard event log (line {i} is not a JSON object with an 'event' key)"
            if strict:
                raise RunLogError(msg)
            problems.append(msg + "; skipped")
            return None
        first = False
        if rec is None:
            if is_last and not complete:
                problems.append(f"{path}: last line is truncated (run in progress or killed); skipped")
            else:
                problems.append(f"{path}: line {i} is not a valid event record; skipped")
            continue
        records.append(rec)
    return records


def _after_torn_record(line: str) -> dict[str, Any] | None:
    """The whole record that follows a torn one on ``line``, if any (a few tries: a line of
    thousands of record openings is damage, not a torn record)."""
    for _, m in zip(range(8), _RECORD_START.finditer(line, 1)):
        rec = R.parse_line(line[m.start():])
        if rec is not None:
            return rec
    return None


def _files(path: Path) -> tuple[list[Path], bool]:
    if not path.exists():
        raise RunLogError(f"{path}: no such file or directory")
    if path.is_file():
        return [path], True
    if not path.is_dir():
        raise RunLogError(f"{path} is neither a file nor a directory")
    files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
    if not files:  # e.g. runs/<id>/ holding the logs one level down, next to TensorBoard's
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
    if not files:
        raise NoEventsYet(f"{path}: no *.jsonl event logs in this directory")
    return files, False


_Records = dict[int, list[tuple[Path, dict[str, Any]]]]
"""One run's records: rank -> (file, record), in file order."""


@dataclasses.dataclass
class _Runs:
    """What the files hold, by run id ("run" records tell which run the lines after them belong to)."""

    records: dict[str, _Records] = dataclasses.field(default_factory=dict)
    infos: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Each run's first ``run`` record, plus ``ranks_opened``: the ranks that wrote one."""
    opened: dict[str, float] = dataclasses.field(default_factory=dict)
    """When each run was last opened (its latest ``run`` record's time)."""


def _group(root: Path, files: list[Path], single: bool, problems: list[str], meter: _Meter) -> _Runs:
    runs = _Runs()
    any_log = False
    for file in files:
        records = _read_file(file, problems, strict=single or len(files) == 1, meter=meter)
        if records is None:
            continue
        any_log = True
        current: str | None = None
        for rec in records:
            if rec["event"] == "run":
                rec = R.run_info(rec, problems, str(file))
                current = str(rec.get("run_id", "?"))
                info = runs.infos.setdefault(current, dict(rec))
                info.setdefault("ranks_opened", set()).add(rec.get("rank", 0))
                runs.opened[current] = max(runs.opened.get(current, -math.inf), rec.get("time", 0.0))
                continue
            try:
                rank = R.rank_of(rec)
            except R.BadRecord as e:
                problems.append(f"{file}: a {rec['event']!r} record's {e}; skipped")
                continue
            if current is None:
                current = "?"
                problems.append(f"{file}: no 'run' record before the first event (log started mid-run?)")
                runs.infos.setdefault(current, {"run_id": current})
                runs.opened.setdefault(current, -math.inf)
            runs.records.setdefault(current, {}).setdefault(rank, []).append((file, rec))
    if not any_log:
        raise RunLogError(f"{root}: no ampguard event log among {len(files)} *.jsonl file(s)")
    if not runs.infos:
        raise NoEventsYet(f"{root}: the event log holds no records yet")
    return runs


def _choose(root: Path, runs: _Runs, run_id: str | None, problems: list[str]) -> tuple[str, list[str]]:
    """The run to read (``run_id``, by default the one opened last) and the others."""
    if run_id is None:
        chosen = max(runs.infos, key=lambda k: runs.opened.get(k, -math.inf))
    elif run_id in runs.infos:
        chosen = run_id
    else:
        raise RunLogError(f"{root}: no run {run_id!r} in the logs (runs: {', '.join(sorted(runs.infos))})")
    others = sorted(k for k in runs.infos if k != chosen)
    if others:
        problems.append(f"the logs also hold {len(others)} other run(s) ({', '.join(others)}); "
                        f"reading {chosen} (choose with --run-id)")
    return chosen, others


def _rank_logs(records: _Records, problems: list[str], meter: _Meter) -> tuple[dict[int, RankLog], list[LoggedAnomaly]]:
    """One run's records as a step series per rank, and its anomalies merged over ranks."""
    ranks: dict[int, RankLog] = {}
    unit = (meter.total - meter.done) / max(sum(map(len, records.values())), 1)
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for rank, recs in sorted(records.items()):
        log = ranks.setdefault(rank, RankLog(rank))
        by_step: dict[int, StepReport] = {}
        for file, rec in recs:
            meter.add(unit)
            if file not in log.paths:
                log.paths.append(file)
            event = rec["event"]
            try:
                if event in ("step", "skipped"):
                    report = R.step_report(rec)
                    log.every_step |= event == "step"
                    by_step[report.step] = report
                elif event == "anomaly":
                    fields = R.anomaly_fields(rec)
                    if "report" in rec:
                        by_step.setdefault(fields["step"], R.step_report(rec["report"]))
                    _merge_anomaly(merged, fields, rank)
                elif event == "close":
                    steps = R.integer(rec.get("steps", 0), "steps")
                    log.closed, log.close_steps = True, steps
                elif event == "torn_line":
                    problems.append(f"{file}: {R.text(rec.get('detail', 'a torn line was ended'), 'detail')}")
            except R.BadRecord as e:
                problems.append(f"{file}: a {event!r} record's {e}; skipped")
        log.reports = [by_step[s] for s in sorted(by_step)]
    anomalies = sorted((_anomaly(v) for v in merged.values()), key=lambda a: (a.step, a.kind))
    return ranks, anomalies


def load_run(path: str | os.PathLike[str], *, run_id: str | None = None, progress: Progress | None = None) -> Run:
    """Read a run from a directory (every ``*.jsonl`` in it: one file per rank) or one ``.jsonl`` file.

    Logs are append-only, so one file may hold several runs: the run ``run_id`` is read, by
    default the one opened last (the others are listed in :attr:`Run.other_runs`).
    Raises :class:`RunLogError` for a missing path, a directory without event logs, or a file
    that is not an ampguard event log (:class:`NoEventsYet` where the path exists but holds no
    event yet). Reads files only; no torch, no device.

    ``progress(done, total)``, when given, is called as reading advances (the bytes read, then the
    records turned into reports, in one count; ``done == total`` at the end): a large log takes
    seconds (``ampguard report`` draws a progress bar from it).
    """
    root = Path(path)
    files, single = _files(root)
    problems: list[str] = []
    size = sum(f.stat().st_size for f in files)
    meter = _Meter(progress, 2 * size)  # reading the bytes, then turning the records into reports
    runs = _group(root, files, single, problems, meter)
    chosen, others = _choose(root, runs, run_id, problems)
    info = runs.infos[chosen]
    ranks_opened: set[int] = info.pop("ranks_opened", set())
    meter.done = max(meter.done, size)  # the other runs' records are not converted
    ranks, anomalies = _rank_logs(runs.records.get(chosen, {}), problems, meter)
    meter.finish()
    for rank in sorted(ranks_opened - set(ranks)):
        ranks[rank] = RankLog(rank, paths=[])
    ranks = dict(sorted(ranks.items()))
    world = int(info.get("world_size", 1) or 1)
    missing = sorted(set(range(world)) - set(ranks))
    if missing and not single:
        problems.append(f"no log for rank(s) {', '.join(map(str, missing))} of world_size {world}")
    return Run(path=root, info=info, ranks=ranks, anomalies=anomalies, problems=problems, other_runs=others)
