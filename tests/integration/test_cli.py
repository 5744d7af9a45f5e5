"""The ``ampguard`` command, run for real in subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "ampguard.cli"]


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        try:
            with socket.socket() as b, socket.socket() as c:
                b.bind(("127.0.0.1", port))
                c.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def test_help_and_usage_errors():
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for command in ("demo", "report", "dashboards", "preflight"):
        assert command in out.stdout
        sub = subprocess.run([*CLI, command, "--help"], capture_output=True, text=True, timeout=120)
        assert sub.returncode == 0 and "usage: ampguard " + command in sub.stdout
    assert subprocess.run(CLI, capture_output=True, text=True, timeout=120).returncode == 2
    bad = subprocess.run([*CLI, "frobnicate"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr
    bad = subprocess.run([*CLI, "demo", "--steps", "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--steps must be >= 20" in bad.stderr and "Traceback" not in bad.stderr


def test_dashboards_command_writes_valid_rules(tmp_path):
    out = subprocess.run([*CLI, "dashboards", "--out", str(tmp_path), "--burst-threshold", "3",
                          "--job-selector", 'job=~"llm-.*"', "--test-job", "llm-7b",
                          "--skip-rate-threshold", "bf16=0.002", "--skip-rate-threshold", "fp16=0.05",
                          "--grad-growth-factor", "4", "--grad-growth-window", "1h"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["ampguard.json", "ampguard.rules.test.yml", "ampguard.rules.yml"]
    rules = (tmp_path / "ampguard.rules.yml").read_text()
    assert '> 3' in rules and 'job=~"llm-.*"' in rules
    exprs = {r["alert"]: r["expr"] for g in yaml.safe_load(rules)["groups"] for r in g["rules"] if "alert" in r}
    skip_rate = exprs["AmpguardSkipRate"]
    assert 'precision="bf16"} > 0.002' in skip_rate and 'precision="fp16"} > 0.05' in skip_rate
    assert 'precision="fp32"} > 0.0' in skip_rate  # the default kept
    assert exprs["AmpguardModuleGradNormGrowth"].endswith("[1h] offset 1h) > 0) > 4.0")
    json.loads((tmp_path / "ampguard.json").read_text())
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "test", "rules", "ampguard.rules.test.yml"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, check.stdout + check.stderr


def test_dashboards_command_refuses_a_burst_threshold_below_one(tmp_path):
    # The same bound as dashboards.build_rules: the alert fires above the threshold, so >= 1.
    out = subprocess.run([*CLI, "dashboards", "--out", str(tmp_path / "d"), "--burst-threshold", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == "ampguard dashboards: error: --burst-threshold must be >= 1"
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("option, value, message", [
    ("--skip-rate-threshold", "bf16=2", "skip_rate_thresholds['bf16']=2.0; allowed: a fraction in [0, 1)"),
    ("--skip-rate-threshold", "tf32=0.1", "skip_rate_thresholds names unknown precisions ['tf32']"),
    ("--grad-growth-factor", "1", "grad_growth_factor=1.0; allowed: a number > 1"),
    ("--grad-growth-window", "5m", "grad_growth_window='5m'; allowed: a Prometheus duration"),
])
def test_dashboards_command_refuses_bad_rule_options(tmp_path, option, value, message):
    out = subprocess.run([*CLI, "dashboards", "--out", str(tmp_path / "d"), option, value],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].startswith(f"ampguard dashboards: error: {message}"), out.stderr
    assert not (tmp_path / "d").exists()


def test_version_and_report_through_the_command(tmp_path):
    from ampguard import __version__

    version = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout == f"ampguard {__version__}\n"
    log = tmp_path / "events-rank0.jsonl"
    log.write_text('{"event": "run", "run_id": "r1", "rank": 0, "world_size": 1, "precision": "fp16"}\n'
                   '{"event": "skipped", "step": 0, "skipped": true, "reason": "nonfinite_loss", "loss": "nan"}\n')
    out = subprocess.run([*CLI, "report", str(tmp_path), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert (s["steps"], s["skipped_by_reason"], s["closed"]) == (1, {"nonfinite_loss": 1}, False)
    assert s["ranks"]["0"]["loss_last"] == "nan"
    bad = subprocess.run([*CLI, "report", str(tmp_path), "--bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("usage: ampguard report ")
    assert bad.stderr.splitlines()[-1] == "ampguard report: error: unrecognized arguments: --bogus"


def test_demo_end_to_end(tmp_path):
    port = _free_port_pair()
    proc = subprocess.Popen([*CLI, "demo", "--steps", "40", "--out", str(tmp_path), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    scraped = ""
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/metrics", timeout=2) as r:
                    body = r.read().decode()
                if 'ampguard_steps_total{local_rank="1",rank="1"}' in body and "} 0.0" not in body.split(
                        'ampguard_steps_total{local_rank="1",rank="1"}')[1][:8]:
                    scraped = body
                    break
            except OSError:
                pass
            time.sleep(0.3)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert scraped, "rank 1's Prometheus endpoint never served a step while the demo ran"
    assert "ampguard_loss_scale" in scraped

    (run_dir,) = [p for p in Path(tmp_path).iterdir() if p.is_dir()]
    picture = run_dir / "report.png"
    assert picture.exists() and picture.stat().st_size > 50_000
    summary = json.loads((run_dir / "summary.json").read_text())
    # The summary's numbers against the event logs themselves.
    skipped_steps = set()
    anomaly_kinds = set()
    for log in sorted(run_dir.glob("events-rank*.jsonl")):
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "skipped":
                skipped_steps.add(rec["step"])
            if rec["event"] == "anomaly":
                anomaly_kinds.add(rec["kind"])
    assert summary["skipped"] == len(skipped_steps) >= 5  # 3-step overflow burst, one-rank NaN, transient
    assert {"overflow", "nonfinite_grad", "loss_spike", "nonfinite_loss"} <= anomaly_kinds
    assert (run_dir / "tensorboard").is_dir()
    assert "report picture:" in output and "Prometheus, rank 1" in output
    located = [a for a in summary["anomalies"] if a.get("module")]
    assert any(a["cause"] == "transient" for a in located), summary["anomalies"]


def _stalled_log(tmp_path: Path) -> Path:
    log = tmp_path / "events-rank0.jsonl"
    log.write_text('{"event": "run", "run_id": "r1", "rank": 0, "world_size": 1, "precision": "fp16"}\n'
                   '{"event": "step", "step": 0, "loss": 2.5, "loss_scale": 1024}\n'
                   '{"event": "skipped", "step": 1, "skipped": true, "reason": "nonfinite_loss", "loss": "nan"}\n')
    return log


def test_report_follow_stops_cleanly_on_ctrl_c_and_on_its_timeout(tmp_path):
    import signal

    _stalled_log(tmp_path)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a hang below dumps the child's stacks (SIGABRT)
    proc = subprocess.Popen([*CLI, "report", str(tmp_path), "--follow", "--interval", "0.1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = proc.stdout.readline()  # off a terminal: a status line per change
        assert first == "r1: step 2, skipped 1, anomalies 0 (running)\n"
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # once, before stop 50's flag-based Ctrl-C: say where it waits
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"report --follow outlived its SIGINT by 60 s; its stacks:\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "ampguard run r1  (no close record: still running, or killed)" in out  # the summary, at the end
    timed = subprocess.run([*CLI, "report", str(tmp_path), "--follow", "--interval", "0.05", "--follow-timeout", "0.5"],
                           capture_output=True, text=True, timeout=120)
    assert timed.returncode == 1 and "no new record for 0.5s" in timed.stderr and "Traceback" not in timed.stderr
    with (tmp_path / "events-rank0.jsonl").open("a") as f:
        f.write('{"event": "close", "rank": 0, "steps": 2}\n')
    ended = subprocess.run([*CLI, "report", str(tmp_path), "--follow"], capture_output=True, text=True, timeout=120)
    assert ended.returncode == 0 and "ampguard run r1  (finished)" in ended.stdout


@pytest.mark.parametrize("args, message", [
    (["--follow", "--plot", "x.png"], "ampguard report: error: --follow draws the summary live"),
    (["--follow", "--interval", "0"], "ampguard report: error: argument --interval: '0': expected a number of "
                                      "seconds > 0"),
])
def test_report_follow_refuses_bad_options(tmp_path, args, message):
    _stalled_log(tmp_path)
    out = subprocess.run([*CLI, "report", str(tmp_path), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.splitlines()[-1].startswith(message) and "Traceback" not in out.stderr
    assert not (tmp_path / "x.png").exists()


def test_preflight_says_early_when_its_trials_will_be_slow(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\n"
                      "def make_preflight():\n"
                      "    return {'model_fn': lambda: torch.nn.Linear(4, 2),\n"
                      "            'batch_fn': lambda i: (torch.randn(8, 4), torch.randn(8, 2)),\n"
                      "            'optimizer_fn': lambda p: torch.optim.SGD(p, lr=0.01)}\n")
    out = subprocess.run([*CLI, "preflight", "--script", f"{script}:make_preflight", "--steps", "5",
                          "--precision", "bf16", "--warn-after", "1e-9"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == "ampguard preflight: bf16 trial (0/5 trial steps done)"
    assert lines[1].startswith("ampguard preflight: warning: a bf16 trial step ")
    assert " on cpu" in lines[1] and ": 5 steps x 1 candidate(s) will take " in lines[1]
    assert "preflight recommendation: precision=bf16" in out.stdout


def test_demo_leaves_the_callers_environment_as_it_was(tmp_path, monkeypatch, capsys):
    # The run id reaches the ranks through their own (spawned) environments, not the caller's.
    from ampguard import demo

    monkeypatch.delenv("AMPGUARD_RUN_ID", raising=False)
    before = dict(os.environ)
    assert demo.main(["--steps", "20", "--ranks", "1", "--no-faults", "--port", "0", "--plain",
                      "--out", str(tmp_path)]) == 0
    assert dict(os.environ) == before
    (run_dir,) = tmp_path.iterdir()
    first = json.loads((run_dir / "events-rank0.jsonl").read_text().splitlines()[0])
    assert run_dir.name in json.dumps(first), first  # the ranks still logged the run's id


def test_report_of_a_run_stopped_by_a_lasting_forward_overflow_says_what_to_do_about_that_module(tmp_path, hf_bench):
    # a real GPT-2 whose attention overflows fp16 on every forward after step 2 (its q/k grown), logged to a JSONL
    # event log until max_consecutive_skips stops it; `ampguard report` on the log ends unhealthy (exit 3) and, since
    # stop 68, says what to do about the attention forensics localised, as the run's own stop said
    import torch

    import ampguard
    from ampguard.exporters import JsonlExporter
    from tests.unit._models import hf_steps

    torch.manual_seed(0)
    model, attention = hf_bench.FAMILIES["gpt2"](False)
    model.train()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-4), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu"), exporters=[JsonlExporter(tmp_path / "events.jsonl")],
                        config=ampguard.GuardConfig(max_consecutive_skips=6))
    with pytest.raises(ampguard.NonFiniteError):
        hf_steps(opt, model, 20, lambda step: hf_bench.grow_qk(model, attention) if step == 2 else None)
    opt.close()
    out = subprocess.run([*CLI, "report", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("ampguard report: what to do: ")]
    assert f"module {attention}'s forward overflows" in line and "outside autocast" in line, line
