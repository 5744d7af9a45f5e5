"""examples/train_fp8.py run as a user runs it (a subprocess): a tiny Llama trained with real torchao float8
(emulated on the CPU) under the guard, an Inf put into one layer's output at one step: that step alone is skipped,
the poisoned cast is named by module and role, and the loss still goes down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchao.float8")
pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_fp8_example_names_the_poisoned_cast_and_learns(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_fp8.py"), "--steps", "16",
                           "--fault-step", "6", "--device", "cpu", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    summary = json.loads(out.read_text())
    assert summary["steps"] == 16 and summary["skipped"] == [6] and summary["stopped"] is None
    (found,) = summary["fp8_anomalies"]
    assert found["step"] == 6 and found["module"] == "model.layers.0.mlp.down_proj"
    assert "model.layers.0.mlp.down_proj, input: amax inf → scale 0" in found["detail"]
    assert summary["float8_casts_per_step"] == 2 * 7 * 3  # 2 layers x 7 linears x (input, weight, grad_output)
    assert summary["last_loss"] < summary["first_loss"]
