"""End to end with real parts: a real Prometheus server on loopback scrapes a real 2-rank guarded
training (gloo, spawned processes) with injected NaN bursts; every dashboard query must return
data through Prometheus's HTTP API and the NaN-burst alert, evaluated by the server, must fire.
Also: promtool on a real scrape and on the generated rules, TensorBoard read back, and the event
log of a run killed with SIGKILL."""

from __future__ import annotations

import gc
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from ampguard import dashboards
from ampguard import metrics as M

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus/promtool not installed (make prometheus, or scripts/install_prometheus.sh)",
)

JOB = "ampguard-e2e"
WORLD = 2
STEPS = 140
BURST = range(60, 80)  # 20 non-finite steps on rank 1 (> the default threshold of 10)
STEP_SLEEP = 0.05  # ~7 s of training: several scrapes at 1 s
NUMERICS_EVERY = 5  # GuardConfig.numerics_every: the fp16 numerics panels' series


# ---------------------------------------------------------------------------------- helpers
def _free_ports(n: int) -> int:
    """A base port with n consecutive free ports."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free consecutive ports")


def _api(prom: str, path: str, **params: Any) -> Any:
    url = f"{prom}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def _wait(what: str, pred: Any, timeout: float, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except Exception as e:  # server not up yet, etc.
            last = e
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


# ---------------------------------------------------------------------------------- the ranks
def _rank_main(rank: int, world: int, base_port: int, init_port: int, workdir: str) -> None:
    """One training rank: DDP over gloo, guarded, exporting to Prometheus/TensorBoard/JSONL."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(init_port), LOCAL_RANK=str(rank),
                      RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampguard
    from ampguard import faults
    from ampguard.backends.torch_dist import TorchDistBackend
    from ampguard.exporters import JsonlExporter, PrometheusExporter, TensorBoardExporter

    dist.init_process_group("gloo", rank=rank, world_size=world)
    work = Path(workdir)
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
        prom = PrometheusExporter(port=base_port, addr="127.0.0.1")
        opt = ampguard.wrap(
            torch.optim.SGD(model.parameters(), lr=0.01),
            model=model,
            precision="fp16",  # the headroom is an fp16 series (issue 17)
            scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10),
            # min_scale below 2**10 * 0.5**len(BURST): the burst backs off without reaching the floor
            config={"param_norms_every": 10, "numerics_every": NUMERICS_EVERY, "indicators_every": NUMERICS_EVERY,
                    "min_scale": 2.0**-16},
            backend=TorchDistBackend(),
            exporters=[
                prom,
                TensorBoardExporter(work / "tb", histogram_every=10),
                JsonlExporter(str(work / "events" / "rank{rank}.jsonl")),
            ],
        )
        assert opt.run_info.local_rank == rank and prom.bound_port == base_port + rank
        g = torch.Generator().manual_seed(rank)
        with faults.inject(opt, model, faults.loss("nan", steps=BURST, ranks=[1], mode="mul")):
            for _ in range(STEPS):
                x = torch.randn(16, 8, generator=g)
                with opt.autocast():
                    loss = model(x).float().pow(2).mean()
                opt.backward(loss)
                opt.step()
                opt.zero_grad()
                time.sleep(STEP_SLEEP)
        (work / f"done{rank}").write_text(json.dumps({"skipped": opt.skipped_steps, "steps": opt.step_count}))
        # keep serving until the test has queried Prometheus
        deadline = time.monotonic() + 180
        while not (work / "stop").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        opt.close()
        dist.barrier()  # leave together, DDP freed first: else gloo may abort at exit
        del opt, model
        gc.collect()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------- fixtures
@pytest.fixture
def prometheus_server(tmp_path):
    """Start a real Prometheus; yields (url, config dir, start(targets) function). Always stopped."""
    procs: list[subprocess.Popen] = []
    state: dict[str, Any] = {}

    def start(targets: list[str], rules_text: str) -> str:
        port = _free_ports(1)
        cfg_dir = tmp_path / "prom"
        cfg_dir.mkdir()
        (cfg_dir / "rules.yml").write_text(rules_text)
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(cfg_dir / "rules.yml")],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": targets}]}],
        }
        (cfg_dir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        log = open(cfg_dir / "prometheus.log", "wb")  # noqa: SIM115 - closed below
        state["log"] = log
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg_dir / 'prometheus.yml'}", f"--storage.tsdb.path={cfg_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        _wait("prometheus ready", lambda: proc.poll() is None and
              urllib.request.urlopen(url + "/-/ready", timeout=2).status == 200, 30)
        state["url"] = url
        state["dir"] = cfg_dir
        return url

    try:
        yield start
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if "log" in state:
            state["log"].close()
            if os.environ.get("AMPGUARD_E2E_LOG"):
                print((state["dir"] / "prometheus.log").read_text())


def _substitute(expr: str, rate_interval: str) -> str:
    """What Grafana does to a panel query before sending it."""
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace('job=~"$job"', f'job=~"{JOB}"')
        .replace('rank=~"$rank"', 'rank=~".*"')
        .replace('group=~"$group"', 'group=~".*"')
    )


#: The recording rule AmpguardSkipRate reads (its name, from the generated rules).
_SKIP_RATE_BY_PRECISION = next(r["record"] for g in dashboards.build_rules()["groups"] for r in g["rules"]
                               if r.get("record", "").startswith("job_precision:"))


# ---------------------------------------------------------------------------------- the test
@needs_prometheus
def test_two_rank_training_scraped_by_real_prometheus(prometheus_server, tmp_path):
    import torch.multiprocessing as mp

    base_port = _free_ports(WORLD)
    init_port = _free_ports(1)
    while base_port <= init_port < base_port + WORLD:
        init_port = _free_ports(1)
    work = tmp_path / "work"
    work.mkdir()
    rules = dashboards.render_rules(fors={"AmpguardNonFiniteBurst": "2s"}, interval="1s")
    prom = prometheus_server([f"127.0.0.1:{base_port + r}" for r in range(WORLD)], rules)
    t_start = time.time()

    ctx = mp.start_processes(_rank_main, args=(WORLD, base_port, init_port, str(work)), nprocs=WORLD,
                             join=False, start_method="spawn")
    try:
        # 1. both ranks scraped healthy
        _wait("both targets up", lambda: len([t for t in _api(prom, "targets")["activeTargets"]
                                             if t["health"] == "up"]) == WORLD, 90)

        # 2. the NaN-burst alert, evaluated by the server, reaches firing
        def burst_firing() -> Any:
            alerts = _api(prom, "alerts")["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "AmpguardNonFiniteBurst"
                    and a["state"] == "firing"]

        firing = _wait("AmpguardNonFiniteBurst firing", burst_firing, 90)
        assert firing[0]["labels"]["job"] == JOB and firing[0]["labels"]["severity"] == "critical"
        assert float(firing[0]["value"]) > 10
        _wait("training done", lambda: all((work / f"done{r}").exists() for r in range(WORLD)), 60)
        time.sleep(2.5)  # a couple more scrapes of the final values
        done = [json.loads((work / f"done{r}").read_text()) for r in range(WORLD)]
        assert done[0] == done[1] == {"skipped": len(BURST), "steps": STEPS}

        # 3. what Prometheus stored is what the ranks did
        q = _api(prom, "query", query=f'ampguard_nonfinite_steps_total{{job="{JOB}",kind="loss"}}')
        assert sorted((s["metric"]["rank"], float(s["value"][1])) for s in q["result"]) == [
            ("0", len(BURST)), ("1", len(BURST))]
        q = _api(prom, "query", query=f'ampguard_nonfinite_origin_steps_total{{job="{JOB}"}}')
        assert sorted((s["metric"]["rank"], float(s["value"][1])) for s in q["result"]) == [
            ("0", 0.0), ("1", len(BURST))]  # the bad rank stands out
        # the leading indicators: a series per top-level module (the ReLU holds no parameter), per rank;
        # DDP's gradients and updates are the same on both ranks
        q = _api(prom, "query", query=f'ampguard_module_grad_norm{{job="{JOB}"}}')
        assert sorted((s["metric"]["rank"], s["metric"]["module"]) for s in q["result"]) == [
            ("0", "0"), ("0", "2"), ("1", "0"), ("1", "2")]
        assert all(0 < float(s["value"][1]) < math.inf for s in q["result"])
        q = _api(prom, "query", query=f'ampguard_module_update_ratio{{job="{JOB}"}}')
        values = {(s["metric"]["rank"], s["metric"]["module"]): float(s["value"][1]) for s in q["result"]}
        assert len(values) == 4 and values[("0", "0")] == values[("1", "0")] > 0
        q = _api(prom, "query", query=f'ampguard_run_info{{job="{JOB}"}}')
        assert {s["metric"]["world_size"] for s in q["result"]} == {"2"}
        assert len({s["metric"]["run_id"] for s in q["result"]}) == 1  # one run id on both ranks
        # the skip rate per precision: one series for the run, labelled with its precision
        q = _api(prom, "query", query=f'{_SKIP_RATE_BY_PRECISION}{{job="{JOB}"}}')
        assert [s["metric"]["precision"] for s in q["result"]] == ["fp16"]
        # the sampled fp16 numerics: a real headroom and zero fraction per rank and group ("all", "0")
        q = _api(prom, "query", query=f'ampguard_loss_scale_headroom_log2{{job="{JOB}"}}')
        assert sorted(s["metric"]["rank"] for s in q["result"]) == ["0", "1"]
        assert all(0 < float(s["value"][1]) < 40 for s in q["result"]), q["result"]
        q = _api(prom, "query", query=f'ampguard_grad_zero_fraction{{job="{JOB}"}}')
        assert sorted((s["metric"]["rank"], s["metric"]["group"]) for s in q["result"]) == [
            ("0", "0"), ("0", "all"), ("1", "0"), ("1", "all")]
        assert all(0 <= float(s["value"][1]) < 1 for s in q["result"]), q["result"]

        # 4. every query of every dashboard panel (and annotation) returns data
        rate_interval = "10s"
        now = time.time()
        dash = dashboards.build_dashboard()
        empty = []
        fp8 = [m.name for m in M.FP8]
        without_data = []
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                if any(name in target["expr"] for name in fp8):
                    without_data.append(panel["title"])  # no torchao Float8Linear in this run: no fp8 series
                    continue
                expr = _substitute(target["expr"], rate_interval)
                if target.get("instant"):
                    data = _api(prom, "query", query=expr)
                else:
                    data = _api(prom, "query_range", query=expr, start=t_start, end=now, step=1)
                if not data["result"]:
                    empty.append((panel["title"], expr))
        for ann in dash["annotations"]["list"]:
            if "expr" in ann:
                expr = _substitute(ann["expr"], rate_interval)
                if not _api(prom, "query_range", query=expr, start=t_start, end=now, step=1)["result"]:
                    empty.append((ann["name"], expr))
        assert not empty, f"queries without data: {empty}"
        assert len(without_data) == len(fp8)  # the fp8 row only (tests/unit/test_dashboards.py checks it)
        # template variables resolve too
        for var in dash["templating"]["list"]:
            if var["type"] == "query":
                m = re.fullmatch(r"label_values\((.*), (\w+)\)", _substitute(var["definition"], rate_interval))
                assert m, var["definition"]
                values = _api(prom, f"label/{m.group(2)}/values", **{"match[]": m.group(1)})
                assert values, var["name"]

        # 5. promtool check metrics on a real scrape of each rank
        for r in range(WORLD):
            with urllib.request.urlopen(f"http://127.0.0.1:{base_port + r}/metrics", timeout=5) as resp:
                scrape = resp.read()
            assert b"ampguard_steps_total" in scrape
            res = subprocess.run([PROMTOOL, "check", "metrics"], input=scrape, capture_output=True, timeout=30)
            assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), res
    finally:
        (work / "stop").write_text("")
        try:
            deadline = time.monotonic() + 60
            while not ctx.join(timeout=5) and time.monotonic() < deadline:  # returns when one rank ends
                pass
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
    assert [p.exitcode for p in ctx.processes] == [0] * WORLD

    # 6. TensorBoard (rank 0 only by default), read back
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(work / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    assert acc.Scalars("ampguard/nonfinite_steps")[-1].value == len(BURST)
    assert acc.Scalars("ampguard/skipped_steps")[-1].value == len(BURST)
    assert len(acc.Scalars("ampguard/loss")) == STEPS - len(BURST)  # NaN losses are not written
    hist_steps = [h.step for h in acc.Histograms("ampguard/param_grad_norms")]
    assert hist_steps and all(s % 10 == 0 for s in hist_steps)
    assert [p.name for p in (work / "tb").iterdir() if p.is_dir()] == []  # rank 1 wrote nothing
    headroom = acc.Scalars("ampguard/loss_scale_headroom_log2")
    assert headroom and all(e.step % NUMERICS_EVERY == 0 for e in headroom)
    assert {e.step for e in acc.Scalars("ampguard/grad_zero_fraction")} >= {e.step for e in headroom}

    # 7. the per-rank event logs
    for r in range(WORLD):
        recs = [json.loads(x) for x in (work / "events" / f"rank{r}.jsonl").read_text().splitlines()]
        assert recs[0]["event"] == "run" and recs[0]["rank"] == r and recs[-1]["event"] == "close"
        anomalies = [x for x in recs if x["event"] == "anomaly"]
        assert [a["step"] for a in anomalies] == list(BURST)
        assert all(a["rank"] == r and a["ranks"] == [1] and a["kind"] == "nonfinite_loss" for a in anomalies)
        sampled = [a["report"] for a in anomalies if a["step"] % NUMERICS_EVERY == 0]
        assert sampled and all(rep["grad_zero_fraction"] is not None for rep in sampled)


@needs_prometheus
def test_bf16_skips_recorded_by_precision_and_alerted_by_real_prometheus(prometheus_server):
    """A real bf16 run on CPU whose loss is, every 5th step, the log of a negative number (a genuine NaN,
    no fault injection): the server's recording rule shows its skip rate labelled precision="bf16",
    AmpguardSkipRate (threshold 0 for bf16) fires, and the scale-floor alert stays silent (no floor)."""
    import torch

    import ampguard
    from ampguard.exporters import PrometheusExporter

    port = _free_ports(1)
    rules = dashboards.render_rules(fors={"AmpguardSkipRate": "1s", "AmpguardLossScaleAtFloor": "0s"}, interval="1s")
    prom = prometheus_server([f"127.0.0.1:{port}"], rules)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.01), model=model, precision="bf16",
                        exporters=[PrometheusExporter(port=port, addr="127.0.0.1")])
    try:
        _wait("target up", lambda: [t for t in _api(prom, "targets")["activeTargets"] if t["health"] == "up"], 60)

        def firing() -> Any:
            # train on until the alert fires: steps of ~20 ms, every 5th one with a NaN loss
            for _ in range(25):
                with opt.autocast():
                    loss = model(torch.randn(16, 8)).float().pow(2).mean()
                if opt.step_count % 5 == 4:
                    loss = torch.log(-loss)  # the log of a negative number: NaN
                opt.backward(loss)
                opt.step()
                opt.zero_grad()
                time.sleep(0.02)
            return [a for a in _api(prom, "alerts")["alerts"]
                    if a["labels"]["alertname"] == "AmpguardSkipRate" and a["state"] == "firing"]

        alert = _wait("AmpguardSkipRate firing", firing, 120, every=0)[0]
        assert alert["labels"]["precision"] == "bf16" and alert["labels"]["job"] == JOB
        assert opt.skipped_steps == opt.step_count // 5 > 0
        q = _api(prom, "query", query=f'{_SKIP_RATE_BY_PRECISION}{{job="{JOB}"}}')["result"]
        assert [s["metric"] for s in q] == [{"__name__": _SKIP_RATE_BY_PRECISION, "job": JOB, "precision": "bf16"}]
        assert 0 < float(q[0]["value"][1]) <= 0.25  # one step in 5 skipped (the 5m rate lags a little)
        floor = _api(prom, "query", query=f'ampguard_loss_scale_floor{{job="{JOB}"}}')["result"]
        assert [s["value"][1] for s in floor] == ["NaN"]  # bf16: no loss scale floor
        assert not [a for a in _api(prom, "alerts")["alerts"] if a["labels"]["alertname"] == "AmpguardLossScaleAtFloor"]
    finally:
        opt.close()


_KILLED_RUN = textwrap.dedent(
    """
    import sys, time, torch, ampguard
    from ampguard import faults
    from ampguard.exporters import JsonlExporter
    model = torch.nn.Linear(4, 1)
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.01), model=model, precision="fp32",
                        exporters=[JsonlExporter(sys.argv[1], every_step=sys.argv[2] == "1")])
    faults.inject(opt, model, faults.loss("nan", steps=range(5, 100000, 7)))
    while True:
        opt.backward(model(torch.randn(8, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()
        print(opt.step_count, flush=True)
    """
)


@pytest.mark.parametrize("every_step", [False, True], ids=["anomalies", "every_step"])
def test_event_log_survives_sigkill(tmp_path, every_step):
    """With ``every_step`` the healthy lines are written by a background thread: the ones still queued
    at the kill may be missing, never an anomaly or skipped record, nor a line half written."""
    log = tmp_path / "events.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, str(log), str(int(every_step))],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        reached = 0
        assert proc.stdout is not None
        for line in proc.stdout:
            reached = int(line)
            if reached >= 400:
                break
        os.kill(proc.pid, signal.SIGKILL)  # mid-run: no close(), no atexit, no flush
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL and reached >= 400
    lines = log.read_text().splitlines()
    recs = [json.loads(x) for x in lines]  # every line whole and valid
    assert recs[0]["event"] == "run" and not any(r["event"] == "close" for r in recs)
    logged = [r["step"] for r in recs if r["event"] == "anomaly"]
    expected = [s for s in range(5, reached, 7)]  # every anomaly of every completed step
    assert logged[: len(expected)] == expected
    assert [r["step"] for r in recs if r["event"] == "skipped"][: len(expected)] == expected
    if every_step:  # every step up to the last anomaly written, in order; later ones as far as they got
        steps = [r["step"] for r in recs if r["event"] in ("step", "skipped")]
        assert steps == list(range(len(steps))) and len(steps) > expected[-1]


# ---------------------------------------------------------------------------------- promtool on the files
@needs_prometheus
def test_promtool_checks_and_tests_the_generated_rules(tmp_path):
    out = ROOT / "dashboards"
    res = subprocess.run([PROMTOOL, "check", "rules", str(out / dashboards.RULES_FILE)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    res = subprocess.run([PROMTOOL, "test", "rules", dashboards.RULES_TEST_FILE], cwd=out,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr
    # a different burst threshold, generated fresh, passes its own tests too
    dashboards.write_all(tmp_path, burst_threshold=3)
    res = subprocess.run([PROMTOOL, "test", "rules", dashboards.RULES_TEST_FILE], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "> 3" in (tmp_path / dashboards.RULES_FILE).read_text()
    # other skip-rate thresholds and grad-growth factor/window, generated fresh, pass their own tests too
    opts = tmp_path / "opts"
    dashboards.write_all(opts, skip_rate_thresholds={"fp16": 0.05, "bf16": 0.002}, grad_growth_factor=3,
                         grad_growth_window="1h")
    res = subprocess.run([PROMTOOL, "test", "rules", dashboards.RULES_TEST_FILE], cwd=opts,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # a job selector, with a test job it matches
    sel = tmp_path / "sel"
    dashboards.write_all(sel, job_selector='job=~"llm-.*"', test_job="llm-7b")
    res = subprocess.run([PROMTOOL, "test", "rules", dashboards.RULES_TEST_FILE], cwd=sel,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert '{job=~"llm-.*"}' in (sel / dashboards.RULES_FILE).read_text()
