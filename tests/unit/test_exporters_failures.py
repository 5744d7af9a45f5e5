"""A failed exporter is one line on stderr (the exporter, the error, what to do), not a traceback.

Each case runs a real guarded training in a fresh process, as a user's script would, with no logging
configured, against a real failure: a full disk (``/dev/full``) and a metrics port another process holds.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_RUN = """
import logging, sys, torch, ampguard
if sys.argv[2] == "debug":
    logging.basicConfig()
    logging.getLogger("ampguard").setLevel(logging.DEBUG)
kind, where = sys.argv[1].split("=", 1)
exporter = (ampguard.JsonlExporter(where) if kind == "jsonl"
            else ampguard.PrometheusExporter(port=int(where), addr="127.0.0.1"))
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="fp32",
                    exporters=[exporter])
for _ in range(5):
    opt.backward(model(torch.randn(3, 4)).square().mean())
    opt.step()
    opt.zero_grad()
opt.close()
print("steps", opt.step_count)
"""


def _run(target: str, level: str = "default") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", _RUN, target, level], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)


def _ampguard_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip()]


@pytest.fixture
def taken_port():
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    yield blocker.getsockname()[1]
    blocker.close()


def test_a_full_disk_is_one_line_naming_the_exporter_the_error_and_what_to_do():
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    p = _run("jsonl=/dev/full")
    assert p.returncode == 0 and p.stdout.split() == ["steps", "5"], p.stderr  # training went on
    lines = _ampguard_lines(p.stderr)
    assert len(lines) == 1, p.stderr
    line = lines[0]
    assert line.startswith("ampguard: exporter JsonlExporter.open() failed: OSError: [Errno 28] No space left")
    assert "Training goes on" in line and "free space or fix the path" in line and "logging.DEBUG" in line


def test_a_taken_port_is_one_line_naming_the_port(taken_port):
    p = _run(f"prometheus={taken_port}")
    assert p.returncode == 0 and p.stdout.split() == ["steps", "5"], p.stderr
    lines = _ampguard_lines(p.stderr)
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("ampguard: exporter PrometheusExporter.open() failed: PortInUseError")
    assert f"port {taken_port} on 127.0.0.1 is already in use" in lines[0] and "Training goes on" in lines[0]


def test_the_traceback_is_there_at_debug_on_the_ampguard_logger(taken_port):
    p = _run(f"prometheus={taken_port}", "debug")
    assert p.returncode == 0, p.stderr
    assert "Traceback (most recent call last)" in p.stderr and "PortInUseError" in p.stderr
    assert p.stderr.count("PrometheusExporter.open() failed: PortInUseError") == 1
