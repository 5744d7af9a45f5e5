"""The ``ampguard`` command: ``demo``, ``report``, ``dashboards``.

Exit codes: 0 success, 1 the command ran and failed, 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]

_EPILOG = """commands:
  demo        train a small transformer on 2 CPU ranks in fp16 with injected faults, live
  report      summarise a run's event logs and draw its story in one picture
  dashboards  write the Grafana dashboard, Prometheus rules and rule tests
  preflight   try a short run per precision and recommend precision, initial scale, config

'ampguard COMMAND --help' describes each one."""


def _dashboards(argv: list[str]) -> int:
    from . import dashboards

    p = argparse.ArgumentParser(
        prog="ampguard dashboards",
        description="Write the Grafana dashboard, the Prometheus recording + alerting rules and their promtool "
        "tests, generated from the metric catalogue (the monitoring-mixin shape; each file fits a ConfigMap).",
    )
    p.add_argument("--out", default="dashboards", help="output directory (default: dashboards/)")
    p.add_argument("--job-selector", default="",
                   help="PromQL label matchers added to every rule, e.g. 'job=~\"llm-.*\"' (default: none)")
    p.add_argument("--burst-threshold", type=int, default=dashboards.DEFAULT_BURST_THRESHOLD,
                   help="AmpguardNonFiniteBurst fires above this many non-finite steps in 5 minutes "
                   f"(default: {dashboards.DEFAULT_BURST_THRESHOLD})")
    p.add_argument("--test-job", default="train",
                   help="job label of the synthetic series in the rule tests; must match --job-selector")
    args = p.parse_args(argv)
    if args.burst_threshold < 1:
        p.error("--burst-threshold must be >= 1")
    try:
        paths = dashboards.write_all(
            args.out, job_selector=args.job_selector, burst_threshold=args.burst_threshold, test_job=args.test_job
        )
    except (OSError, ValueError) as exc:
        print(f"ampguard dashboards: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ampguard",
        description="Numerical-stability middleware for mixed-precision PyTorch training.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument(
        "command", nargs="?", choices=("demo", "report", "dashboards", "preflight"), help=argparse.SUPPRESS
    )
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__

        print(f"ampguard {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from . import demo

        return demo.main(rest)
    if command == "report":
        from . import runlog

        return runlog.report_main(rest)
    if command == "dashboards":
        return _dashboards(rest)
    if command == "preflight":
        from .preflight import preflight_main

        return preflight_main(rest)
    parser.print_usage(sys.stderr)
    print(f"ampguard: error: unknown command {command!r} (choose from demo, report, dashboards, preflight)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
