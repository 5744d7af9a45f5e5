"""``ampguard report`` (also ``python -m ampguard.runlog``): print a run's summary, write its picture.

Exit status: 0 on success, 2 on bad input (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ..errors import AmpGuardError
from .plotting import plot
from .reading import load_run
from .summary import format_summary, summary

__all__ = ["build_parser", "report_main", "run_report"]

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
    return p


def run_report(args: argparse.Namespace, *, prog: str = _PROG) -> int:
    """Run the command on arguments parsed by :func:`build_parser`'s parser. Returns the exit code."""
    try:
        run = load_run(args.path, run_id=args.run_id)
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
    return 0


def report_main(argv: Sequence[str] | None = None, *, prog: str = _PROG) -> int:
    """``ampguard report``: print a run's summary (table or ``--json``), write ``--plot``. Returns the exit code."""
    args = build_parser(prog).parse_args(list(argv) if argv is not None else None)
    return run_report(args, prog=prog)
