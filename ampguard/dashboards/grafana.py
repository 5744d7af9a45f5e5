"""The Grafana dashboard (classic JSON model) and its rendering."""

from __future__ import annotations

import json
from typing import Any

from .. import metrics as M
from .panels import (
    _DS,
    _JOB,
    _below,
    _fp8_panels,
    _indicator_panels,
    _integrity_panels,
    _numerics_panels,
    _panel,
    _precision_panels,
    _q,
    _target,
)

DASHBOARD_UID = "ampguard-numerics"
DASHBOARD_FILE = "ampguard.json"


def build_dashboard() -> dict[str, Any]:
    """The Grafana dashboard (classic JSON model, schemaVersion 39)."""
    rate = "$__rate_interval"
    skipped, nonfinite, steps = M.SKIPPED_STEPS, M.NONFINITE_STEPS, M.STEPS
    scale, last = M.LOSS_SCALE, M.LAST_STEP_TIMESTAMP
    stat_opts = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "value"}
    red_above = lambda v: {  # noqa: E731 - tiny local helper
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "red", "value": v}]}
    }
    panels: list[dict[str, Any]] = [
        _panel(1, "row", "Health", "Run-level numbers; every rank holds the same global decision.", "none", [],
               (0, 0, 24, 1), collapsed=False),
        _panel(
            2, "stat", "Non-finite steps", "Steps that saw NaN/inf loss or gradients since the run started "
            "(max over ranks: every rank counts the same global steps).", "short",
            [_target(f"max(sum without (kind) ({_q(nonfinite)}))", "non-finite steps")],
            (0, 1, 5, 4), options=stat_opts, defaults=red_above(1),
        ),
        _panel(
            3, "stat", "Skip ratio", "Fraction of steps skipped (non-finite values or spikes) over the rate "
            "interval.", "percentunit",
            [_target(f"max(sum without (reason) (rate({_q(skipped)}[{rate}])))\n  / max(rate({_q(steps)}[{rate}]))",
                     "skip ratio")],
            (5, 1, 5, 4), options=stat_opts, defaults=red_above(0.1),
        ),
        _panel(
            4, "stat", "Lowest loss scale", "Smallest loss scale that multiplied the last step's loss, across "
            "the selected ranks (fp16; 1 for bf16/fp32). Below 1 means gradients overflow even unscaled.", "short",
            [_target(f"min({_q(scale)})", "lowest loss scale")],
            (10, 1, 5, 4), options=stat_opts,
        ),
        _panel(
            5, "stat", "Seconds since last step", "Time since the most recent step of any selected rank; grows "
            "when training hangs.", "s",
            [_target(f"time() - max({_q(last)} > 0)", "since last step")],
            (15, 1, 5, 4), options=stat_opts, defaults=red_above(600),
        ),
        _panel(
            6, "stat", "Ranks up", "Metric endpoints of the job that Prometheus scraped successfully.", "short",
            [_target(f"sum(up{{{_JOB}}})", "ranks up")],
            (20, 1, 4, 4), options=stat_opts,
        ),
        _panel(
            7, "timeseries", "Loss scale per rank", "fp16 loss scale that multiplied each rank's last step (log2 "
            "axis). Ranks must agree: a rank apart from the others has diverged.", "short",
            [_target(_q(scale), "rank {{rank}}")],
            (0, 5, 12, 8), defaults={"custom": {"scaleDistribution": {"type": "log", "log": 2}}},
        ),
        _panel(
            8, "timeseries", "Skipped steps per rank", "Skipped steps per second, by rank and reason.", "cps",
            [_target(f"sum by (rank, reason) (rate({_q(skipped)}[{rate}]))", "rank {{rank}} {{reason}}")],
            (12, 5, 12, 8),
        ),
        _panel(
            9, "timeseries", "Non-finite steps per rank", "Steps per second that saw NaN/inf, by rank and kind "
            "(loss or grad).", "cps",
            [_target(f"sum by (rank, kind) (rate({_q(nonfinite)}[{rate}]))", "rank {{rank}} {{kind}}")],
            (0, 13, 12, 8),
        ),
        _panel(
            10, "timeseries", "Non-finite origin per rank", "Non-finite steps per second whose NaN/inf started on "
            "that rank: the one bad rank stands out.", "cps",
            [_target(f"sum by (rank) (rate({_q(M.NONFINITE_ORIGIN)}[{rate}]))", "rank {{rank}}")],
            (12, 13, 12, 8),
        ),
        _panel(
            11, "heatmap", "Gradient norm distribution", "Finite global gradient norms per time bucket (histogram "
            "buckets; non-finite norms are not observed).", "short",
            [_target(f"sum by (le) (increase({_q(M.GRAD_NORM_HISTOGRAM, '_bucket')}[{rate}]))", "{{le}}",
                     format="heatmap")],
            (0, 21, 12, 8),
            options={"calculate": False, "yAxis": {"unit": "short"}, "cellValues": {"unit": "short"}},
        ),
        _panel(
            12, "timeseries", "Gradient norm (last step)", "Global L2 norm of the unscaled gradients at the last "
            "step of each rank (gaps: NaN/inf).", "short",
            [_target(_q(M.GRAD_NORM), "rank {{rank}}")],
            (12, 21, 12, 8), defaults={"custom": {"scaleDistribution": {"type": "log", "log": 10}}},
        ),
        _panel(
            13, "timeseries", "Loss", "Loss of the last step of each rank (gaps: NaN/inf).", "short",
            [_target(_q(M.LOSS), "rank {{rank}}")],
            (0, 29, 12, 8),
        ),
        _panel(
            14, "timeseries", "Loss-scale changes", "Loss-scale backoffs and growths per second.", "cps",
            [
                _target(f"sum by (rank) (rate({_q(M.SCALE_BACKOFFS)}[{rate}]))", "rank {{rank}} backoff", "A"),
                _target(f"sum by (rank) (rate({_q(M.SCALE_GROWTHS)}[{rate}]))", "rank {{rank}} growth", "B"),
            ],
            (12, 29, 12, 8),
        ),
        _panel(
            16, "timeseries", "Device memory peak per rank", "Peak CUDA memory, allocated and reserved by the "
            "caching allocator: its high-water mark, read by the exporter (empty for CPU runs). Half of why one "
            "trains in mixed precision.",
            "bytes",
            [_target(f"max by (rank, kind) ({_q(M.DEVICE_MEMORY_PEAK)})", "rank {{rank}} {{kind}}")],
            (0, 37, 12, 8),
        ),
        _panel(
            17, "timeseries", "Transient faults per rank", "Non-finite steps a replay did not reproduce, by the "
            "rank they started on: repeated ones on one rank point at bad hardware.", "short",
            [_target(f"sum by (rank) (increase({_q(M.TRANSIENT_FAULTS)}[{rate}]))", "rank {{rank}}")],
            (12, 37, 12, 8),
        ),
        _panel(
            18, "timeseries", "Exporters", "Per rank and exporter: up (1 while it works, 0 from a failed call until "
            "a retry works; ampguard retries with backoff and holds the last steps for it) and its failed calls "
            "per interval. A JSONL exporter down means a gap in the event log until it recovers.", "short",
            [
                _target(f"min by (rank, exporter) ({_q(M.EXPORTER_UP)})", "rank {{rank}} {{exporter}} up", "A"),
                _target(f"sum by (rank, exporter) (increase({_q(M.EXPORTER_ERRORS)}[{rate}]))",
                        "rank {{rank}} {{exporter}} errors", "B"),
            ],
            (0, 53, 24, 8),
        ),
        _panel(
            15, "table", "Per-rank summary", "One row per rank: steps, skipped, non-finite origin, loss scale, "
            "consistency failures. The bad rank is the odd one out.", "short",
            [
                _target(f"max by (rank) ({_q(steps)})", "", "A", instant=True, format="table"),
                _target(f"sum by (rank) ({_q(skipped)})", "", "B", instant=True, format="table"),
                _target(f"sum by (rank) ({_q(M.NONFINITE_ORIGIN)})", "", "C", instant=True, format="table"),
                _target(f"max by (rank) ({_q(scale)})", "", "D", instant=True, format="table"),
                _target(f"sum by (rank) ({_q(M.RANK_DIVERGENCE)})", "", "E", instant=True, format="table"),
            ],
            (0, 45, 24, 8),
            transformations=[
                {"id": "merge", "options": {}},
                {
                    "id": "organize",
                    "options": {
                        "excludeByName": {"Time": True},
                        "renameByName": {
                            "Value #A": "steps",
                            "Value #B": "skipped",
                            "Value #C": "non-finite origin",
                            "Value #D": "loss scale",
                            "Value #E": "divergence",
                        },
                    },
                },
            ],
        ),
    ]
    rows = (_precision_panels, _numerics_panels, _indicator_panels, _integrity_panels, _fp8_panels)
    for row in rows:  # each below the last
        panels += row(*_below(panels))
    annotations = [
        {
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        },
        {
            "datasource": _DS,
            "enable": True,
            "iconColor": "orange",
            "name": "Skipped steps",
            "expr": f"sum by (rank, reason) (increase({_q(skipped)}[{rate}])) > 0",
            "step": "15s",
            "titleFormat": "skipped steps",
            "textFormat": "rank {{rank}}: {{reason}}",
            "tagKeys": "rank,reason",
        },
        {
            "datasource": _DS,
            "enable": True,
            "iconColor": "red",
            "name": "Firing alerts",
            "expr": f'ALERTS{{alertname=~"Ampguard.*", alertstate="firing", {_JOB}}}',
            "step": "15s",
            "titleFormat": "{{alertname}}",
            "textFormat": "{{job}} {{rank}}",
            "tagKeys": "alertname,severity",
        },
    ]
    templating = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
            "regex": "",
        },
        {
            "name": "job",
            "label": "Job",
            "type": "query",
            "datasource": _DS,
            "query": {"query": f"label_values({M.STEPS.name}, job)", "refId": "job"},
            "definition": f"label_values({M.STEPS.name}, job)",
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "current": {},
            "sort": 1,
        },
        {
            "name": "rank",
            "label": "Rank",
            "type": "query",
            "datasource": _DS,
            "query": {"query": f'label_values({M.STEPS.name}{{{_JOB}}}, rank)', "refId": "rank"},
            "definition": f'label_values({M.STEPS.name}{{{_JOB}}}, rank)',
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "current": {},
            "sort": 3,
        },
        {
            "name": "group",
            "label": "Param group",
            "type": "query",
            "datasource": _DS,
            "query": {"query": f'label_values({M.GRAD_ZERO_FRACTION.name}{{{_JOB}}}, group)', "refId": "group"},
            "definition": f'label_values({M.GRAD_ZERO_FRACTION.name}{{{_JOB}}}, group)',
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "current": {},
            "sort": 1,
        },
    ]
    return {
        "__inputs": [],
        "uid": DASHBOARD_UID,
        "title": "ampguard: training numerics",
        "description": "Loss scale, non-finite values, skipped steps and gradient norms per rank, from ampguard's "
        "PrometheusExporter.",
        "tags": ["ampguard", "training", "pytorch"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "annotations": {"list": annotations},
        "templating": {"list": templating},
        "panels": panels,
        "links": [],
    }


def dashboard_queries(dashboard: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target of every panel."""
    d = dashboard if dashboard is not None else build_dashboard()
    return [(p["title"], t["expr"]) for p in d["panels"] for t in p.get("targets", [])]


def render_dashboard() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=False) + "\n"

