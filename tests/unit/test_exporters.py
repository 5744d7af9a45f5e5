"""Exporters against real servers, files and readers: what a scrape returns, what the log holds."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import ampguard
from ampguard import faults
from ampguard import metrics as M
from ampguard.exporters import JsonlExporter, MultiExporter, PortInUseError, PrometheusExporter
from ampguard.exporters.jsonl import rank_path
from ampguard.exporters.memory import MemoryPeaks
from ampguard.records import SKIP_REASONS, Anomaly, RunInfo, StepReport

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _info(rank: int = 0, local_rank: int = 0, world: int = 1) -> RunInfo:
    return RunInfo(
        run_id="run-1",
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        precision="fp16",
        backend="local",
        device="cpu",
        param_names=("fc.weight", "fc.bias"),
        versions=(("ampguard", "0.1.0"), ("torch", torch.__version__), ("python", "3")),
        modules=("fc", "(root)"),
    )


def _report(step: int, **kw: Any) -> StepReport:
    base: dict[str, Any] = dict(
        step=step, skipped=False, reason=None, loss=1.0, loss_scale=1024.0, next_loss_scale=1024.0,
        grad_norm=0.5, nonfinite_grads=0, nonfinite_loss=False, wall_time=1000.0 + step,
    )
    base.update(kw)
    return StepReport(**base)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, accept: str | None = None) -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def prom():
    exp = PrometheusExporter(port=_free_port(), addr="127.0.0.1")
    yield exp
    exp.close()


# ---------------------------------------------------------------------------------- Prometheus
def test_every_label_combination_exists_at_zero_before_the_first_step(prom):
    prom.open(_info())
    status, ctype, text = _get(prom.url)
    assert status == 200 and ctype.startswith("text/plain")
    s = _samples(text)
    lab = {"rank": "0", "local_rank": "0"}
    assert _value(s, M.STEPS.name, **lab) == 0
    for reason in SKIP_REASONS:
        assert _value(s, M.SKIPPED_STEPS.name, reason=reason, **lab) == 0
    for kind in M.NONFINITE_KINDS:
        assert _value(s, M.NONFINITE_STEPS.name, kind=kind, **lab) == 0
    for metric in (M.SCALE_BACKOFFS, M.SCALE_GROWTHS, M.RANK_DIVERGENCE, M.NONFINITE_ORIGIN):
        assert _value(s, metric.name, **lab) == 0
    assert _value(s, M.LAST_STEP_TIMESTAMP.name, **lab) == 0
    assert _value(s, M.GRAD_NORM_HISTOGRAM.name + "_count", **lab) == 0
    info = [k for k in s if k[0] == M.RUN_INFO.name]
    assert len(info) == 1
    labels = dict(info[0][1])
    assert labels["run_id"] == "run-1" and labels["precision"] == "fp16" and labels["world_size"] == "1"
    assert labels["rank"] == "0" and labels["torch_version"] == torch.__version__
    # every family in the catalogue, and nothing else, is exposed
    names = {k[0] for k in s}
    for metric in M.CATALOGUE:
        if metric in M.FP8:  # series appear with the first fp8 cast (fp8 monitoring on; tests/unit/test_fp8_publish.py)
            continue
        assert metric.name in names or metric.name + "_count" in names, metric.name
    for name in names:
        assert M.by_name(name), name


def test_reports_update_the_series_and_nonfinite_values_stay_out_of_the_histogram(prom):
    prom.open(_info())
    prom.export(_report(0), [])
    prom.export(_report(1, skipped=True, reason="nonfinite_loss", loss=math.nan, nonfinite_loss=True,
                        grad_norm=math.nan, nonfinite_grads=3, next_loss_scale=512.0, scale_backoff=True),
                [Anomaly(1, "nonfinite_loss", "x")])
    prom.export(_report(2, skipped=True, reason="nonfinite_grad", grad_norm=math.inf, nonfinite_grads=1,
                        loss_scale=512.0, next_loss_scale=512.0), [Anomaly(2, "overflow", "x")])
    prom.export(_report(3, loss_scale=512.0, next_loss_scale=1024.0, scale_growth=True, grad_norm=2.0),
                [Anomaly(3, "rank_divergence", "x")])
    s = _samples(_get(prom.url)[2])
    lab = {"rank": "0", "local_rank": "0"}
    assert _value(s, M.STEPS.name, **lab) == 4
    assert _value(s, M.SKIPPED_STEPS.name, reason="nonfinite_loss", **lab) == 1
    assert _value(s, M.SKIPPED_STEPS.name, reason="nonfinite_grad", **lab) == 1
    assert _value(s, M.NONFINITE_STEPS.name, kind="loss", **lab) == 1  # each step counts once
    assert _value(s, M.NONFINITE_STEPS.name, kind="grad", **lab) == 1
    assert _value(s, M.NONFINITE_ORIGIN.name, **lab) == 2  # one process: this rank is the origin
    assert _value(s, M.SCALE_BACKOFFS.name, **lab) == 1
    assert _value(s, M.SCALE_GROWTHS.name, **lab) == 1
    assert _value(s, M.RANK_DIVERGENCE.name, **lab) == 1
    assert _value(s, M.ANOMALIES.name, kind="overflow", **lab) == 1
    assert _value(s, M.LOSS_SCALE.name, **lab) == 512.0  # the scale of the last step, not the next one's
    assert _value(s, M.GRAD_NORM.name, **lab) == 2.0
    assert _value(s, M.LAST_STEP_TIMESTAMP.name, **lab) == 1003.0
    assert _value(s, M.GRAD_NORM_HISTOGRAM.name + "_count", **lab) == 2  # NaN and inf not observed
    assert _value(s, M.GRAD_NORM_HISTOGRAM.name + "_sum", **lab) == 2.5


def test_label_children_are_bound_once_in_open_and_export_makes_no_labels_call(monkeypatch):
    """export() touches only children bound by open(): counted on the real prometheus_client families."""
    from prometheus_client.metrics import MetricWrapperBase

    calls: list[str] = []
    real_labels = MetricWrapperBase.labels

    def counting(self: Any, *values: Any, **kw: Any) -> Any:
        calls.append(self._name)
        return real_labels(self, *values, **kw)

    monkeypatch.setattr(MetricWrapperBase, "labels", counting)
    exp = PrometheusExporter(serve=False)
    exp.open(_info())
    assert calls, "open() binds the children"
    calls.clear()
    peaks = {"allocated_bytes": {"all": {"peak": 10}}, "reserved_bytes": {"all": {"peak": 20}}}
    exp._memory = MemoryPeaks("cuda:0", stats=lambda _: peaks)  # the exporter reads memory itself
    exp.export(_report(0), [])
    exp.export(_report(1, skipped=True, reason="nonfinite_loss", loss=math.nan, nonfinite_loss=True,
                       grad_norm=math.nan, nonfinite_grads=2, scale_backoff=True, next_loss_scale=512.0),
               [Anomaly(1, "nonfinite_loss", "x"), Anomaly(1, "rank_divergence", "x"),
                Anomaly(1, "nonfinite_grad", "x", cause="transient")])
    exp.export(_report(2, skipped=True, reason=None, scale_growth=True, loss_scale=512.0), [])
    assert calls == []
    lab = {"rank": "0", "local_rank": "0"}
    get = exp.registry.get_sample_value
    assert get(M.STEPS.name, lab) == 3
    assert get(M.SKIPPED_STEPS.name, {"reason": "nonfinite_loss", **lab}) == 1
    assert get(M.SKIPPED_STEPS.name, {"reason": "nonfinite_grad", **lab}) == 1  # unknown reason
    assert get(M.ANOMALIES.name, {"kind": "rank_divergence", **lab}) == 1
    assert get(M.RANK_DIVERGENCE.name, lab) == 1 and get(M.TRANSIENT_FAULTS.name, lab) == 1
    assert get(M.DEVICE_MEMORY_PEAK.name, {"kind": "reserved", **lab}) == 20


def test_run_info_carries_the_catalogue_labels():
    exp = PrometheusExporter(serve=False)
    exp.open(_info(rank=3, local_rank=1, world=4))
    info = [s for fam in exp.registry.collect() if fam.name == M.RUN_INFO.client_name for s in fam.samples]
    assert len(info) == 1 and info[0].value == 1
    assert tuple(info[0].labels) == (*M.RANK_LABELS, *M.RUN_INFO_LABELS)
    assert info[0].labels["world_size"] == "4" and info[0].labels["ampguard_version"] == "0.1.0"
    assert info[0].labels["python_version"] == "3" and info[0].labels["device"] == "cpu"


def test_loss_scale_gauge_is_the_scale_that_multiplied_the_step():
    exp = PrometheusExporter(serve=False)
    exp.open(_info())
    lab = {"rank": "0", "local_rank": "0"}
    assert math.isnan(exp.registry.get_sample_value(M.LOSS_SCALE.name, lab))  # before the first step
    exp.export(_report(0, loss_scale=1024.0, next_loss_scale=512.0, scale_backoff=True), [])
    assert exp.registry.get_sample_value(M.LOSS_SCALE.name, lab) == 1024.0
    exp.export(_report(1, loss_scale=512.0, next_loss_scale=1024.0, scale_growth=True), [])
    assert exp.registry.get_sample_value(M.LOSS_SCALE.name, lab) == 512.0
    assert "StepReport.loss_scale" in M.LOSS_SCALE.help


def test_loss_scale_floor_is_the_configured_min_scale_as_the_scaler_clamps_and_nan_without_scaling():
    import dataclasses

    lab = {"rank": "0", "local_rank": "0"}
    model = torch.nn.Linear(4, 1)
    fp16 = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="fp16",
                         config={"min_scale": 0.1})
    bf16 = ampguard.wrap(torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1), precision="bf16")
    try:
        assert fp16.run_info.loss_scale_floor == 0.10000000149011612  # float32(0.1): what the scale clamps to
        assert bf16.run_info.loss_scale_floor is None
    finally:
        fp16.close()
        bf16.close()
    for floor, expected in ((0.10000000149011612, 0.10000000149011612), (None, math.nan)):
        exp = PrometheusExporter(serve=False)
        exp.open(dataclasses.replace(_info(), loss_scale_floor=floor))
        exp.export(_report(0, loss_scale=1.0), [])
        got = exp.registry.get_sample_value(M.LOSS_SCALE_FLOOR.name, lab)
        assert got == expected or (math.isnan(expected) and math.isnan(got))


def test_backoff_and_growth_counters_follow_the_report_flags_not_the_scale_ordering():
    """The guard's decision (scale_backoff/scale_growth) is counted, even where the two scales
    would say otherwise."""
    exp = PrometheusExporter(serve=False)
    exp.open(_info())
    lab = {"rank": "0", "local_rank": "0"}

    def counts() -> tuple[float | None, float | None]:
        get = exp.registry.get_sample_value
        return get(M.SCALE_BACKOFFS.name, lab), get(M.SCALE_GROWTHS.name, lab)

    exp.export(_report(0, loss_scale=1024.0, next_loss_scale=512.0, scale_growth=True), [])
    assert counts() == (0, 1)
    exp.export(_report(1, loss_scale=512.0, next_loss_scale=1024.0, scale_backoff=True), [])
    assert counts() == (1, 1)
    exp.export(_report(2, loss_scale=1024.0, next_loss_scale=2048.0), [])  # no flag: nothing counted
    exp.export(_report(3, loss_scale=2048.0, next_loss_scale=1024.0), [])
    assert counts() == (1, 1)
    exp.export(_report(4, scale_backoff=True), [])  # equal scales, flag set
    assert counts() == (2, 1)


def test_module_indicators_are_a_series_per_top_level_module_nan_until_sampled(prom):
    prom.open(_info())
    lab = {"rank": "0", "local_rank": "0"}
    s = _samples(_get(prom.url)[2])
    for metric in M.PER_MODULE:
        assert {dict(k[1])["module"] for k in s if k[0] == metric.name} == {"fc", "(root)"}
        assert math.isnan(_value(s, metric.name, module="fc", **lab))
    prom.export(_report(0, module_grad_norms=(("fc", 0.25), ("(root)", math.inf)),
                        module_update_ratios=(("fc", 1e-3), ("(root)", 0.0))), [])
    prom.export(_report(1), [])  # not sampled: the gauges keep the last sampled values
    s = _samples(_get(prom.url)[2])
    assert _value(s, M.MODULE_GRAD_NORM.name, module="fc", **lab) == 0.25
    assert _value(s, M.MODULE_GRAD_NORM.name, module="(root)", **lab) == math.inf
    assert _value(s, M.MODULE_UPDATE_RATIO.name, module="fc", **lab) == 1e-3
    assert _value(s, M.MODULE_UPDATE_RATIO.name, module="(root)", **lab) == 0.0
    prom.export(_report(2, module_grad_norms=(("gone", 1.0),), module_update_ratios=()), [])  # unknown: ignored
    assert not [k for k in _samples(_get(prom.url)[2]) if dict(k[1]).get("module") == "gone"]


def test_skipped_counter_carries_the_step_as_exemplar_in_openmetrics(prom):
    prom.open(_info())
    prom.export(_report(7, skipped=True, reason="nonfinite_loss", nonfinite_loss=True, loss=math.nan), [])
    status, ctype, text = _get(prom.url, OPENMETRICS)
    assert status == 200 and ctype.startswith("application/openmetrics-text")
    line = next(ln for ln in text.splitlines() if ln.startswith(M.SKIPPED_STEPS.name + "{")
                and 'reason="nonfinite_loss"' in ln)
    assert '# {step="7"} 1.0' in line
    assert text.rstrip().endswith("# EOF")


def test_serves_at_port_plus_local_rank_and_close_frees_it():
    base = _free_port()
    while True:  # need base and base+3 free
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 3))
            break
        except OSError:
            base = _free_port()
    exp = PrometheusExporter(port=base, addr="127.0.0.1")
    exp.open(_info(rank=11, local_rank=3, world=16))
    try:
        assert exp.bound_port == base + 3
        s = _samples(_get(f"http://127.0.0.1:{base + 3}/metrics")[2])
        assert _value(s, M.STEPS.name, rank="11", local_rank="3") == 0
    finally:
        exp.close()
    again = PrometheusExporter(port=base, addr="127.0.0.1")  # the port is free again
    try:
        assert again.start(local_rank=3) == base + 3
    finally:
        again.close()


def test_port_in_use_raises_naming_the_port_and_wrap_warns_but_trains(tmp_path, caplog):
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    try:
        exp = PrometheusExporter(port=port, addr="127.0.0.1")
        with pytest.raises(PortInUseError, match=f"port {port} "):
            exp.start(local_rank=0)
        assert isinstance(PortInUseError("x"), OSError)
        with pytest.raises(PortInUseError, match=str(port)):
            PrometheusExporter(port=port, addr="127.0.0.1").open(_info())

        # Inside wrap(): contained like every exporter failure; the user sees one log line naming the port.
        model = torch.nn.Linear(3, 1)
        log = JsonlExporter(tmp_path / "events.jsonl")
        opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="fp32",
                            exporters=[PrometheusExporter(port=port, addr="127.0.0.1"), log])
        assert [r.levelname for r in caplog.records if "already in use" in r.getMessage()] == ["ERROR"]
        assert re.search(f"port {port} .*already in use", caplog.text)
        for _ in range(3):
            opt.backward(model(torch.randn(4, 3)).sum())
            opt.step()
            opt.zero_grad()
        assert opt.step_count == 3
        assert [type(e).__name__ for e in opt._exporter.failed] == ["PrometheusExporter"]
        opt.close()
    finally:
        blocker.close()


def test_start_before_wrap_fails_hard_and_open_reuses_the_server(prom):
    port = prom.start(local_rank=0)
    prom.open(_info())
    assert prom.bound_port == port
    assert _get(prom.url)[0] == 200


def test_endpoint_is_read_only(prom):
    prom.open(_info())
    base = prom.url.rsplit("/", 1)[0]
    assert _get(base + "/")[0] == 200
    assert _get(base + "/metrics?name[]=x")[0] == 200
    assert _get(base + "/admin")[0] == 404
    assert _get(base + "/favicon.ico")[0] == 404
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        req = urllib.request.Request(prom.url, data=b"x=1", method=method)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 405
    head = urllib.request.urlopen(urllib.request.Request(prom.url, method="HEAD"), timeout=5)
    assert head.status == 200 and head.read() == b""


def _raw(port: int, payload: bytes, *, read: bool = True, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        if payload:
            s.sendall(payload)
        if not read:
            return b""
        s.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        return b"".join(chunks)


def test_survives_malformed_and_abusive_requests(prom, capfd):
    prom.open(_info())
    port = prom.bound_port
    prom.export(_report(0), [])
    answers = {
        "garbage": _raw(port, b"\x00\xff\xfe GARBAGE \r\n\r\n"),
        "no_version": _raw(port, b"GET\r\n\r\n"),
        "bad_version": _raw(port, b"GET /metrics HTTP/9.9\r\n\r\n"),
        "huge_line": _raw(port, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"),
        "huge_header": _raw(port, b"GET /metrics HTTP/1.1\r\nX: " + b"b" * 70000 + b"\r\n\r\n"),
        "many_headers": _raw(port, b"GET /metrics HTTP/1.1\r\n" + b"X-A: 1\r\n" * 200 + b"\r\n"),
        "post_body": _raw(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 1000000\r\n\r\nabc"),
        "bad_length": _raw(port, b"GET /metrics HTTP/1.1\r\nContent-Length: -5\r\n\r\n"),
        "tls_hello": _raw(port, bytes.fromhex("16030100a5010000a10303") + b"\x00" * 64),
        "path_traversal": _raw(port, b"GET /../../etc/passwd HTTP/1.1\r\n\r\n"),
    }
    for name in ("garbage", "no_version", "bad_version", "huge_line", "many_headers", "tls_hello"):
        assert not answers[name].startswith(b"HTTP/1.0 200") and not answers[name].startswith(b"HTTP/1.1 200"), name
    assert b" 405 " in answers["post_body"].split(b"\r\n", 1)[0]
    assert b" 404 " in answers["path_traversal"].split(b"\r\n", 1)[0]
    # half-open connections and a flood of idle sockets do not block scrapes
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(50)]
    try:
        _raw(port, b"GET /metrics HTTP/1.1\r\nHost: x", read=False)  # never finished
        t0 = time.monotonic()
        status, _, text = _get(prom.url)
        assert status == 200 and time.monotonic() - t0 < 3
        assert _value(_samples(text), M.STEPS.name, rank="0", local_rank="0") == 1
    finally:
        for s in idle:
            s.close()
    assert "Traceback" not in capfd.readouterr().err  # nothing spilled onto the training's stderr


def test_private_registry_by_default_and_injected_registry_is_used():
    reg = CollectorRegistry()
    exp = PrometheusExporter(registry=reg, serve=False)
    exp.open(_info())
    exp.export(_report(0), [])
    assert reg.get_sample_value(M.STEPS.name, {"rank": "0", "local_rank": "0"}) == 1
    assert exp.url is None
    a, b = PrometheusExporter(serve=False), PrometheusExporter(serve=False)
    a.open(_info())
    b.open(_info())  # no duplicate-registration error: separate registries
    assert a.registry is not b.registry
    with pytest.raises(ValueError, match="port=70000"):
        PrometheusExporter(port=70000)


def test_scrapes_during_training_read_cached_values(prom):
    """A guarded run with a scraper hammering the endpoint: steps are unaffected, values are current."""
    import threading

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.01), model=model, precision="fp32",
                        exporters=[prom])
    stop = threading.Event()
    errors: list[BaseException] = []

    def scrape() -> None:
        while not stop.is_set():
            try:
                _get(prom.url)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

    threads = [threading.Thread(target=scrape) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        with faults.inject(opt, model, faults.loss("nan", steps=[5, 6, 7])):
            for _ in range(30):
                opt.backward(model(torch.randn(16, 8)).pow(2).mean())
                opt.step()
                opt.zero_grad()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    s = _samples(_get(prom.url)[2])
    lab = {"rank": "0", "local_rank": "0"}
    assert _value(s, M.STEPS.name, **lab) == 30
    assert _value(s, M.SKIPPED_STEPS.name, reason="nonfinite_loss", **lab) == 3
    assert _value(s, M.NONFINITE_STEPS.name, kind="loss", **lab) == 3
    assert _value(s, M.LOSS.name, **lab) == opt.last_report.loss
    opt.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{prom.port}/metrics", timeout=2)


# ---------------------------------------------------------------------------------- JSONL
def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_logs_run_anomalies_and_skipped_steps(tmp_path):
    model = torch.nn.Linear(4, 2)
    log = JsonlExporter(tmp_path / "events.jsonl", every_step=False)
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="fp32",
                        exporters=[log])
    with faults.inject(opt, model, faults.loss("nan", steps=[2]), faults.grad("weight", "inf", steps=[4])):
        for _ in range(6):
            opt.backward(model(torch.randn(3, 4)).sum())
            opt.step()
            opt.zero_grad()
    opt.close()
    recs = _records(tmp_path / "events.jsonl")
    assert recs[0]["event"] == "run" and recs[0]["run_id"] == opt.run_info.run_id
    assert recs[0]["param_names"] == ["weight", "bias"] and recs[0]["versions"]["torch"] == torch.__version__
    assert recs[-1] == {**recs[-1], "event": "close", "steps": 6}
    anomalies = [r for r in recs if r["event"] == "anomaly"]
    skipped = [r for r in recs if r["event"] == "skipped"]
    assert [(a["step"], a["kind"], a["rank"], a["reason"]) for a in anomalies] == [
        (2, "nonfinite_loss", 0, "nonfinite_loss"), (4, "nonfinite_grad", 0, "nonfinite_grad")]
    assert anomalies[0]["report"]["loss"] == "nan"  # strict JSON: non-finite floats as strings
    assert anomalies[1]["params"] == ["weight"]
    assert [(s["step"], s["skipped"], s["reason"]) for s in skipped] == [
        (2, True, "nonfinite_loss"), (4, True, "nonfinite_grad")]
    assert skipped[1]["grad_norm"] == "inf" and skipped[1]["nonfinite_grads"] == 1
    assert not [r for r in recs if r["event"] == "step"]


def test_jsonl_every_step_and_append_only(tmp_path):
    path = tmp_path / "log.jsonl"
    for run in range(2):
        log = JsonlExporter(path, every_step=True, fsync_every=2)
        log.open(_info())
        for s in range(3):
            log.export(_report(s, loss=float(run)), [])
        log.close()
    recs = _records(path)
    assert [r["event"] for r in recs] == ["run", "step", "step", "step", "close"] * 2
    assert [r["loss"] for r in recs if r["event"] == "step"] == [0.0] * 3 + [1.0] * 3


def test_jsonl_healthy_steps_are_written_off_the_step_in_order_with_anomalies_in_place(tmp_path):
    path = tmp_path / "log.jsonl"
    log = JsonlExporter(path, every_step=True, fsync_every=7)
    log.open(_info())
    bad = {40, 41, 97}
    for s in range(150):
        if s in bad:
            log.export(_report(s, skipped=True, reason="nonfinite_loss", nonfinite_loss=True, loss=math.nan),
                       [Anomaly(s, "nonfinite_loss", "loss was nan; step skipped")])
        else:
            log.export(_report(s, loss=float(s)), [])
    assert log._writer is not None  # healthy lines go through the writer thread
    log.close()
    recs = _records(path)
    assert recs[0]["event"] == "run" and recs[-1] == {**recs[-1], "event": "close", "steps": 150}
    expected: list[tuple[str, int]] = []
    for s in range(150):
        expected += [("anomaly", s), ("skipped", s)] if s in bad else [("step", s)]
    assert [(r["event"], r["step"]) for r in recs[1:-1]] == expected
    assert log._writer is None and not log._backlog  # the thread is gone, nothing left behind


def test_jsonl_flush_writes_every_queued_step(tmp_path):
    path = tmp_path / "log.jsonl"
    log = JsonlExporter(path, every_step=True)
    log.open(_info())
    for s in range(50):
        log.export(_report(s), [])
    log.flush()
    assert [r["step"] for r in _records(path) if r["event"] == "step"] == list(range(50))
    log.close()


def test_jsonl_anomaly_records_are_on_disk_when_step_returns(tmp_path, monkeypatch):
    """The anomaly and skipped records of a step are written and fsynced before ``step()`` returns,
    after every healthy line queued before them (the writer is drained first)."""
    path = tmp_path / "events.jsonl"
    synced: list[str] = []  # the file as it was at each fsync
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        real_fsync(fd)
        synced.append(path.read_text())

    monkeypatch.setattr(os, "fsync", spy)
    model = torch.nn.Linear(4, 2)
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="fp32",
                        exporters=[JsonlExporter(path, every_step=True)])
    nan_at = [7, 19]
    with faults.inject(opt, model, faults.loss("nan", steps=nan_at)):
        for s in range(25):
            opt.backward(model(torch.randn(3, 4)).sum())
            opt.step()
            opt.zero_grad()
            if s in nan_at:
                on_disk = [json.loads(x) for x in synced[-1].splitlines()]  # the last fsync's view
                assert [(r["event"], r.get("step")) for r in on_disk[-2:]] == [("anomaly", s), ("skipped", s)]
                assert [r["step"] for r in on_disk if r["event"] in ("step", "skipped")] == list(range(s + 1))
    opt.close()
    assert [r["step"] for r in _records(path) if r["event"] in ("step", "skipped")] == list(range(25))


def test_guard_flush_leaves_every_step_line_in_the_log(tmp_path):
    """``opt.flush()`` drains the JSONL exporter's background writer: the log on disk holds every
    step so far, before ``close()``."""
    path = tmp_path / "log.jsonl"
    model = torch.nn.Linear(4, 2)
    log = JsonlExporter(path, every_step=True, fsync_every=1000)
    real_raw = log._raw

    def slow_raw(data: bytes) -> None:  # a slow disk: the writer thread lags the steps
        time.sleep(0.01)
        real_raw(data)

    log._raw = slow_raw  # type: ignore[method-assign]
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="fp32",
                        exporters=[log])
    for _ in range(40):
        opt.backward(model(torch.randn(3, 4)).sum())
        opt.step()
        opt.zero_grad()
    opt.flush()
    assert [r["step"] for r in _records(path) if r["event"] == "step"] == list(range(40))
    opt.close()


def test_jsonl_a_failed_background_write_is_raised_once_and_the_steps_are_written_later(tmp_path, monkeypatch,
                                                                                      caplog):
    path = tmp_path / "log.jsonl"
    log = JsonlExporter(path, every_step=True)
    multi = MultiExporter([log])
    multi.RETRY_FIRST_S = multi.RETRY_MAX_S = 0.0  # retry on every call
    multi.open(_info())
    real_raw = log._raw
    failing = {"on": False}

    def raw(data: bytes) -> None:
        if failing["on"]:
            log._check_torn = True
            raise OSError(28, "No space left on device")
        real_raw(data)

    monkeypatch.setattr(log, "_raw", raw)
    for s in range(5):
        multi.export(_report(s), [])
    log.flush()
    failing["on"] = True
    for s in range(5, 12):
        multi.export(_report(s), [])
        log._drain()  # let the writer fail now, so the next call sees it
    assert [r.levelname for r in caplog.records if "JsonlExporter.export() failed" in r.getMessage()] == ["ERROR"]
    assert not multi.health["JsonlExporter"].up
    failing["on"] = False
    for s in range(12, 15):
        multi.export(_report(s), [])
    multi.close()
    assert multi.health["JsonlExporter"].up
    recs = _records(path)
    assert [r["step"] for r in recs if r["event"] == "step"] == list(range(15))  # each once, in order
    assert recs[-1] == {**recs[-1], "event": "close", "steps": 15}


def test_jsonl_per_rank_paths(tmp_path):
    assert rank_path(tmp_path / "ev-{rank}.jsonl", 3) == tmp_path / "ev-3.jsonl"
    assert rank_path(tmp_path, 2) == tmp_path / "events-rank2.jsonl"
    assert rank_path(str(tmp_path / "new") + "/", 1) == tmp_path / "new" / "events-rank1.jsonl"
    assert rank_path(tmp_path / "e.jsonl", 0) == tmp_path / "e.jsonl"
    assert rank_path(tmp_path / "e.jsonl", 5) == tmp_path / "e.rank5.jsonl"
    for r in range(2):
        log = JsonlExporter(tmp_path / "logs")
        (tmp_path / "logs").mkdir(exist_ok=True)
        log.open(_info(rank=r, local_rank=r, world=2))
        log.export(_report(0, skipped=True, reason="nonfinite_loss", rank=r), [])
        log.close()
    for r in range(2):
        recs = _records(tmp_path / "logs" / f"events-rank{r}.jsonl")
        assert recs[0]["rank"] == r and recs[1]["rank"] == r


def test_jsonl_disk_failure_is_reported_once_and_training_goes_on(tmp_path, caplog):
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    model = torch.nn.Linear(2, 1)
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="fp32",
                        exporters=[JsonlExporter("/dev/full")])
    for _ in range(3):
        opt.backward(model(torch.randn(2, 2)).sum())
        opt.step()
        opt.zero_grad()
    opt.close()
    assert opt.step_count == 3
    failed = [r for r in caplog.records if r.levelno >= logging.WARNING and "JsonlExporter" in r.getMessage()]
    assert [r.getMessage().split(":")[1] for r in failed] == [" exporter JsonlExporter.open() failed"]  # once


# ---------------------------------------------------------------------------------- TensorBoard
def _accumulator(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_and_finite_histograms(tmp_path):
    from ampguard.exporters import TensorBoardExporter

    tb = TensorBoardExporter(tmp_path / "tb", histogram_every=2)
    multi = MultiExporter([tb])
    multi.open(_info())
    multi.export(_report(0, param_norms=(1.0, 2.0)), [])
    multi.export(_report(1, skipped=True, reason="nonfinite_grad", grad_norm=math.nan, nonfinite_grads=1,
                         param_norms=(math.nan, 3.0)), [])
    multi.export(_report(2, skipped=True, reason="nonfinite_grad", grad_norm=math.inf, nonfinite_grads=1,
                         param_norms=(math.inf, 4.0)), [])
    multi.export(_report(3, loss=0.5), [])
    multi.close()
    assert not multi.failed
    acc = _accumulator(tmp_path / "tb")
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
    assert scalars["ampguard/loss"] == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 0.5)]
    assert [s for s, _ in scalars["ampguard/grad_norm"]] == [0, 3]  # NaN/inf not written
    assert scalars["ampguard/skipped"] == [(0, 0.0), (1, 1.0), (2, 1.0), (3, 0.0)]
    assert scalars["ampguard/skipped_steps"][-1] == (3, 2.0)
    assert scalars["ampguard/nonfinite_steps"][-1] == (3, 2.0)
    assert scalars["ampguard/loss_scale"][0] == (0, 1024.0)
    hist = acc.Histograms("ampguard/param_grad_norms")
    assert [h.step for h in hist] == [0, 2]  # every 2 steps, when norms are present
    assert hist[0].histogram_value.num == 2 and hist[1].histogram_value.num == 1  # inf left out
    assert hist[1].histogram_value.max == 4.0
    assert [h.step for h in acc.Histograms("ampguard/grad_norm/fc.bias")] == [0, 2]
    assert [h.step for h in acc.Histograms("ampguard/grad_norm/fc.weight")] == [0]


def test_tensorboard_module_indicators_per_module_tag(tmp_path):
    from ampguard.exporters import TensorBoardExporter

    tb = TensorBoardExporter(tmp_path / "tb")
    tb.open(_info())
    tb.export(_report(0, module_grad_norms=(("fc", 0.5), ("(root)", math.nan)),
                      module_update_ratios=(("fc", 0.01), ("(root)", 0.0))), [])
    tb.export(_report(1), [])
    tb.export(_report(2, module_grad_norms=(("fc", 0.75), ("(root)", 2.0)),
                      module_update_ratios=(("fc", 0.02), ("(root)", 0.5))), [])
    tb.close()
    acc = _accumulator(tmp_path / "tb")
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert scalars["ampguard/module_grad_norm/fc"] == [(0, 0.5), (2, 0.75)]
    assert scalars["ampguard/module_grad_norm/(root)"] == [(2, 2.0)]  # NaN not written
    assert scalars["ampguard/module_update_ratio/fc"] == [(0, pytest.approx(0.01)), (2, pytest.approx(0.02))]
    assert scalars["ampguard/module_update_ratio/(root)"] == [(0, 0.0), (2, 0.5)]


def test_tensorboard_loss_scale_is_the_scale_that_multiplied_the_step(tmp_path):
    from ampguard.exporters import TensorBoardExporter

    tb = TensorBoardExporter(tmp_path / "tb", histogram_every=None)
    tb.open(_info())
    tb.export(_report(0, loss_scale=1024.0, next_loss_scale=512.0, scale_backoff=True), [])
    tb.export(_report(1, loss_scale=512.0, next_loss_scale=1024.0, scale_growth=True), [])
    tb.close()
    scale = [(e.step, e.value) for e in _accumulator(tmp_path / "tb").Scalars("ampguard/loss_scale")]
    assert scale == [(0, 1024.0), (1, 512.0)]


def test_tensorboard_rank0_only_by_default_all_ranks_in_subdirs(tmp_path):
    from ampguard.exporters import TensorBoardExporter

    for r in range(2):
        for all_ranks, d in ((False, "one"), (True, "all")):
            tb = TensorBoardExporter(tmp_path / d, all_ranks=all_ranks)
            tb.open(_info(rank=r, local_rank=r, world=2))
            tb.export(_report(0, rank=r), [])
            tb.close()
    assert [p.name.startswith("events.out.tfevents") for p in (tmp_path / "one").iterdir()] == [True]
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["rank0", "rank1"]
    assert _accumulator(tmp_path / "all" / "rank1").Scalars("ampguard/loss")[0].value == 1.0


def test_missing_tensorboard_names_the_extra(monkeypatch):
    from ampguard.exporters import TensorBoardExporter

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ampguard.BackendUnavailableError, match=r"ampguard\[tensorboard\]"):
        TensorBoardExporter("runs/x")


def test_import_ampguard_imports_no_tensorboard_and_exporters_load_lazily():
    code = (
        "import sys, ampguard, ampguard.exporters as e\n"
        "assert 'tensorboard' not in sys.modules and 'torch.utils.tensorboard' not in sys.modules\n"
        "assert 'ampguard.exporters.prometheus' not in sys.modules\n"
        "from ampguard.exporters import PrometheusExporter, JsonlExporter, TensorBoardExporter\n"
        "assert 'tensorboard' not in sys.modules\n"
        "assert sorted(e.__all__) == sorted(['Exporter','MultiExporter','NullExporter','PrometheusExporter',"
        "'JsonlExporter','TensorBoardExporter','PortInUseError','ConsoleExporter','WandbExporter','MlflowExporter',"
        "'OtelExporter'])\n"
        "assert not {'wandb', 'mlflow', 'opentelemetry'} & {m.split('.')[0] for m in sys.modules}\n"
        "import threading; assert threading.active_count() == 1\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
