"""The Grafana dashboard, Prometheus recording/alert rules and promtool rule tests, built from
:mod:`ampguard.metrics` (metric names are never spelled here: every one comes from the catalogue).

``write_all(out_dir)`` writes ``ampguard.json``, ``ampguard.rules.yml`` and
``ampguard.rules.test.yml``; the checked-in copies in ``dashboards/`` are its output with
the defaults (a test checks they are equal; regenerate with ``python -m ampguard.dashboards``).

What a "run" is for the rules: the Prometheus ``job`` (one scrape job per training run, as
in the README examples). Every rank reports the same global decision, so run-level numbers
take the ``max`` over ranks rather than the sum.

The modules, each owning one artefact or the part the others share:

- :mod:`.selectors`: the job selector (PromQL label matchers) and the rule tests' series labels;
- :mod:`.rules`: the rules document, its options and their defaults, the alert names;
- :mod:`.rule_tests`: the promtool tests of those rules;
- :mod:`.panels` and :mod:`.grafana`: the dashboard's panel helpers and the dashboard itself.

Nothing here is imported by ``import ampguard``; the ``ampguard dashboards`` command and the
tests import this package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .grafana import DASHBOARD_FILE, DASHBOARD_UID, build_dashboard, dashboard_queries, render_dashboard
from .rule_tests import RULES_TEST_FILE, build_rule_tests, render_rule_tests
from .rules import (
    ALERTS,
    DEFAULT_BURST_THRESHOLD,
    DEFAULT_GRAD_GROWTH_FACTOR,
    DEFAULT_GRAD_GROWTH_WINDOW,
    DEFAULT_SKIP_RATE_THRESHOLDS,
    FP8_UNDERFLOW_THRESHOLD,
    MIN_BURST_THRESHOLD,
    RULES_FILE,
    build_rules,
    render_rules,
)
from .selectors import DEFAULT_TEST_JOB, Matcher, parse_selector

__all__ = [
    "ALERTS",
    "DASHBOARD_FILE",
    "DASHBOARD_UID",
    "DEFAULT_BURST_THRESHOLD",
    "DEFAULT_GRAD_GROWTH_FACTOR",
    "DEFAULT_GRAD_GROWTH_WINDOW",
    "DEFAULT_SKIP_RATE_THRESHOLDS",
    "DEFAULT_TEST_JOB",
    "FP8_UNDERFLOW_THRESHOLD",
    "MIN_BURST_THRESHOLD",
    "RULES_FILE",
    "RULES_TEST_FILE",
    "Matcher",
    "build_dashboard",
    "build_rule_tests",
    "build_rules",
    "dashboard_queries",
    "parse_selector",
    "render_dashboard",
    "render_rule_tests",
    "render_rules",
    "write_all",
]


def write_all(
    out_dir: str | os.PathLike[str] = "dashboards",
    job_selector: str = "",
    burst_threshold: int = DEFAULT_BURST_THRESHOLD,
    test_job: str | None = None,
    *,
    skip_rate_thresholds: Mapping[str, float] | None = None,
    grad_growth_factor: float = DEFAULT_GRAD_GROWTH_FACTOR,
    grad_growth_window: str = DEFAULT_GRAD_GROWTH_WINDOW,
) -> list[Path]:
    """Write the dashboard, the rules and their promtool tests into ``out_dir``; return the paths.

    ``job_selector`` (PromQL label matchers, e.g. ``'job=~"llm-.*"'``; checked by
    :func:`parse_selector`) restricts every rule to matching series; ``burst_threshold`` is
    AmpguardNonFiniteBurst's threshold; ``test_job`` is the job label of the rule tests' synthetic
    series (it must match ``job_selector``; None: see :func:`build_rule_tests`); the other options
    are :func:`build_rules`'s. Every file is rendered, and every option checked (``ValueError``),
    before anything is written."""
    options: dict[str, Any] = {
        "job_selector": job_selector, "burst_threshold": burst_threshold, "skip_rate_thresholds": skip_rate_thresholds,
        "grad_growth_factor": grad_growth_factor, "grad_growth_window": grad_growth_window,
    }
    files = {
        DASHBOARD_FILE: render_dashboard(),
        RULES_FILE: render_rules(**options),
        RULES_TEST_FILE: render_rule_tests(test_job=test_job, **options),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths
