"""Read a run's JSONL event logs back: :func:`load_run`, :func:`summary`, :func:`plot`, and the
``ampguard report`` command (:func:`report_main`).

>>> run = load_run("runs/exp1")            # a run directory (every rank's *.jsonl) or one .jsonl file
>>> print(format_summary(summary(run)))    # steps, skips by reason, scale range, anomalies
>>> plot(run, "report.png")                # one figure, aligned panels (needs the ``cli`` extra)

The reader is tolerant of a run still in progress or killed mid-way: a truncated last line is
skipped (and counted in :attr:`Run.problems`), a missing ``close`` record is fine. What is not
an ampguard event log at all (a missing path, an empty directory, a file whose first record is
not a JSON object with an ``"event"`` key) raises :class:`RunLogError`.

Modules: :mod:`.reading` (the logs into :class:`Run`), :mod:`.summary` (:class:`RunSummary` and its
tables), :mod:`.plotting` (the picture), :mod:`.notes` (its anomaly strip), :mod:`.command` (the command
line).

Command line::

    ampguard report RUN_DIR_OR_EVENTS.jsonl [--plot out.png] [--json] [--run-id ID]
    ampguard report RUN_DIR_OR_EVENTS.jsonl --follow [--interval S] [--follow-timeout S]
    python -m ampguard.runlog RUN_DIR_OR_EVENTS.jsonl ...

Exit status: 0 on success, 2 on bad input (one line on stderr, never a traceback); ``--follow``:
0 when the run ended or on Ctrl-C, 1 when no record came for ``--follow-timeout`` seconds.
"""

from .command import build_parser, follow, report_main, run_report
from .plotting import figure, plot
from .reading import LoggedAnomaly, NoEventsYet, RankLog, Run, RunLogError, load_run
from .summary import RankSummary, RunSummary, format_summary, rich_summary, summary

__all__ = [
    "LoggedAnomaly", "NoEventsYet", "RankLog", "RankSummary", "Run", "RunLogError", "RunSummary", "build_parser",
    "figure", "follow", "format_summary", "load_run", "plot", "report_main", "rich_summary", "run_report", "summary",
]
