"""The generated dashboard and rules: checked-in == generated, and the checks grafana's
dashboard-linter applies (no Grafana server runs here)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from ampguard import dashboards
from ampguard import metrics as M

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "dashboards"
DASH = dashboards.build_dashboard()
RANGE_FN = re.compile(r"\b(rate|irate|increase|delta|idelta|deriv)\(([^()]*)\[([^\]]+)\]\)")
METRIC = re.compile(r"(?<![:\w])(ampguard_[a-z0-9_]+)(?![:\w])")  # not inside a recording-rule name


def _panels() -> list[dict]:
    return [p for p in DASH["panels"] if p["type"] != "row"]


def _exprs() -> list[tuple[str, str]]:
    exprs = [(p["title"], t["expr"]) for p in _panels() for t in p["targets"]]
    exprs += [(a["name"], a["expr"]) for a in DASH["annotations"]["list"] if "expr" in a]
    return exprs


def test_checked_in_files_equal_what_the_generator_writes(tmp_path):
    written = dashboards.write_all(tmp_path)
    assert sorted(p.name for p in written) == sorted(
        [dashboards.DASHBOARD_FILE, dashboards.RULES_FILE, dashboards.RULES_TEST_FILE])
    for path in written:
        checked_in = CHECKED_IN / path.name
        assert checked_in.exists(), f"{checked_in} missing: run python -m ampguard.dashboards"
        assert checked_in.read_text() == path.read_text(), (
            f"{checked_in} is stale: regenerate with python -m ampguard.dashboards")
    json.loads((CHECKED_IN / dashboards.DASHBOARD_FILE).read_text())


# ---------------------------------------------------------------------------------- dashboard lint
def test_template_variables():
    variables = {v["name"]: v for v in DASH["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for name in ("job", "rank"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert v["includeAll"] and v["multi"]
        assert v["definition"].startswith("label_values(") and v["definition"].endswith(f", {name})")
    assert 'job=~"$job"' in variables["rank"]["definition"]  # rank options follow the chosen job


def test_every_panel_uses_the_datasource_variable_and_has_unit_and_description():
    ids = [p["id"] for p in DASH["panels"]]
    assert len(ids) == len(set(ids))
    for p in _panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
        assert len(p["description"]) > 20, p["title"]
        assert p["title"] and p["gridPos"]["w"] > 0 and p["gridPos"]["h"] > 0
    assert DASH["uid"] and DASH["title"] and DASH["schemaVersion"] >= 36


def test_every_query_is_templated_on_job_and_rank():
    for title, expr in _exprs():
        selectors = re.findall(r"([\w:]*)\{([^{}]*)\}", re.sub(r"\{\{[^}]*\}\}", "", expr))
        assert selectors, (title, expr)
        for name, sel in selectors:
            assert 'job=~"$job"' in sel, (title, expr)
            if name not in ("up", "ALERTS") and ":" not in name:  # a job-level recording rule has no rank
                assert 'rank=~"$rank"' in sel, (title, expr)


def test_rate_and_increase_use_rate_interval():
    found = 0
    for title, expr in _exprs():
        for _fn, _arg, window in RANGE_FN.findall(expr):
            found += 1
            assert window == "$__rate_interval", (title, expr)
        assert not re.search(r"\[\d+[smhd]\]", expr), (title, expr)  # no fixed windows
    assert found >= 5


def test_queries_use_only_catalogue_metrics_and_counters_only_under_rate():
    for title, expr in _exprs():
        for name in METRIC.findall(expr):
            metric = M.by_name(name)
            if metric.type == "counter" and "rate(" not in expr and "increase(" not in expr:
                # a raw counter is shown only as a run total (stat, table)
                assert any(p["type"] in ("stat", "table") for p in _panels() if p["title"] == title), (title, expr)


def test_required_panels_are_there():
    types = {p["title"]: p["type"] for p in _panels()}
    for title, kind in {
        "Non-finite steps": "stat",
        "Skip ratio": "stat",
        "Lowest loss scale": "stat",
        "Seconds since last step": "stat",
        "Ranks up": "stat",
        "Loss scale per rank": "timeseries",
        "Skipped steps per rank": "timeseries",
        "Non-finite steps per rank": "timeseries",
        "Gradient norm distribution": "heatmap",
        "Gradient norm (last step)": "timeseries",
        "Per-rank summary": "table",
        "Skip rate by precision": "timeseries",
        "Loss scale vs floor": "timeseries",
    }.items():
        assert types.get(title) == kind, title
    records = [r["record"] for g in dashboards.build_rules()["groups"] for r in g["rules"] if "record" in r]
    by_precision = next(p for p in _panels() if p["title"] == "Skip rate by precision")
    assert by_precision["targets"][0]["expr"].split("{")[0] in records  # the rule AmpguardSkipRate uses
    floor = next(p for p in _panels() if p["title"] == "Loss scale vs floor")
    assert [M.LOSS_SCALE.name in t["expr"] for t in floor["targets"]] == [True, True]
    assert M.LOSS_SCALE_FLOOR.name in floor["targets"][1]["expr"]
    scale = next(p for p in _panels() if p["title"] == "Loss scale per rank")
    assert scale["fieldConfig"]["defaults"]["custom"]["scaleDistribution"] == {"type": "log", "log": 2}
    names = [a["name"] for a in DASH["annotations"]["list"]]
    assert "Skipped steps" in names and "Firing alerts" in names


# ---------------------------------------------------------------------------------- rules
def test_rules_have_every_alert_with_severity_summary_description():
    rules = dashboards.build_rules()
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert tuple(alerts) == dashboards.ALERTS
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name
    records = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    assert all(re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", r) for r in records), records
    # every metric the rules read is defined in ampguard.metrics (MODULE_GRAD_NORM before it is exported)
    defined = {m.name: m for m in vars(M).values() if isinstance(m, M.Metric)}
    for g in rules["groups"]:
        for r in g["rules"]:
            for name in METRIC.findall(r["expr"]):
                assert defined.get(name) or M.by_name(name)


def test_burst_threshold_selector_and_fors_are_configurable():
    rules = dashboards.build_rules(burst_threshold=25, job_selector='job=~"llm-.*"',
                                   fors={"AmpguardNonFiniteBurst": "1s"}, interval="5s")
    burst = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "AmpguardNonFiniteBurst")
    assert burst["expr"].endswith("> 25") and burst["for"] == "1s"
    assert all(g["interval"] == "5s" for g in rules["groups"])
    recording = [r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    assert all('{job=~"llm-.*"}' in e for e in recording)
    assert dashboards.build_rules()["groups"][1]["rules"][0]["expr"].endswith("> 10")
    with pytest.raises(ValueError, match="unknown alerts"):
        dashboards.build_rules(fors={"Nope": "1s"})
    with pytest.raises(ValueError, match="burst_threshold"):
        dashboards.build_rules(burst_threshold=-1)


def test_burst_threshold_is_at_least_one_as_on_the_command_line():
    # The alert fires above the threshold: 0 would page on every non-finite step (each fp16 overflow).
    assert dashboards.MIN_BURST_THRESHOLD == 1
    burst = next(r for g in dashboards.build_rules(burst_threshold=1)["groups"] for r in g["rules"]
                 if r.get("alert") == "AmpguardNonFiniteBurst")
    assert burst["expr"].endswith("> 1")
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match=rf"burst_threshold={bad!r}; allowed: an int >= 1"):
            dashboards.build_rules(burst_threshold=bad)  # type: ignore[arg-type]


def _alert(rules: dict, name: str) -> dict:
    return next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == name)


def test_skip_rate_is_recorded_per_precision_with_a_threshold_per_precision():
    rules = dashboards.build_rules()
    record = next(r for g in rules["groups"] for r in g["rules"]
                  if r.get("record", "").startswith("job_precision:"))
    # the precision comes from each rank's run-info series, joined on what identifies a rank's endpoint
    assert "group_left (precision) " + M.RUN_INFO.name in record["expr"]
    assert "on (job, instance, rank, local_rank)" in record["expr"]
    expr = _alert(rules, "AmpguardSkipRate")["expr"]
    assert expr == " or ".join(f'{record["record"]}{{precision="{p}"}} > {t!r}'
                               for p, t in dashboards.DEFAULT_SKIP_RATE_THRESHOLDS.items())
    assert dashboards.DEFAULT_SKIP_RATE_THRESHOLDS["fp16"] > dashboards.DEFAULT_SKIP_RATE_THRESHOLDS["bf16"] == 0
    custom = _alert(dashboards.build_rules(skip_rate_thresholds={"bf16": 0.001}), "AmpguardSkipRate")["expr"]
    assert 'precision="bf16"} > 0.001' in custom and 'precision="fp16"} > 0.01' in custom
    for bad, match in (({"tf32": 0.1}, "unknown precisions"), ({"bf16": 1}, "allowed: a fraction in"),
                       ({"fp16": -0.1}, "allowed: a fraction in"), ({"fp32": True}, "allowed: a fraction in")):
        with pytest.raises(ValueError, match=match):
            dashboards.build_rules(skip_rate_thresholds=bad)


def test_scale_floor_alert_compares_the_scale_with_the_exported_floor():
    expr = _alert(dashboards.build_rules(), "AmpguardLossScaleAtFloor")["expr"]
    assert expr == f"max by (job) ({M.LOSS_SCALE.name} <= {M.LOSS_SCALE_FLOOR.name})"
    assert M.LOSS_SCALE_FLOOR in M.CATALOGUE


def test_module_grad_norm_growth_factor_and_window_are_configurable():
    rule = _alert(dashboards.build_rules(grad_growth_factor=4, grad_growth_window="2h", job_selector='job="a"'),
                  "AmpguardModuleGradNormGrowth")
    norm = M.MODULE_GRAD_NORM.name + '{job="a"}'
    assert rule["expr"] == (f"quantile_over_time(0.5, {norm}[2h]) / (quantile_over_time(0.5, {norm}[2h] offset 2h)"
                            " > 0) > 4")
    assert "2h" in rule["annotations"]["description"] and "{{ $labels.module }}" in rule["annotations"]["summary"]
    for kw, match in (({"grad_growth_factor": 1}, "grad_growth_factor=1"),
                      ({"grad_growth_factor": math.inf}, "grad_growth_factor=inf"),
                      ({"grad_growth_window": "5m"}, "grad_growth_window='5m'"),
                      ({"grad_growth_window": "30"}, "grad_growth_window='30'")):
        with pytest.raises(ValueError, match=match):
            dashboards.build_rules(**kw)


def test_rule_tests_cover_every_alert_firing_and_silent():
    doc = yaml.safe_load((CHECKED_IN / dashboards.RULES_TEST_FILE).read_text())
    fires: set[str] = set()
    silent: set[str] = set()
    for t in doc["tests"]:
        for case in t["alert_rule_test"]:
            (fires if case["exp_alerts"] else silent).add(case["alertname"])
    assert fires == set(dashboards.ALERTS) and silent == set(dashboards.ALERTS)
    # the skip-rate recording rule: checked for each precision (and on the healthy run)
    exprs = [e for t in doc["tests"] for e in t.get("promql_expr_test", [])]
    precisions = {re.search(r'precision="(\w+)"', s["labels"]).group(1) for e in exprs for s in e["exp_samples"]}
    assert precisions == set(dashboards.DEFAULT_SKIP_RATE_THRESHOLDS)
    assert doc["rule_files"] == [dashboards.RULES_FILE]


def _row(title: str) -> list[dict]:
    """The panels of the row ``title`` (up to the next row), checked to sit below every panel before it."""
    panels = DASH["panels"]
    row = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == title)
    end = next((i for i in range(row + 1, len(panels)) if panels[i]["type"] == "row"), len(panels))
    above = panels[:row]
    assert panels[row]["gridPos"]["y"] >= max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in above), title
    assert all(p["gridPos"]["y"] > panels[row]["gridPos"]["y"] for p in panels[row + 1 : end]), title
    return panels[row + 1 : end]


def test_leading_indicator_panels_sit_in_a_row_of_their_own_below_the_rest():
    mine = _row("Leading indicators")
    assert [p["title"] for p in mine] == ["Gradient norm per module", "Update ratio per module"]
    for p, metric in zip(mine, M.PER_MODULE):
        assert [t["expr"] for t in p["targets"]] == [f'max by (module) ({metric.name}{{job=~"$job", rank=~"$rank"}})']
        assert p["targets"][0]["legendFormat"] == "{{module}}"
        assert p["fieldConfig"]["defaults"]["custom"]["scaleDistribution"]["type"] == "log"


def test_fp8_row_shows_each_fp8_metric_of_the_catalogue_per_module_role_and_rank():
    mine = _row("fp8 casts (torchao float8)")
    assert DASH["panels"][-1] is mine[-1]  # the last row
    titles = ["fp8 amax per module and role", "fp8 scale per module and role", "fp8 underflow ratio",
              "fp8 dynamic range (log2)", "fp8 non-finite casts"]
    assert [p["title"] for p in mine] == titles
    exprs = [[t["expr"] for t in p["targets"]] for p in mine]
    assert all(len(e) == 1 for e in exprs)
    # one catalogue metric per panel (test_queries_use_only_catalogue_metrics... checks every name is the
    # catalogue's): the five fp8 metrics, in the catalogue's order, grouped by the catalogue's labels
    named = [METRIC.findall(e[0]) for e in exprs]
    assert [M.by_name(n[0]) for n in named] == list(M.FP8) and all(len(n) == 1 for n in named)
    for p, metric in zip(mine, M.FP8):
        assert set(metric.labels) | set(M.RANK_LABELS) >= {"module", "role", "rank"}
        assert " by (module, role, rank) " in p["targets"][0]["expr"], p["title"]
        assert p["targets"][0]["legendFormat"] == "{{module}} {{role}} rank {{rank}}"
    assert exprs[4] == [f'sum by (module, role, rank) (increase({M.FP8_NONFINITE.name}{{job=~"$job", rank=~"$rank"}}'
                        '[$__rate_interval]))']
    amax, scale, under = (p["fieldConfig"]["defaults"] for p in mine[:3])
    assert amax["custom"]["scaleDistribution"]["type"] == "log"
    assert scale["custom"]["scaleDistribution"] == {"type": "log", "log": 2}
    # the underflow ratio's red line is the threshold AmpguardFp8UnderflowRising uses
    assert under["unit"] == "percentunit" and under["custom"]["thresholdsStyle"] == {"mode": "line"}
    line = under["thresholds"]["steps"][-1]["value"]
    rule = _alert(dashboards.build_rules(), "AmpguardFp8UnderflowRising")["expr"]
    assert f") > {line!r} and " in rule and line == dashboards.FP8_UNDERFLOW_THRESHOLD
