"""WandbExporter against real wandb in offline mode, read back from the run's own ``.wandb`` file."""

from __future__ import annotations

import json
import math
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import wandb
from google.protobuf.message import DecodeError
from wandb.proto import wandb_internal_pb2 as pb

import ampguard
from ampguard.errors import BackendUnavailableError
from ampguard.exporters import WandbExporter

from ._tracked_run import expected, same, train

_SETTINGS = dict(console="off", x_disable_stats=True, disable_git=True, save_code=False, silent=True)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    return tmp_path


def _records(path: Path) -> list[Any]:
    """The protobuf records of a ``.wandb`` transaction log (wandb's own ``Record`` schema).

    The file is a 7-byte header (``:W&B``, magic 0xBEE1, version 0) and then LevelDB-log framing:
    32 KiB blocks of chunks, each a 7-byte header (checksum u32, length u16, type u8: 1 full,
    2 first, 3 middle, 4 last) and its bytes; a block's tail shorter than a header is padding."""
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    out, pos, parts, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # padding at the end of a block
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a chunk wandb's service process is still writing: not a record yet
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def _exited(log: Path) -> bool:
    """The run's exit record is in the log. Read while wandb's service process writes it: a record caught half
    written (its chunk's bytes not all there, or not yet parseable) means not yet."""
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in _records(log))
    except DecodeError:
        return False


def _history(run_dir: Path) -> list[dict[str, Any]]:
    (log,) = run_dir.glob("*.wandb")
    deadline = time.monotonic() + 30
    while not _exited(log) and time.monotonic() < deadline:
        time.sleep(0.2)  # wandb's own service process writes the file: wait for the run's exit record
    rows = []
    for record in _records(log):
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def _number(value: Any) -> float:
    return float(value) if not isinstance(value, str) else float({"NaN": "nan", "Infinity": "inf"}.get(value, value))


def test_wandb_shows_the_steps_and_values_of_the_jsonl_log_of_the_same_run(offline):
    exporter = WandbExporter(project="ampguard-test", settings=wandb.Settings(**_SETTINGS))
    opt, records = train(offline, exporter)
    run_dir = Path(exporter.active_run.dir).parent
    rows = _history(run_dir)
    assert [row["ampguard/step"] for row in rows] == [r["step"] for r in records]
    for key, want in expected(records).items():
        got = [(row["ampguard/step"], _number(row[key])) for row in rows]
        assert all(s == t and same(a, b) for (s, a), (t, b) in zip(got, want)) and len(got) == len(want), key
    assert any(math.isnan(_number(row["ampguard/loss"])) for row in rows)  # the non-finite loss, as it was
    assert {row["ampguard/step"] for row in rows if row["ampguard/anomalies"]} == {a.step for a in opt.anomalies}
    runs = [r.run for r in _records(next(run_dir.glob("*.wandb"))) if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for r in runs for item in r.config.update}
    assert config["ampguard"]["ampguard.run_id"] == opt.run_info.run_id


def test_wandb_logs_into_the_callers_run_on_its_own_axis_and_leaves_it_open(offline):
    run = wandb.init(project="ampguard-test", settings=wandb.Settings(**_SETTINGS))
    run_dir = Path(run.dir).parent
    try:
        run.log({"my_loss": 1.0})  # the caller's own step counter: 0, 1, ...
        run.log({"my_loss": 0.5})
        exporter = WandbExporter()  # wandb.run: the active run
        _, records = train(offline, exporter)
        assert exporter.active_run is run and wandb.run is run  # not finished by close()
        run.log({"my_loss": 0.25})
    finally:
        run.finish()
    rows = _history(run_dir)
    assert [row["my_loss"] for row in rows if "my_loss" in row] == [1.0, 0.5, 0.25]
    assert [row["ampguard/step"] for row in rows if "ampguard/step" in row] == [r["step"] for r in records]


def test_a_dead_wandb_server_never_holds_a_step_and_is_one_line(tmp_path, caplog):
    """Online, against a server that is not there: wandb.init waits ``init_timeout`` before it fails,
    off the training thread; the failure is one line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_timeout = 30.0
    settings = wandb.Settings(mode="online", base_url=f"http://127.0.0.1:{port}", api_key="0" * 40,
                              init_timeout=init_timeout, **_SETTINGS)
    exporter = WandbExporter(project="ampguard-test", dir=str(tmp_path), timeout_s=1.0, settings=settings)
    stamps: list[float] = []
    start = time.monotonic()
    opt, records = train(tmp_path, exporter, after_step=lambda step: stamps.append(time.monotonic()))
    assert opt.step_count == len(records)  # training went on
    assert stamps[-1] - start < init_timeout  # neither wrap() nor a step waited for wandb.init
    failed = [r.getMessage() for r in caplog.records if "WandbExporter" in r.getMessage() and r.levelname == "ERROR"]
    assert failed and all("\n" not in m for m in failed), failed
    assert failed[0].startswith("ampguard: exporter WandbExporter.") and "Training goes on" in failed[0]
    assert exporter.active_run is None


def test_missing_wandb_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'ampguard\[wandb\]'"):
        ampguard.WandbExporter()
