"""``ampguard report`` (also ``python -m ampguard.runlog``): print a run's summary, write its picture.

Exit status: 0 on success, 2 on bad input (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import AmpGuardError, BackendUnavailableError
from ..logs import latest_found_advice
from .plotting import plot
from .reading import NoEventsYet, Run, RunLogError, load_run
from .summary import RunSummary, format_summary, rich_summary, summary

__all__ = ["build_parser", "follow", "report_main", "run_report"]

_PROG = "ampguard report"


def build_parser(prog: str = _PROG, parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The command's arguments, on ``parser`` (e.g. the ``report`` subparser of ``ampguard``) or a new one."""
    p = parser or argparse.ArgumentParser(prog=prog)
    p.description = ("Summarise a guarded run from its JSONL event logs (every rank's), and optionally draw "
                     "one picture of it. Works on a run still in progress or killed mid-way.")
    p.epilog = "Exit status: 0 success, 2 bad input (missing path, not an ampguard event log)."
    p.add_argument("path", metavar="RUN_DIR_OR_EVENTS.jsonl",
                   help="a run directory (reads every *.jsonl in it: one per rank) or one events .jsonl file")
    p.add_argument("--plot", metavar="OUT.png", help="write a figure: loss, loss scale per rank, grad norm, "
                   "skipped steps and anomalies, non-finite counts per rank (needs ampguard[cli])")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    p.add_argument("--run-id", help="which run to read when the logs hold several (default: the latest)")
    p.add_argument("--follow", action="store_true",
                   help="keep reading as the logs grow and redraw the summary (rich, on a terminal; one status line "
                   "per change otherwise) until the run ends (every rank's close record), Ctrl-C, or --follow-timeout")
    p.add_argument("--interval", type=_seconds, default=1.0, metavar="S",
                   help="--follow: seconds between looks at the logs (default: 1)")
    p.add_argument("--follow-timeout", type=_seconds, default=None, metavar="S",
                   help="--follow: stop with exit status 1 when no new record came for S seconds (default: wait)")
    return p


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds > 0")
    return value


def run_report(args: argparse.Namespace, *, prog: str = _PROG, console: Any = None) -> int:
    """Run the command on arguments parsed by :func:`build_parser`'s parser. Returns the exit code.
    ``console``: the rich Console that ``--follow`` draws on and the progress bar goes to (default:
    stdout for ``--follow``, stderr for the progress bar)."""
    if getattr(args, "follow", False):
        if args.plot or args.json:
            print(f"{prog}: error: --follow draws the summary live; run --plot or --json after the run",
                  file=sys.stderr)
            return 2
        return _guarded(lambda: follow(args.path, run_id=args.run_id, interval=args.interval,
                                       timeout=args.follow_timeout, console=console, prog=prog), prog)
    return _guarded(lambda: _report_once(args, prog, console), prog)


def _report_once(args: argparse.Namespace, prog: str, console: Any) -> int:
    run = _load_with_progress(args.path, args.run_id, console)
    s = summary(run)
    for problem in run.problems:
        print(f"{prog}: warning: {problem}", file=sys.stderr)
    if args.json:
        print(json.dumps(s.to_dict(), indent=2, allow_nan=False))
    else:
        print(format_summary(s))
    if args.plot:
        out = plot(run, args.plot)
        if not args.json:
            print(f"\npicture: {out}")
    why = unhealthy_end(run)
    if why is not None:
        print(f"{prog}: the run ended unhealthy: {why}", file=sys.stderr)
        advice = latest_found_advice(run.anomalies)  # what the run's own messages and its stop said (stop 68)
        if advice is not None:
            print(f"{prog}: what to do: {advice}", file=sys.stderr)
        return UNHEALTHY
    return 0


UNHEALTHY = 3
"""``ampguard report``'s exit status for a run whose log ends unhealthy (:func:`unhealthy_end`);
1 and 2 are taken by --follow's timeout and bad input."""

_NONFINITE_REASONS = {"nonfinite_loss", "nonfinite_grad"}


def unhealthy_end(run: Run) -> str | None:
    """Why the run's log ends unhealthy, or None: a closed run's last step was skipped as non-finite,
    or the last word of the ladder or the parameter check was a stop (``abort``, ``nonfinite_params``
    not followed by a ``rollback``; also in a run killed before it closed)."""
    if not run.ranks:
        return None
    last = max(log.steps_seen for log in run.ranks.values()) - 1
    for rank, log in sorted(run.ranks.items()) if run.closed else ():  # unclosed: its last step is unknown
        final = [r for r in log.reports if r.step == last]
        if final and final[-1].skipped and final[-1].reason in _NONFINITE_REASONS:
            return f"its last step ({last}) was skipped: {final[-1].reason} on rank {rank}"
    said = [a for a in run.anomalies if a.kind in ("abort", "nonfinite_params", "rollback")]
    if said and said[-1].kind != "rollback":
        return f"step {said[-1].step}: {said[-1].kind}: {said[-1].detail}"
    return None


def _guarded(body: Callable[[], int], prog: str) -> int:
    """Run ``body``; bad input (and a reader that left the pipe) as an exit code, never a traceback."""
    try:
        return body()
    except BrokenPipeError:  # `ampguard report run | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silences the flush at exit
        return 0
    except (AmpGuardError, OSError, ValueError, TypeError, KeyError, OverflowError, RecursionError) as e:
        # Bad input, including a log mangled in ways the reader does not expect (the reader skips a
        # damaged record with a warning; this is the backstop): one line, no traceback.
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


_PROGRESS_BYTES = 8 << 20
"""Logs larger than this (in all) get a progress bar while they are read (on a terminal)."""


def _load_with_progress(path: str, run_id: str | None, console: Any = None, *,
                        threshold: int = _PROGRESS_BYTES) -> Run:
    """:func:`load_run`, with a progress bar and the time left on ``console`` (default: stderr,
    when it is a terminal and rich is installed) for logs over ``threshold`` bytes."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
    except ImportError:
        return load_run(path, run_id=run_id)
    console = console if console is not None else Console(stderr=True)
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.rglob("*.jsonl")) if p.is_dir() else []
    size = sum(f.stat().st_size for f in files if f.is_file())
    if size < threshold or not console.is_terminal:
        return load_run(path, run_id=run_id)
    bar = Progress(TextColumn(f"reading {size / 2**20:.0f} MiB of event logs"), BarColumn(), TaskProgressColumn(),
                   TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True)
    with bar:
        task = bar.add_task("read", total=None)
        return load_run(path, run_id=run_id, progress=lambda done, total: bar.update(task, completed=done, total=total))


# ---------------------------------------------------------------------------------- --follow
def _ended(run: Run) -> bool:
    """Every rank's log holds a close record, and every rank of the run has a log (a directory)."""
    if not run.closed:
        return False
    return run.path.is_file() or set(range(run.world_size)) <= set(run.ranks)


def _sizes(path: Path) -> tuple[tuple[str, int], ...]:
    """What changes when a log grows: every event log's name and size (cheap; no reading)."""
    files = [path] if path.is_file() else sorted(path.rglob("*.jsonl")) if path.is_dir() else []
    out = []
    for f in files:
        try:
            out.append((str(f), f.stat().st_size))
        except OSError:  # removed meanwhile
            continue
    return tuple(out)


def follow(path: str | os.PathLike[str], *, run_id: str | None = None, interval: float = 1.0,
           timeout: float | None = None, console: Any = None, prog: str = _PROG,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """``ampguard report --follow``: redraw the run's summary as its logs grow. Returns the exit code:
    0 when the run ended (every rank's ``close`` record) or on Ctrl-C, 1 when no record came for
    ``timeout`` seconds, 2 on bad input. Re-reads the logs only when a file grew (``interval``
    seconds apart). On a terminal, one rich table redrawn in place (the last 10 anomalies); else a
    status line per change, and the whole summary at the end. Needs rich (``ampguard[cli]``).

    Ctrl-C (SIGINT, in the main thread) sets a flag the loop reads between its steps, rather than raising
    KeyboardInterrupt wherever the interpreter happens to be: an interrupt inside importlib's module lock or
    an I/O call can leave a lock held, and the summary printed next then waits on it for ever (a `report
    --follow` under test once outlived 60 s after its SIGINT). The flag is a plain value, and the handler takes no
    lock: a handler runs between any two bytecodes of the main thread, also while the wait holds its own lock (stop
    58: the flag was a ``threading.Event``, whose ``set()`` from inside its own ``wait()`` waited on the Event's lock
    for ever). The wait is cut into naps of at most :data:`_NAP_S`, so a Ctrl-C ends it within one. The handler is
    put back on return."""
    try:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text
    except ImportError:
        raise BackendUnavailableError("ampguard report --follow needs rich: pip install 'ampguard[cli]'") from None
    root = Path(path)
    if not root.exists():
        raise RunLogError(f"{root}: no such file or directory")
    console = console if console is not None else Console()
    live = Live(Text(f"waiting for event logs in {root}"), console=console, auto_refresh=False,
                redirect_stdout=False, redirect_stderr=False) if console.is_terminal else None
    seen: tuple[tuple[str, int], ...] | None = None
    last_change = clock()
    s: RunSummary | None = None
    warned: set[str] = set()
    rc = 0
    stop = [False]  # Ctrl-C: set by the handler, read by the loop and its naps (no lock: see above)
    previous: Any = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.__setitem__(0, True))
    try:
        if live is not None:
            live.start(refresh=True)
        while not stop[0]:
            sizes = _sizes(root)
            if sizes != seen:
                seen, last_change = sizes, clock()
                try:
                    run = load_run(root, run_id=run_id)
                except NoEventsYet:
                    run = None
                if run is not None:
                    s = summary(run)
                    for problem in run.problems:
                        if problem not in warned and "truncated" not in problem:  # a line being written
                            warned.add(problem)
                            print(f"{prog}: warning: {problem}", file=sys.stderr)
                    if live is not None:
                        live.update(rich_summary(s, last_anomalies=10), refresh=True)
                    else:
                        console.print(_status(s), markup=False, highlight=False, soft_wrap=True)
                    if _ended(run):
                        break
            if timeout is not None and clock() - last_change >= timeout:
                print(f"{prog}: no new record for {timeout:g}s and the run has not ended (no close record from "
                      "every rank): stopped following", file=sys.stderr)
                rc = 1
                break
            _nap(interval, stop, clock, sleep)
    except KeyboardInterrupt:  # the usual way to stop watching (a follow off the main thread): not an error
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if live is not None:
            live.stop()
    if live is None and s is not None:
        console.print(format_summary(s), markup=False, highlight=False, soft_wrap=True)
    return rc


_NAP_S = 0.05
"""The longest sleep of :func:`follow`'s wait between two reads of its Ctrl-C flag: how late a Ctrl-C may end it."""


def _nap(seconds: float, stop: list[bool], clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
    """``sleep(seconds)`` in naps of at most :data:`_NAP_S`, cut short once ``stop[0]`` is set (a Ctrl-C)."""
    end = clock() + seconds
    while not stop[0]:
        left = end - clock()
        if left <= 0:
            return
        sleep(min(left, _NAP_S))


def _status(s: RunSummary) -> str:
    """One line per change when not drawing live (a log file, a pipe)."""
    state = "finished" if s.closed else "running"
    return f"{s.run.get('run_id', '?')}: step {s.steps}, skipped {s.skipped}, anomalies {len(s.anomalies)} ({state})"


def report_main(argv: Sequence[str] | None = None, *, prog: str = _PROG) -> int:
    """``ampguard report``: print a run's summary (table or ``--json``), write ``--plot``. Returns the exit code."""
    args = build_parser(prog).parse_args(list(argv) if argv is not None else None)
    return run_report(args, prog=prog)
