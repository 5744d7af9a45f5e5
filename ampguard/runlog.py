"""Read a run's JSONL event logs back: :func:`load_run`, :func:`summary`, :func:`plot`, and the
``ampguard report`` command (:func:`report_main`).

>>> run = load_run("runs/exp1")            # a run directory (every rank's *.jsonl) or one .jsonl file
>>> print(format_summary(summary(run)))    # steps, skips by reason, scale range, anomalies
>>> plot(run, "report.png")                # one figure, aligned panels (needs the ``cli`` extra)

The reader is tolerant of a run still in progress or killed mid-way: a truncated last line is
skipped (and counted in :attr:`Run.problems`), a missing ``close`` record is fine. What is not
an ampguard event log at all (a missing path, an empty directory, a file whose first record is
not a JSON object with an ``"event"`` key) raises :class:`RunLogError`.

Command line::

    ampguard report RUN_DIR_OR_EVENTS.jsonl [--plot out.png] [--json] [--run-id ID]
    python -m ampguard.runlog RUN_DIR_OR_EVENTS.jsonl ...

Exit status: 0 on success, 2 on bad input (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .errors import AmpGuardError, BackendUnavailableError
from .report import SKIP_REASONS, StepReport

__all__ = [
    "LoggedAnomaly", "RankLog", "Run", "RunLogError", "build_parser", "format_summary", "load_run", "plot",
    "report_main", "summary",
]

_PROG = "ampguard report"
_STEP_FIELDS = {f.name for f in dataclasses.fields(StepReport)}
_NONFINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf}


class RunLogError(AmpGuardError, ValueError):
    """The path is not a readable ampguard event log (missing, empty, or another format)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoggedAnomaly:
    """An anomaly as logged, merged over the ranks that logged it (each rank logs the same decision)."""

    step: int
    kind: str
    detail: str
    ranks: tuple[int, ...] = ()
    """Ranks where it originated (``()`` on one process)."""
    params: tuple[str, ...] = ()
    module: str | None = None
    phase: str | None = None
    cause: str | None = None
    reason: str | None = None
    """The step's skip reason (None when the step was not skipped)."""
    logged_by: tuple[int, ...] = ()
    """Ranks whose log holds this anomaly."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


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

    # Column views, for plotting and tests.
    @property
    def step(self) -> list[int]:
        return [r.step for r in self.reports]

    @property
    def loss(self) -> list[float]:
        return [r.loss for r in self.reports]

    @property
    def loss_scale(self) -> list[float]:
        return [r.loss_scale for r in self.reports]

    @property
    def grad_norm(self) -> list[float]:
        return [r.grad_norm for r in self.reports]

    @property
    def skipped(self) -> list[bool]:
        return [r.skipped for r in self.reports]

    @property
    def reason(self) -> list[str | None]:
        return [r.reason for r in self.reports]

    @property
    def nonfinite_grads(self) -> list[int]:
        return [r.nonfinite_grads for r in self.reports]

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


# ---------------------------------------------------------------------------------- reading
def _num(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in _NONFINITE:
        return _NONFINITE[value.lower()]
    return value


def _plain(value: Any) -> Any:
    """JSON-ready: non-finite floats as "nan"/"inf"/"-inf", tuples as lists (as the exporter writes)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _report(rec: dict[str, Any]) -> StepReport:
    kw = {k: _num(v) for k, v in rec.items() if k in _STEP_FIELDS}
    kw.setdefault("skipped", False)
    kw.setdefault("reason", None)
    for name in ("loss", "loss_scale", "grad_norm"):
        kw[name] = float(kw.get(name, math.nan))
    kw["next_loss_scale"] = float(kw.get("next_loss_scale", kw["loss_scale"]))
    kw["nonfinite_grads"] = int(kw.get("nonfinite_grads", 0))
    kw["nonfinite_loss"] = bool(kw.get("nonfinite_loss", not math.isfinite(kw["loss"])))
    kw["nonfinite_ranks"] = tuple(int(r) for r in kw.get("nonfinite_ranks") or ())
    if kw.get("param_norms") is not None:
        kw["param_norms"] = tuple(float(_num(v)) for v in kw["param_norms"])
    kw["step"] = int(kw["step"])
    return StepReport(**kw)


def _read_file(path: Path, problems: list[str], strict: bool) -> list[dict[str, Any]] | None:
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
        if not line.strip():
            continue
        is_last = i == len(lines) or (i == len(lines) - 1 and complete)
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and isinstance(rec.get("event"), str)
        except ValueError:
            rec, ok = None, False
        if first and not ok:
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
        if not ok:
            if is_last and not complete:
                problems.append(f"{path}: last line is truncated (run in progress or killed); skipped")
            else:
                problems.append(f"{path}: line {i} is not a valid event record; skipped")
            continue
        assert rec is not None
        records.append(rec)
    return records


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
        raise RunLogError(f"{path}: no *.jsonl event logs in this directory")
    return files, False


def load_run(path: str | os.PathLike[str], *, run_id: str | None = None) -> Run:
    """Read a run from a directory (every ``*.jsonl`` in it: one file per rank) or one ``.jsonl`` file.

    Logs are append-only, so one file may hold several runs: the run ``run_id`` is read, by
    default the one opened last (the others are listed in :attr:`Run.other_runs`).
    Raises :class:`RunLogError` for a missing path, a directory without event logs, or a file
    that is not an ampguard event log. Reads files only; no torch, no device.
    """
    root = Path(path)
    files, single = _files(root)
    problems: list[str] = []
    # (run_id -> rank -> records); "run" records tell which run the following lines belong to.
    runs: dict[str, dict[int, list[tuple[Path, dict[str, Any]]]]] = {}
    infos: dict[str, dict[str, Any]] = {}
    opened: dict[str, float] = {}
    any_log = False
    for file in files:
        records = _read_file(file, problems, strict=single or len(files) == 1)
        if records is None:
            continue
        any_log = True
        current: str | None = None
        for rec in records:
            event = rec["event"]
            if event == "run":
                current = str(rec.get("run_id", "?"))
                info = infos.setdefault(current, dict(rec))
                info.setdefault("ranks_opened", set()).add(int(rec.get("rank", 0)))
                opened[current] = max(opened.get(current, -math.inf), float(rec.get("time", 0.0) or 0.0))
                continue
            if current is None:
                current = "?"
                problems.append(f"{file}: no 'run' record before the first event (log started mid-run?)")
                infos.setdefault(current, {"run_id": current})
                opened.setdefault(current, -math.inf)
            rank = int(rec.get("rank", 0))
            runs.setdefault(current, {}).setdefault(rank, []).append((file, rec))
    if not any_log:
        raise RunLogError(f"{root}: no ampguard event log among {len(files)} *.jsonl file(s)")
    if not infos:
        raise RunLogError(f"{root}: the event log holds no records yet")
    if run_id is None:
        chosen = max(infos, key=lambda k: opened.get(k, -math.inf))
    elif run_id in infos:
        chosen = run_id
    else:
        raise RunLogError(f"{root}: no run {run_id!r} in the logs (runs: {', '.join(sorted(infos))})")
    others = sorted(k for k in infos if k != chosen)
    if others:
        problems.append(f"the logs also hold {len(others)} other run(s) ({', '.join(others)}); "
                        f"reading {chosen} (choose with --run-id)")

    info = infos[chosen]
    ranks_opened: set[int] = info.pop("ranks_opened", set())
    ranks: dict[int, RankLog] = {}
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for rank, recs in sorted(runs.get(chosen, {}).items()):
        log = ranks.setdefault(rank, RankLog(rank))
        by_step: dict[int, StepReport] = {}
        for file, rec in recs:
            if file not in log.paths:
                log.paths.append(file)
            event = rec["event"]
            try:
                if event in ("step", "skipped"):
                    log.every_step |= event == "step"
                    by_step[int(rec["step"])] = _report(rec)
                elif event == "anomaly":
                    if isinstance(rec.get("report"), dict):
                        by_step.setdefault(int(rec["step"]), _report(rec["report"]))
                    _merge_anomaly(merged, rec, rank)
                elif event == "close":
                    log.closed = True
                    log.close_steps = int(rec.get("steps", 0))
            except (KeyError, TypeError, ValueError) as e:
                problems.append(f"{file}: a {event!r} record lacks or mangles a field ({e}); skipped")
        log.reports = [by_step[s] for s in sorted(by_step)]
    for rank in sorted(ranks_opened - set(ranks)):
        ranks[rank] = RankLog(rank, paths=[])
    ranks = dict(sorted(ranks.items()))
    world = int(info.get("world_size", 1) or 1)
    missing = sorted(set(range(world)) - set(ranks))
    if missing and not single:
        problems.append(f"no log for rank(s) {', '.join(map(str, missing))} of world_size {world}")
    anomalies = sorted((_anomaly(v) for v in merged.values()), key=lambda a: (a.step, a.kind))
    return Run(path=root, info=info, ranks=ranks, anomalies=anomalies, problems=problems, other_runs=others)


def _merge_anomaly(merged: dict[tuple[int, str], dict[str, Any]], rec: dict[str, Any], rank: int) -> None:
    key = (int(rec["step"]), str(rec["kind"]))
    rec = {**rec, "module": rec.get("module") or None}  # "" means "not localised"
    origin = rank in (rec.get("ranks") or ())
    cur = merged.get(key)
    if cur is None:
        merged[key] = {**rec, "logged_by": {rank}, "_origin": origin}
        return
    cur["logged_by"].add(rank)
    if origin and not cur["_origin"]:
        # The rank the fault came from localised it on its own data: its diagnosis wins.
        merged[key] = {**rec, "logged_by": cur["logged_by"], "_origin": True}
        return
    for name in ("module", "phase", "cause"):  # keep what any rank knew
        if cur.get(name) is None and rec.get(name) is not None:
            cur[name] = rec[name]


def _anomaly(rec: dict[str, Any]) -> LoggedAnomaly:
    return LoggedAnomaly(
        step=int(rec["step"]), kind=str(rec["kind"]), detail=str(rec.get("detail", "")),
        ranks=tuple(int(r) for r in rec.get("ranks") or ()), params=tuple(str(p) for p in rec.get("params") or ()),
        module=rec.get("module"), phase=rec.get("phase"), cause=rec.get("cause"), reason=rec.get("reason"),
        logged_by=tuple(sorted(rec["logged_by"])),
    )


# ---------------------------------------------------------------------------------- summary
def _origins(r: StepReport, rank: int, world: int) -> tuple[int, ...]:
    if r.nonfinite_ranks:
        return r.nonfinite_ranks
    return (rank,) if world == 1 else ()


def summary(run: Run) -> dict[str, Any]:
    """The run in numbers, as a JSON-ready dict (non-finite floats as strings).

    Keys: ``run`` (info), ``path``, ``closed``, ``steps``, ``skipped`` (total), ``skipped_by_reason``,
    ``ranks`` (per rank: steps, skipped, scale_min/max/last, nonfinite loss/grad steps it originated,
    closed, files), ``anomalies`` (step, kind, ranks, module, phase, cause, detail...),
    ``anomalies_by_kind``, ``problems``.
    """
    world = run.world_size
    # The decision is the same on every rank: count skips over the union of logged steps.
    decided: dict[int, StepReport] = {}
    for log in run.ranks.values():
        for r in log.reports:
            decided.setdefault(r.step, r)
    skipped = [r for r in decided.values() if r.skipped]
    by_reason = Counter(str(r.reason) for r in skipped)
    ordered = [k for k in SKIP_REASONS if k in by_reason] + sorted(k for k in by_reason if k not in SKIP_REASONS)
    nonfinite_loss: Counter[int] = Counter()
    nonfinite_grad: Counter[int] = Counter()
    for r in decided.values():
        for origin in _origins(r, min(run.ranks) if run.ranks else 0, world):
            if r.nonfinite_loss:
                nonfinite_loss[origin] += 1
            if r.nonfinite_grads > 0:
                nonfinite_grad[origin] += 1
    per_rank: dict[str, dict[str, Any]] = {}
    for rank, log in run.ranks.items():
        scales = [s for r in log.reports for s in (r.loss_scale, r.next_loss_scale) if math.isfinite(s)]
        last = log.reports[-1] if log.reports else None
        per_rank[str(rank)] = {
            "steps": log.steps_seen,
            "logged_steps": len(log.reports),
            "skipped": sum(r.skipped for r in log.reports),
            "scale_min": min(scales) if scales else None,
            "scale_max": max(scales) if scales else None,
            "scale_last": last.next_loss_scale if last else None,
            "loss_last": last.loss if last else None,
            "nonfinite_loss_steps": nonfinite_loss.get(rank, 0),
            "nonfinite_grad_steps": nonfinite_grad.get(rank, 0),
            "nonfinite_grad_tensors": sum(r.nonfinite_grads for r in log.reports if rank in _origins(r, rank, world)),
            "closed": log.closed,
            "every_step": log.every_step,
            "files": [str(p) for p in log.paths],
        }
    steps = max((log.steps_seen for log in run.ranks.values()), default=0)
    out = {
        "path": str(run.path),
        "run": {k: run.info.get(k) for k in ("run_id", "world_size", "precision", "backend", "device", "versions")
                if k in run.info},
        "closed": run.closed,
        "steps": steps,
        "skipped": len(skipped),
        "skipped_by_reason": {k: by_reason[k] for k in ordered},
        "ranks": per_rank,
        "anomalies": [a.to_dict() for a in run.anomalies],
        "anomalies_by_kind": dict(Counter(a.kind for a in run.anomalies)),
        "problems": list(run.problems),
    }
    return dict(_plain(out))


def _fmt_num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4g}"
    return str(v)


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Sequence[bool]) -> list[str]:
    cells = [[_fmt_num(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(items: Sequence[str]) -> str:
        return "  " + "  ".join(s.rjust(w) if r else s.ljust(w) for s, w, r in zip(items, widths, right)).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)]


def format_summary(s: dict[str, Any]) -> str:
    """The summary as plain-text tables (what ``ampguard report`` prints)."""
    run = s.get("run", {})
    out: list[str] = []
    state = "finished" if s.get("closed") else "no close record: still running, or killed"
    out.append(f"ampguard run {run.get('run_id', '?')}  ({state})")
    facts = [f"{k} {run[k]}" for k in ("precision", "backend", "world_size", "device") if run.get(k) is not None]
    out.append("  " + "   ".join(facts))
    out.append(f"  log: {s.get('path')}")
    steps, skipped = int(s.get("steps", 0)), int(s.get("skipped", 0))
    pct = f" ({100.0 * skipped / steps:.1f}%)" if steps else ""
    out.append("")
    out.append(f"steps {steps}   skipped {skipped}{pct}")
    if s.get("skipped_by_reason"):
        out += _table(["skip reason", "steps"], list(s["skipped_by_reason"].items()), [False, True])
    out.append("")
    out.append("per rank")
    rows = [
        [rank, r["steps"], r["skipped"], r["scale_min"], r["scale_max"], r["scale_last"],
         r["nonfinite_loss_steps"], r["nonfinite_grad_steps"], "yes" if r["closed"] else "no"]
        for rank, r in s.get("ranks", {}).items()
    ]
    out += _table(["rank", "steps", "skipped", "scale min", "scale max", "scale now", "nonfinite loss",
                   "nonfinite grad", "closed"], rows, [True] * 8 + [False])
    anomalies = s.get("anomalies", [])
    out.append("")
    out.append(f"anomalies {len(anomalies)}")
    if anomalies:
        arows = [
            [a["step"], a["kind"], ",".join(map(str, a["ranks"])) or "-", a["module"], a["phase"], a["cause"],
             _short(a["detail"], 90)]
            for a in anomalies
        ]
        out += _table(["step", "kind", "ranks", "module", "phase", "cause", "detail"], arows,
                      [True, False, False, False, False, False, False])
    if s.get("problems"):
        out.append("")
        out.append("problems reading the log")
        out += [f"  - {p}" for p in s["problems"]]
    return "\n".join(out)


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


# ---------------------------------------------------------------------------------- picture
_REASON_COLORS = {
    "nonfinite_loss": "#d62728",
    "nonfinite_grad": "#ff7f0e",
    "grad_spike": "#9467bd",
    "loss_spike": "#8c564b",
    "rollback": "#e377c2",
}


def plot(run: Run, out_png: str | os.PathLike[str], *, width_px: int = 1600, height_px: int = 1200) -> Path:
    """Write one PNG with aligned panels sharing the step axis: loss; loss scale per rank (log2);
    gradient norm (log); non-finite counts per rank. Skipped steps are shaded and anomalies drawn as
    vertical lines across every panel, labelled with their kind and module.

    Needs matplotlib (the ``ampguard[cli]`` extra); uses the Agg backend, so no display is needed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        raise BackendUnavailableError(
            "ampguard report --plot needs matplotlib: pip install 'ampguard[cli]'"
        ) from None

    dpi = 100
    fig, axes = plt.subplots(
        4, 1, sharex=True, figsize=(width_px / dpi, height_px / dpi), dpi=dpi,
        gridspec_kw={"height_ratios": [3, 2.2, 2.2, 0.9 + 0.35 * max(len(run.ranks), 1)], "hspace": 0.26},
    )
    ax_loss, ax_scale, ax_norm, ax_nf = axes
    cmap = plt.get_cmap("tab10")
    ranks = list(run.ranks.values())
    multi = len(ranks) > 1
    all_steps = sorted({s for log in ranks for s in log.step})
    x_max = max(all_steps[-1] if all_steps else 0, max((log.steps_seen for log in ranks), default=1) - 1, 1)

    def color(i: int) -> Any:
        return cmap(i % 10)

    # Skipped steps: shaded bands (by reason) in every panel; anomalies: vertical lines + labels.
    decided: dict[int, StepReport] = {}
    for log in ranks:
        for r in log.reports:
            decided.setdefault(r.step, r)
    skipped = sorted((r.step, r.reason or "?") for r in decided.values() if r.skipped)
    for ax in axes:
        for step, reason in skipped:
            ax.axvspan(step - 0.5, step + 0.5, color=_REASON_COLORS.get(reason, "#7f7f7f"), alpha=0.18, lw=0)
        for a in run.anomalies:
            ax.axvline(a.step, color="#444444", lw=0.9, ls=(0, (4, 3)), alpha=0.8)

    # Panel 1: loss (non-finite losses as red crosses on the top edge). Values every rank agrees on
    # (the guard reports global ones) are drawn once, as "all ranks".
    for i, (label, log, xs, ys) in enumerate(_series(ranks, "loss")):
        ax_loss.plot(xs, ys, "-" if log.every_step else "o", color=color(i), lw=1.4 if i == 0 else 1.0, ms=3,
                     alpha=1.0 if i == 0 else 0.75, label=label)
    finite_losses = [r.loss for log in ranks for r in log.reports if math.isfinite(r.loss)]
    bad_loss = sorted({r.step for log in ranks for r in log.reports if not math.isfinite(r.loss)})
    if bad_loss:
        ax_loss.plot(bad_loss, [1.0] * len(bad_loss), "x", color="#d62728", ms=9, mew=2.2,
                     transform=ax_loss.get_xaxis_transform(), clip_on=False, label="non-finite loss")
    if finite_losses and min(finite_losses) > 0 and max(finite_losses) / min(finite_losses) > 100:
        ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss", loc="left", fontsize=11, fontweight="bold")

    # Panel 2: loss scale per rank, log2 axis.
    has_scale = False
    for i, log in enumerate(ranks):
        pts = [(r.step, r.loss_scale) for r in log.reports if math.isfinite(r.loss_scale) and r.loss_scale > 0]
        if not pts:
            continue
        has_scale = True
        ax_scale.step([x for x, _ in pts], [y for _, y in pts], where="mid", color=color(i), lw=2.0 if i == 0 else 1.2,
                      ls="-" if i == 0 else (0, (5, 3)), label=f"rank {log.rank}")
    if has_scale:
        ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale (log2)")
    ax_scale.set_title("loss scale per rank", loc="left", fontsize=11, fontweight="bold")

    # Panel 3: gradient norm, log axis; non-finite norms as orange triangles on the top edge.
    for i, (label, log, xs, ys) in enumerate(_series(ranks, "grad_norm", positive=True)):
        ax_norm.plot(xs, ys, "-" if log.every_step else "o", color=color(i), lw=1.2, ms=3,
                     alpha=1.0 if i == 0 else 0.75, label=label)
    bad_norm = sorted({r.step for log in ranks for r in log.reports if not math.isfinite(r.grad_norm)})
    if bad_norm:
        ax_norm.plot(bad_norm, [1.0] * len(bad_norm), "^", color="#ff7f0e", ms=8, mec="black", mew=0.6,
                     transform=ax_norm.get_xaxis_transform(), clip_on=False, label="non-finite grad norm")
    if any(r.grad_norm > 0 and math.isfinite(r.grad_norm) for log in ranks for r in log.reports):
        ax_norm.set_yscale("log")
    ax_norm.set_ylabel("grad norm (L2, unscaled)")
    ax_norm.set_title("gradient norm", loc="left", fontsize=11, fontweight="bold")

    # Panel 4: where non-finite values came from: one row per rank, a marker per step (x: the loss,
    # triangle: gradients, sized by the non-finite tensor count), the totals in the row label.
    world = run.world_size
    origin_ranks = sorted(set(run.ranks) | {o for r in decided.values() for o in r.nonfinite_ranks})
    labels = []
    for i, rank in enumerate(origin_ranks):
        loss_x = [r.step for r in decided.values() if r.nonfinite_loss and rank in _origins(r, rank, world)]
        grad = [(r.step, r.nonfinite_grads) for r in decided.values()
                if r.nonfinite_grads > 0 and rank in _origins(r, rank, world)]
        if loss_x:
            ax_nf.plot([x - 0.18 for x in loss_x], [i] * len(loss_x), "x", color="#d62728", ms=10, mew=2.4,
                       label="non-finite loss")
        if grad:
            gx, gn = zip(*grad)
            ax_nf.scatter([x + 0.18 for x in gx], [i] * len(gx), s=[40 + 14 * min(n, 20) for n in gn], marker="^",
                          color="#ff7f0e", edgecolors="black", linewidths=0.6, zorder=3, label="non-finite gradients")
        labels.append(f"rank {rank}\n{len(loss_x)} loss / {len(grad)} grad")
    ax_nf.set_yticks(range(len(origin_ranks)), labels, fontsize=8.5)
    ax_nf.set_ylim(-0.7, len(origin_ranks) - 0.3)
    ax_nf.invert_yaxis()
    ax_nf.set_title("non-finite values, by the rank they came from (steps)", loc="left", fontsize=11,
                    fontweight="bold")
    handles, names = ax_nf.get_legend_handles_labels()
    uniq = dict(zip(names, handles))  # one entry per kind, whatever the number of ranks
    if uniq:
        ax_nf.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=8.5, framealpha=0.9)
    ax_nf.set_xlabel("step")
    ax_nf.set_xlim(-0.5, x_max + 0.5)

    # Anomaly labels: in the loss panel, staggered so neighbours do not overlap.
    for j, a in enumerate(run.anomalies):
        if a.module:
            where = f": module {a.module}" + (f" ({a.phase})" if a.phase else "")
        else:
            where = f": {a.params[0]}" if a.params else ""
        rk = f", rank {','.join(map(str, a.ranks))}" if a.ranks else ""
        ax_loss.annotate(
            f"{a.kind}{where}{rk}", xy=(a.step, 1.0), xycoords=("data", "axes fraction"),
            xytext=(3, -12 - 13 * (j % 4)), textcoords="offset points", fontsize=8.5, color="#222222",
            rotation=0, va="top", ha="left",
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "#999999", "alpha": 0.85, "lw": 0.5},
        )

    for ax in (ax_loss, ax_norm):
        if ax.get_yscale() == "log":  # plain numbers (2, 3, 0.5), not 2x10^0
            lo, hi = ax.get_ylim()
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            if hi / max(lo, 1e-300) < 100:  # label the 2s and 5s between decades, not every minor tick
                ax.yaxis.set_minor_formatter(FuncFormatter(
                    lambda v, _: f"{v:g}" if v > 0 and f"{v:e}"[0] in "25" else ""))
            else:
                ax.yaxis.set_minor_formatter(NullFormatter())
    for ax in axes:
        ax.grid(True, which="major", alpha=0.3)
        ax.tick_params(labelsize=9)
    for ax in (ax_loss, ax_scale, ax_norm):
        if ax.get_legend_handles_labels()[0] and (multi or ax is ax_loss or ax is ax_norm):
            ax.legend(loc="upper right", fontsize=8.5, framealpha=0.9)

    # One legend, at the top, for what the shading and lines mean.
    reasons = sorted({reason for _, reason in skipped}, key=lambda k: (k not in SKIP_REASONS, k))
    keys: list[Any] = [Patch(color=_REASON_COLORS.get(k, "#7f7f7f"), alpha=0.35, label=f"skipped: {k}")
                       for k in reasons]
    if run.anomalies:
        keys.append(Line2D([], [], color="#444444", lw=0.9, ls=(0, (4, 3)), label="anomaly"))
    if keys:
        fig.legend(handles=keys, loc="upper right", ncol=len(keys), fontsize=9, frameon=False,
                   bbox_to_anchor=(0.985, 0.955))
    info = run.info
    state = "" if run.closed else "  (no close record: in progress or killed)"
    fig.suptitle(
        f"ampguard run {run.run_id}: {info.get('precision', '?')}, {info.get('backend', '?')}, "
        f"{world} rank(s), {x_max + 1} steps, {len(skipped)} skipped, {len(run.anomalies)} anomalies{state}",
        x=0.06, y=0.985, ha="left", fontsize=13, fontweight="bold",
    )
    fig.subplots_adjust(left=0.07, right=0.985, top=0.915, bottom=0.055)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


_Series = tuple[str, RankLog, list[int], list[float]]


def _series(ranks: Sequence[RankLog], attr: str, positive: bool = False) -> list[_Series]:
    """(label, log, steps, values) per rank, finite values only; one "all ranks" series when they agree."""
    out = []
    for log in ranks:
        pts = [(r.step, float(getattr(r, attr))) for r in log.reports]
        pts = [(x, y) for x, y in pts if math.isfinite(y) and (y > 0 or not positive)]
        out.append((f"rank {log.rank}", log, [x for x, _ in pts], [y for _, y in pts]))
    if len(out) > 1 and all(o[2:] == out[0][2:] for o in out[1:]):
        return [("all ranks", out[0][1], out[0][2], out[0][3])]
    return out


# ---------------------------------------------------------------------------------- command line
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2 (argparse's own convention)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = _PROG) -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog,
        description="Summarise a guarded run from its JSONL event logs (every rank's), and optionally draw "
                    "one picture of it. Works on a run still in progress or killed mid-way.",
        epilog="Exit status: 0 success, 2 bad input (missing path, not an ampguard event log).",
    )
    p.add_argument("path", metavar="RUN_DIR_OR_EVENTS.jsonl",
                   help="a run directory (reads every *.jsonl in it: one per rank) or one events .jsonl file")
    p.add_argument("--plot", metavar="OUT.png", help="write a figure: loss, loss scale per rank, grad norm, "
                   "skipped steps and anomalies, non-finite counts per rank (needs ampguard[cli])")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    p.add_argument("--run-id", help="which run to read when the logs hold several (default: the latest)")
    return p


def report_main(argv: Sequence[str] | None = None, *, prog: str = _PROG) -> int:
    """``ampguard report``: print a run's summary (table or ``--json``), write ``--plot``. Returns the exit code."""
    args = build_parser(prog).parse_args(list(argv) if argv is not None else None)
    try:
        run = load_run(args.path, run_id=args.run_id)
        s = summary(run)
        for problem in run.problems:
            print(f"{prog}: warning: {problem}", file=sys.stderr)
        if args.json:
            print(json.dumps(s, indent=2, allow_nan=False))
        else:
            print(format_summary(s))
        if args.plot:
            out = plot(run, args.plot)
            if not args.json:
                print(f"\npicture: {out}")
    except BrokenPipeError:  # `ampguard report run | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silences the flush at exit
        return 0
    except (AmpGuardError, OSError, ValueError, TypeError, KeyError) as e:
        # Bad input, including a log mangled in ways the reader does not expect: one line, no traceback.
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(report_main())
