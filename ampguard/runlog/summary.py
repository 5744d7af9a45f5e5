"""A run in numbers: :func:`summary` (a :class:`RunSummary`) and :func:`format_summary` (the tables
``ampguard report`` prints); ``RunSummary.to_dict()`` is what ``ampguard report --json`` prints."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..records import SKIP_REASONS, _jsonable
from .reading import LoggedAnomaly, RankLog, Run, decided_steps, origins

__all__ = ["RankSummary", "RunSummary", "format_summary", "rich_summary", "summary"]

_RUN_FACTS = ("run_id", "world_size", "precision", "backend", "device", "versions")


@dataclasses.dataclass(frozen=True, slots=True)
class RankSummary:
    """One rank's part of a :class:`RunSummary`."""

    steps: int
    """Steps the rank reported (its ``close`` count, else one past the last step it logged)."""
    logged_steps: int
    """Steps its log holds a report for (only the skipped ones without ``every_step``)."""
    skipped: int
    """Skipped steps among the logged ones."""
    scale_min: float | None
    """Smallest finite loss scale it logged (before or after a step); None when it logged none."""
    scale_max: float | None
    """Largest finite loss scale it logged; None when it logged none."""
    scale_last: float | None
    """The scale after its last logged step; None without a logged step."""
    loss_last: float | None
    """The loss of its last logged step; None without a logged step."""
    nonfinite_loss_steps: int
    """Steps whose non-finite loss originated on this rank."""
    nonfinite_grad_steps: int
    """Steps whose non-finite gradients originated on this rank."""
    nonfinite_grad_tensors: int
    """Non-finite gradient tensors over the steps whose non-finite values originated on this rank."""
    closed: bool
    """Its log holds a ``close`` record (the run ended cleanly on this rank)."""
    every_step: bool
    """Healthy steps are logged too, not only skipped ones."""
    files: tuple[str, ...]
    """The log files it was read from."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (non-finite floats as "nan"/"inf"/"-inf", tuples as lists)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, slots=True)
class RunSummary:
    """A run in numbers (what ``ampguard report`` prints); :meth:`to_dict` for JSON."""

    path: str
    """The run directory or log file it was read from."""
    run: Mapping[str, Any]
    """Facts from the ``run`` record: those of run_id, world_size, precision, backend, device,
    versions that it holds."""
    closed: bool
    """Every rank's log holds a ``close`` record (False: still running, or killed)."""
    steps: int
    """Steps of the run: the most any rank reported."""
    skipped: int
    """Skipped steps (the decision is the same on every rank: counted once per step)."""
    skipped_by_reason: Mapping[str, int]
    """Skipped steps by skip reason, in the order of precedence of ``SKIP_REASONS`` (unknown reasons last)."""
    ranks: Mapping[int, RankSummary]
    """Per rank, by rank."""
    anomalies: tuple[LoggedAnomaly, ...]
    """Every anomaly once, merged over the ranks that logged it, by step."""
    anomalies_by_kind: Mapping[str, int]
    """Anomaly counts by kind."""
    problems: tuple[str, ...]
    """What was skipped or looked wrong while reading the logs."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, strict (``json.dumps(..., allow_nan=False)`` works): non-finite floats as
        "nan"/"inf"/"-inf", rank keys as strings, tuples as lists."""
        return {
            "path": self.path,
            "run": _json_tree(self.run),
            "closed": self.closed,
            "steps": self.steps,
            "skipped": self.skipped,
            "skipped_by_reason": dict(self.skipped_by_reason),
            "ranks": {str(rank): r.to_dict() for rank, r in self.ranks.items()},
            "anomalies": [a.to_dict() for a in self.anomalies],
            "anomalies_by_kind": dict(self.anomalies_by_kind),
            "problems": list(self.problems),
        }


def _json_tree(value: Any) -> Any:
    """:func:`~ampguard.records._jsonable` through dicts and lists too (the ``run`` record is free-form)."""
    if isinstance(value, Mapping):
        return {str(k): _json_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_tree(v) for v in value]
    return _jsonable(value)


def summary(run: Run) -> RunSummary:
    """The run in numbers: steps, skips by reason, loss scale range and non-finite counts per rank,
    anomalies (see :class:`RunSummary`)."""
    world = run.world_size
    decided = decided_steps(run)
    skipped = [r for r in decided.values() if r.skipped]
    by_reason = Counter(str(r.reason) for r in skipped)
    ordered = [k for k in SKIP_REASONS if k in by_reason] + sorted(k for k in by_reason if k not in SKIP_REASONS)
    nonfinite_loss: Counter[int] = Counter()
    nonfinite_grad: Counter[int] = Counter()
    for r in decided.values():
        for origin in origins(r, min(run.ranks) if run.ranks else 0, world):
            if r.nonfinite_loss:
                nonfinite_loss[origin] += 1
            if r.nonfinite_grads > 0:
                nonfinite_grad[origin] += 1
    return RunSummary(
        path=str(run.path),
        run={k: run.info.get(k) for k in _RUN_FACTS if k in run.info},
        closed=run.closed,
        steps=max((log.steps_seen for log in run.ranks.values()), default=0),
        skipped=len(skipped),
        skipped_by_reason={k: by_reason[k] for k in ordered},
        ranks={
            rank: _rank_summary(log, world, nonfinite_loss[rank], nonfinite_grad[rank])
            for rank, log in run.ranks.items()
        },
        anomalies=tuple(run.anomalies),
        anomalies_by_kind=dict(Counter(str(a.kind) for a in run.anomalies)),
        problems=tuple(run.problems),
    )


def _rank_summary(log: RankLog, world: int, nonfinite_loss_steps: int, nonfinite_grad_steps: int) -> RankSummary:
    scales = [s for r in log.reports for s in (r.loss_scale, r.next_loss_scale) if math.isfinite(s)]
    last = log.reports[-1] if log.reports else None
    return RankSummary(
        steps=log.steps_seen,
        logged_steps=len(log.reports),
        skipped=sum(r.skipped for r in log.reports),
        scale_min=min(scales) if scales else None,
        scale_max=max(scales) if scales else None,
        scale_last=last.next_loss_scale if last else None,
        loss_last=last.loss if last else None,
        nonfinite_loss_steps=nonfinite_loss_steps,
        nonfinite_grad_steps=nonfinite_grad_steps,
        nonfinite_grad_tensors=sum(r.nonfinite_grads for r in log.reports if log.rank in origins(r, log.rank, world)),
        closed=log.closed,
        every_step=log.every_step,
        files=tuple(str(p) for p in log.paths),
    )


# ---------------------------------------------------------------------------------- text
def _fmt_num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return str(v)
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4g}"
    return str(v)


_Table = tuple[list[str], list[list[Any]], list[bool]]
"""(headers, rows, right-aligned per column)."""


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Sequence[bool]) -> list[str]:
    cells = [[_fmt_num(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(items: Sequence[str]) -> str:
        return "  " + "  ".join(s.rjust(w) if r else s.ljust(w) for s, w, r in zip(items, widths, right)).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)]


def _blocks(s: RunSummary, last_anomalies: int | None = None) -> list[tuple[list[str], _Table | None]]:
    """The summary as (lines, table after them) blocks: what :func:`format_summary` prints and
    :func:`rich_summary` draws. ``last_anomalies``: list only the last N anomalies."""
    run = s.run
    state = "finished" if s.closed else "no close record: still running, or killed"
    facts = [f"{k} {run[k]}" for k in ("precision", "backend", "world_size", "device") if run.get(k) is not None]
    pct = f" ({100.0 * s.skipped / s.steps:.1f}%)" if s.steps else ""
    out: list[tuple[list[str], _Table | None]] = [(
        [f"ampguard run {run.get('run_id', '?')}  ({state})", "  " + "   ".join(facts), f"  log: {s.path}", "",
         f"steps {s.steps}   skipped {s.skipped}{pct}"],
        (["skip reason", "steps"], [list(kv) for kv in s.skipped_by_reason.items()], [False, True])
        if s.skipped_by_reason else None)]
    rows = [
        [rank, r.steps, r.skipped, r.scale_min, r.scale_max, r.scale_last, r.nonfinite_loss_steps,
         r.nonfinite_grad_steps, "yes" if r.closed else "no"]
        for rank, r in s.ranks.items()
    ]
    out.append((["", "per rank"], (["rank", "steps", "skipped", "scale min", "scale max", "scale now", "nonfinite loss",
                                    "nonfinite grad", "closed"], rows, [True] * 8 + [False])))
    shown = s.anomalies if last_anomalies is None else s.anomalies[len(s.anomalies) - last_anomalies:]
    which = f" (the last {len(shown)})" if len(shown) < len(s.anomalies) else ""
    arows = [
        [a.step, a.kind, ",".join(map(str, a.ranks)) or "-", a.module, a.phase, a.cause, _short(a.detail, 90)]
        for a in shown
    ]
    out.append((["", f"anomalies {len(s.anomalies)}{which}"],
                (["step", "kind", "ranks", "module", "phase", "cause", "detail"], arows,
                 [True, False, False, False, False, False, False]) if arows else None))
    if s.problems:
        out.append((["", "problems reading the log", *(f"  - {p}" for p in s.problems)], None))
    return out


def format_summary(s: RunSummary) -> str:
    """The summary as plain-text tables (what ``ampguard report`` prints)."""
    out: list[str] = []
    for lines, table in _blocks(s):
        out += lines
        if table is not None:
            out += _table(*table)
    return "\n".join(out)


def rich_summary(s: RunSummary, *, last_anomalies: int | None = None) -> Any:
    """The same summary as a rich renderable (``rich.table.Table`` per table; what ``ampguard report
    --follow`` redraws). ``last_anomalies``: list only the last N anomalies. Needs rich."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    for lines, table in _blocks(s, last_anomalies):
        text = "\n".join(lines).strip("\n")
        if text:
            parts.append(Text(text))
        if table is not None:
            headers, rows, right = table
            t = Table(expand=False)
            for h, r in zip(headers, right):  # only the detail gives way on a narrow terminal (it wraps)
                t.add_column(h, justify="right" if r else "left", no_wrap=h != "detail")
            for row in rows:
                t.add_row(*(_fmt_num(c) for c in row))
            parts.append(t)
    return Group(*parts)


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"
