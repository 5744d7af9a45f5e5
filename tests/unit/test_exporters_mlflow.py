"""MlflowExporter against a real MLflow file store, read back with MLflow's own client."""

from __future__ import annotations

import logging
import socket
import sys
import time

import mlflow
import pytest
from mlflow.tracking import MlflowClient

import ampguard
from ampguard.errors import BackendUnavailableError
from ampguard.exporters import MlflowExporter

from ._tracked_run import expected, same, train


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    return (tmp_path / "mlruns").as_uri()


def test_mlflow_shows_the_steps_and_values_of_the_jsonl_log_of_the_same_run(tmp_path, store):
    exporter = MlflowExporter(store, experiment="ampguard-test")
    opt, records = train(tmp_path, exporter)
    client = MlflowClient(store)
    run = client.get_run(exporter.active_run_id)
    assert run.info.status == "FINISHED"  # the run the exporter made is ended by close()
    assert run.data.params["ampguard.run_id"] == opt.run_info.run_id
    assert run.data.params["ampguard.precision"] == "fp16"
    assert run.data.tags["ampguard.rank"] == "0"
    for key, want in expected(records).items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert all(same(a, b) for (_, a), (_, b) in zip(got, want)), (key, got, want)
    anomalies = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "ampguard/anomalies")}
    assert {s for s, n in anomalies.items() if n} == {a.step for a in opt.anomalies}
    walls = {m.step: m.timestamp for m in client.get_metric_history(run.info.run_id, "ampguard/loss")}
    assert all(walls[r["step"]] == int(1000 * r["wall_time"]) for r in records)


def test_mlflow_logs_into_the_callers_active_run_and_leaves_it_running(tmp_path, store):
    mlflow.set_tracking_uri(store)
    try:
        with mlflow.start_run() as active:
            mlflow.log_metric("my_loss", 1.5, step=100)  # the caller's own numbers, on its own steps
            exporter = MlflowExporter()
            _, records = train(tmp_path, exporter)
            assert exporter.active_run_id == active.info.run_id
            assert MlflowClient(store).get_run(active.info.run_id).info.status == "RUNNING"
        history = MlflowClient(store).get_metric_history(active.info.run_id, "ampguard/loss")
        assert sorted(m.step for m in history) == [r["step"] for r in records]
        assert [m.value for m in MlflowClient(store).get_metric_history(active.info.run_id, "my_loss")] == [1.5]
    finally:
        mlflow.set_tracking_uri(None)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_dead_tracking_server_never_holds_a_step_and_is_one_line(tmp_path, caplog):
    """MLflow's HTTP client retries a dead server for minutes: that happens off the training thread."""
    exporter = MlflowExporter(f"http://127.0.0.1:{_closed_port()}", timeout_s=1.0)
    t0 = time.perf_counter()
    opt, records = train(tmp_path, exporter)
    took = time.perf_counter() - t0
    assert opt.step_count == len(records)  # training went on, every step in the JSONL log
    assert took < 60, took  # the client alone would wait about 4 minutes before failing create_run
    failed = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.ERROR and "MlflowExporter" in r.getMessage()]
    assert failed and all("\n" not in m for m in failed)
    assert failed[0].startswith("ampguard: exporter MlflowExporter.") and "Training goes on" in failed[0]
    assert not exporter.active_run_id


def test_missing_mlflow_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'ampguard\[mlflow\]'"):
        ampguard.MlflowExporter()
