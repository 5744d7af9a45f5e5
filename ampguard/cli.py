"""The ``ampguard`` command: ``demo``, ``report``, ``dashboards``, ``preflight``.

Exit codes: 0 success, 1 the command ran and failed, 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import __version__, dashboards, runlog
from .errors import AmpGuardError
from .preflight import WARN_AFTER_S, Progress, preflight
from .preflight import log as preflight_log

__all__ = ["build_parser", "main"]

_COMMANDS = ("demo", "report", "dashboards", "preflight")
_EPILOG = """commands:
  demo        train a small transformer on 2 CPU ranks in fp16 with injected faults, live
  report      summarise a run's event logs and draw its story in one picture
  dashboards  write the Grafana dashboard, Prometheus rules and rule tests
  preflight   try a short run per precision and recommend precision, initial scale, config

'ampguard COMMAND --help' describes each one."""

_Handler = Callable[[argparse.Namespace, list[str]], int]
"""A command: (its parsed arguments, its argument strings as given) -> exit code."""


# ---------------------------------------------------------------------------------- commands
def _demo(args: argparse.Namespace, argv: list[str]) -> int:
    from . import demo

    return demo.main(argv)


def _report(args: argparse.Namespace, argv: list[str]) -> int:
    return runlog.run_report(args)


def _dashboards(args: argparse.Namespace, argv: list[str]) -> int:
    if args.burst_threshold < dashboards.MIN_BURST_THRESHOLD:
        args.command_parser.error(f"--burst-threshold must be >= {dashboards.MIN_BURST_THRESHOLD}")
    options: dict[str, Any] = {
        "job_selector": args.job_selector, "burst_threshold": args.burst_threshold, "test_job": args.test_job,
        "skip_rate_thresholds": dict(args.skip_rate_threshold), "grad_growth_factor": args.grad_growth_factor,
        "grad_growth_window": args.grad_growth_window,
    }
    try:
        problem = _promtool_rejects(options)  # the options are checked here too: nothing written yet
        if problem:
            print(f"ampguard dashboards: error: promtool rejects the generated rules: {problem}", file=sys.stderr)
            return 2
        paths = dashboards.write_all(args.out, **options)
    except (OSError, ValueError) as exc:
        print(f"ampguard dashboards: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _promtool_rejects(options: dict[str, Any]) -> str:
    """Write the files into a temporary directory (which checks every option) and, where promtool is
    installed, run ``promtool check rules`` on them; return its complaint ("" when it accepts them or
    is not installed)."""
    with tempfile.TemporaryDirectory(prefix="ampguard-dashboards-") as tmp:
        paths = dashboards.write_all(tmp, **options)
        promtool = shutil.which("promtool")
        if promtool is None:
            return ""
        rules = next(p for p in paths if p.name == dashboards.RULES_FILE)
        try:
            check = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True,
                                   timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return ""  # a promtool that cannot run checks nothing; the parser already did
        if check.returncode == 0:
            return ""
        # one complaint per rule, each "PATH: line:col: group ..., rule N, NAME: message": the first,
        # without the temporary path, and how many more
        found = [line.split(f"{rules}: ", 1)[1] for line in (check.stderr + check.stdout).splitlines()
                 if line.startswith(f"{rules}: ")]
        if not found:
            return " ".join((check.stderr or check.stdout).replace(str(rules), rules.name).split())
        more = f" (and {len(found) - 1} more rules alike)" if len(found) > 1 else ""
        return f"{rules.name} {found[0]}{more}"


def _precision_fraction(text: str) -> tuple[str, float]:
    precision, sep, value = text.partition("=")
    try:
        if sep:
            return precision, float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: expected PRECISION=FRACTION, e.g. bf16=0.001")


def _dashboards_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="dashboards", help="output directory (default: dashboards/)")
    p.add_argument("--job-selector", default="",
                   help="PromQL label matchers added to every rule, e.g. 'job=~\"llm-.*\"' (default: none)")
    p.add_argument("--burst-threshold", type=int, default=dashboards.DEFAULT_BURST_THRESHOLD,
                   help="AmpguardNonFiniteBurst fires above this many non-finite steps in 5 minutes "
                   f"(default: {dashboards.DEFAULT_BURST_THRESHOLD})")
    p.add_argument("--skip-rate-threshold", type=_precision_fraction, action="append", default=[],
                   metavar="PRECISION=FRACTION",
                   help="AmpguardSkipRate fires when a run of that precision skips more than this fraction of its "
                   "steps (5-minute rate) for 10 minutes; repeat per precision (default: "
                   + " ".join(f"{p}={t:g}" for p, t in dashboards.DEFAULT_SKIP_RATE_THRESHOLDS.items()) + ")")
    p.add_argument("--grad-growth-factor", type=float, default=dashboards.DEFAULT_GRAD_GROWTH_FACTOR,
                   help="AmpguardModuleGradNormGrowth fires when a module's median gradient norm over the window is "
                   "more than this factor times the window before's "
                   f"(default: {dashboards.DEFAULT_GRAD_GROWTH_FACTOR:g})")
    p.add_argument("--grad-growth-window", default=dashboards.DEFAULT_GRAD_GROWTH_WINDOW,
                   help="that window, a Prometheus duration of at least 10m "
                   f"(default: {dashboards.DEFAULT_GRAD_GROWTH_WINDOW})")
    p.add_argument("--test-job", default=None,
                   help="job label of the synthetic series in the rule tests; must match --job-selector (default: "
                   f"the selector's job=\"...\" value, else {dashboards.DEFAULT_TEST_JOB})")


@contextlib.contextmanager
def _preflight_script(spec: str) -> Iterator[Callable[[], dict[str, Any]]]:
    """``FILE.py:FUNCTION``'s function, with FILE's directory first on ``sys.path`` while the preflight
    runs (process-wide, as ``python FILE.py`` would have it: the script's own imports of its sibling
    modules work, also inside its factories); taken off again on exit."""
    path, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--script {spec!r}: expected FILE.py:FUNCTION")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--script: no such file {path!r}")
    module_spec = importlib.util.spec_from_file_location(file.stem, file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    where = str(file.parent.resolve())
    sys.path.insert(0, where)
    try:
        module_spec.loader.exec_module(module)
        fn = getattr(module, name, None)
        if not callable(fn):
            raise ValueError(f"--script: {path} has no function {name!r}")
        yield fn
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(where)


def _preflight(_: argparse.Namespace, argv: list[str]) -> int:
    """``ampguard preflight --script train.py:make_preflight [--steps N] [--precision fp16,bf16]``: parses
    its own arguments (``argv``, the strings after the command word)."""
    p = argparse.ArgumentParser(
        prog="ampguard preflight",
        description="Try a short run on one device for each precision and recommend precision, initial loss "
        "scale and config. FUNCTION() returns a dict with model_fn, batch_fn, optimizer_fn (and optionally "
        "loss_fn) as taken by ampguard.preflight().",
    )
    p.add_argument("--script", required=True, help="FILE.py:FUNCTION")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--precision", default="fp16,bf16",
                   help="comma-separated candidates of fp16, bf16, fp32 and fp8 (torchao float8 under bf16 "
                   "autocast, emulated where the device has no fp8 matmul) (default: fp16,bf16)")
    p.add_argument("--device", default=None)
    p.add_argument("--json", action="store_true", help="print the recommendation as JSON")
    p.add_argument("--warn-after", type=float, default=WARN_AFTER_S, metavar="S",
                   help="warn as soon as the first trial step says the preflight will take longer than S seconds "
                   f"(default: {WARN_AFTER_S:g})")
    args = p.parse_args(argv)
    handler = _StderrLines()
    # the slow-step warning, in the command's words, above the progress bar (on the process-wide
    # "ampguard.preflight" logger while the command runs; removed again below)
    preflight_log.addHandler(handler)
    try:
        with _preflight_script(args.script) as make:
            factories = make()
            with _progress_bar() as progress:
                rec = preflight(factories["model_fn"], factories["batch_fn"], factories["optimizer_fn"],
                                loss_fn=factories.get("loss_fn"), steps=args.steps,
                                precision=tuple(s.strip() for s in args.precision.split(",") if s.strip()),
                                device=args.device, warn_after_s=args.warn_after, progress=progress)
    except (ValueError, KeyError, AmpGuardError) as exc:
        print(f"ampguard preflight: error: {exc}", file=sys.stderr)
        return 2
    finally:
        preflight_log.removeHandler(handler)
    print(json.dumps(rec.to_dict(), indent=2, default=str) if args.json else rec)
    return 0


class _StderrLines(logging.Handler):
    """``ampguard preflight: warning: ...`` on the stderr of the moment (rich's progress bar swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"ampguard preflight: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _progress_bar(console: Any = None) -> Iterator[Progress]:
    """A progress bar with the time left on stderr (rich, on a terminal); elsewhere a line as each
    candidate's trial starts."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar
    except ImportError:
        console = None
    else:
        console = console if console is not None else Console(stderr=True)
    if console is None or not console.is_terminal:
        started: set[str] = set()

        def lines(done: int, total: int, precision: str) -> None:
            if precision not in started:
                started.add(precision)
                print(f"ampguard preflight: {precision} trial ({done}/{total} trial steps done)", file=sys.stderr,
                      flush=True)

        yield lines
        return
    bar = Bar(TextColumn("preflight: {task.description} trial"), BarColumn(), MofNCompleteColumn(),
              TextColumn("steps, eta"), TimeRemainingColumn(), console=console, transient=True, redirect_stderr=True)
    with bar:
        task = bar.add_task("...", total=None)
        yield lambda done, total, precision: bar.update(task, completed=done, total=total, description=precision)


# ---------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    """``ampguard``'s parser: a subparser per command, whose defaults hold its handler (``func``),
    the subparser itself (``command_parser``, for usage errors) and ``own_parser``."""
    parser = argparse.ArgumentParser(
        prog="ampguard",
        description="Numerical-stability middleware for mixed-precision PyTorch training.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ampguard {__version__}",
                        help="print the version and exit")
    # The epilog lists the commands; argparse's own listing would repeat it.
    commands = parser.add_subparsers(dest="command", help=argparse.SUPPRESS, parser_class=argparse.ArgumentParser)

    def command(name: str, func: _Handler, *, own_parser: bool = False, **kwargs: Any) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = commands.add_parser(name, **kwargs)
        sub.set_defaults(func=func, command_parser=sub, own_parser=own_parser)
        return sub

    # demo and preflight parse their own arguments (and print their own help): the argument
    # strings after the command word are handed to them as given.
    command("demo", _demo, own_parser=True, add_help=False)
    command("preflight", _preflight, own_parser=True, add_help=False)
    runlog.build_parser(parser=command("report", _report))
    _dashboards_arguments(command(
        "dashboards", _dashboards,
        description="Write the Grafana dashboard, the Prometheus recording + alerting rules and their promtool "
        "tests, generated from the metric catalogue (the monitoring-mixin shape; each file fits a ConfigMap).",
    ))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 2
    if argv[0] not in (*_COMMANDS, "-h", "--help", "--version"):
        parser.print_usage(sys.stderr)
        print(f"ampguard: error: unknown command {argv[0]!r} (choose from {', '.join(_COMMANDS)})", file=sys.stderr)
        return 2
    args, rest = parser.parse_known_args(argv)  # -h and --version exit here: argv[0] is the command below
    if rest and not args.own_parser:
        args.command_parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handler: _Handler = args.func
    return handler(args, argv[1:])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
