"""The distributed examples run as documented (torchrun / horovodrun, 2 ranks, CPU) and exit 0
(each checks that every rank skipped the faulted step, named the right rank, and ended with
identical parameters)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._common import free_port

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_train_ddp_example() -> None:
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port()), "examples/train_ddp.py", "--steps", "12", "--fault-step", "4"])
    assert "step 4 skipped on every rank: nonfinite_loss, from rank(s) [1]" in out
    assert "ranks agree" in out


@pytest.mark.horovod
@pytest.mark.timeout(180)
def test_train_horovod_example() -> None:
    pytest.importorskip("horovod.torch")
    out = _run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
                sys.executable, "examples/train_horovod.py", "--steps", "12", "--fault-step", "4"])
    assert "step 4 skipped on every rank: nonfinite_grad, from rank(s) [1]" in out
    assert "ranks agree" in out
