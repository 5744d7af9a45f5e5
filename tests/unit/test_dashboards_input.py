"""``ampguard dashboards`` checks its selector and test job before it writes anything.

A selector that is not PromQL label matchers used to be pasted into every rule (promtool rejects
the file), and a ``--test-job`` the selector does not match gave rule tests that fail. Both exit 2
now, one line on stderr, nothing written. Where promtool is installed it also checks the generated
rules before they are written, and the tests below run it on what was written."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from ampguard import cli, dashboards

PROMTOOL = shutil.which("promtool")


def _run(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["dashboards", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("selector, says", [
    ("job=llm", "is not a list of PromQL label matchers"),              # the input: not PromQL
    ('{job="llm"}', "(without the braces)"),
    ('job=="llm"', "is not a list of PromQL label matchers"),
    ('job="a" cluster="b"', "is not a list of PromQL label matchers"),  # no comma
    ('job=~"llm-("', "is not a valid regular expression"),
    ('job="llm\\d"', "unknown escape sequence"),                        # PromQL wants "llm\\\\d"
])
def test_a_selector_that_is_not_promql_exits_2_and_writes_nothing(capsys, tmp_path, selector, says):
    out = tmp_path / "d"
    code, err = _run(capsys, "--out", str(out), "--job-selector", selector)
    assert code == 2 and not out.exists()
    assert err.startswith("ampguard dashboards: error: job_selector") and says in err and len(err.splitlines()) == 1
    with pytest.raises(ValueError, match="job_selector"):
        dashboards.build_rules(job_selector=selector)  # the library refuses it too


def test_a_test_job_the_selector_does_not_match_exits_2_and_writes_nothing(capsys, tmp_path):
    out = tmp_path / "d"
    code, err = _run(capsys, "--out", str(out), "--job-selector", 'job=~"llm-.*"')  # default test job "train"
    assert code == 2 and not out.exists()
    assert "test_job='train' (--test-job) does not match job=~\"llm-.*\"" in err
    code, err = _run(capsys, "--out", str(out), "--job-selector", 'job=~"llm-.*"', "--test-job", "bert")
    assert code == 2 and not out.exists() and "test_job='bert'" in err
    code, err = _run(capsys, "--out", str(out), "--job-selector", 'cluster="a"')
    assert code == 2 and not out.exists() and 'cluster="a" does not match the rule tests\' series' in err


@pytest.mark.parametrize("selector, test_job, job", [
    ('job=~"llm-.*"', "llm-7b", "llm-7b"),
    ('job="llm", env!="dev",', None, "llm"),   # the job of a job="..." matcher is the default test job
    ("job=~`llm-(7|13)b`", "llm-13b", "llm-13b"),
    ("", None, "train"),
])
def test_valid_selectors_are_written_and_the_rule_tests_use_a_matching_job(capsys, tmp_path, selector, test_job, job):
    args = ["--out", str(tmp_path), "--job-selector", selector] + (["--test-job", test_job] if test_job else [])
    code, err = _run(capsys, *args)
    assert code == 0, err
    rules = yaml.safe_load((tmp_path / dashboards.RULES_FILE).read_text())
    tests = yaml.safe_load((tmp_path / dashboards.RULES_TEST_FILE).read_text())
    recorded = [r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    assert all(f"{{{selector}}}" in e for e in recorded if selector)
    series = [s["series"] for t in tests["tests"] for s in t["input_series"]]
    assert series and all(f'job="{job}"' in s for s in series)
    if PROMTOOL:  # the generated rules and their tests, checked by Prometheus's own tool
        for command in (["check", "rules", dashboards.RULES_FILE], ["test", "rules", dashboards.RULES_TEST_FILE]):
            check = subprocess.run([PROMTOOL, *command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert check.returncode == 0, check.stdout + check.stderr


def test_parse_selector_reads_promql_matchers():
    m = dashboards.parse_selector(" job =~ \"llm-.*\" , cluster!='b', rank=`0`,")
    assert [(x.name, x.op, x.value) for x in m] == [("job", "=~", "llm-.*"), ("cluster", "!=", "b"), ("rank", "=", "0")]
    assert m[0].matches("llm-7b") and not m[0].matches("xllm-7b")  # anchored, as Prometheus does
    assert m[1].matches("") and not m[1].matches("b")
    assert dashboards.parse_selector("") == () and dashboards.parse_selector(r'job=~"a\\d"')[0].value == r"a\d"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (scripts/install_prometheus.sh)")
def test_promtool_checks_what_the_parser_cannot_before_anything_is_written(capsys, tmp_path):
    # Python's re accepts a lookahead; Prometheus's RE2 does not: promtool is the judge where installed.
    out = tmp_path / "d"
    code, err = _run(capsys, "--out", str(out), "--job-selector", 'job=~"(?=llm)llm-.*"', "--test-job", "llm-7b")
    assert code == 2 and not out.exists() and len(err.splitlines()) == 1
    assert err.startswith("ampguard dashboards: error: promtool rejects the generated rules: ampguard.rules.yml ")
    assert "invalid or unsupported Perl syntax" in err and "more rules alike" in err
