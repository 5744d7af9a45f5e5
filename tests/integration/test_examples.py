"""The single-device example (what ``make demo`` runs), run as a user runs it: a subprocess.

The assertions read the JSON summary the example writes with ``--out``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_single.py"
STEPS = 60

# The example's fault schedule (examples/train_single.py): step -> (skip reason, anomaly kind).
NAN_LOSS_STEP = 10
BURST = (20, 21, 22)
OVERFLOW_STEP = 35


def _run(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "s.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    return _run(tmp_path_factory.mktemp("fp16"))


def test_scheduled_faults_are_skipped_with_their_reasons(fp16_run: tuple[dict[str, Any], str]) -> None:
    summary, _ = fp16_run
    assert summary["precision"] == "fp16"
    assert summary["steps"] == STEPS
    reports = summary["reports"]
    assert [r["step"] for r in reports] == list(range(STEPS))

    # every fault fired exactly where it was scheduled
    fired = {f["name"]: f["fired_at"] for f in summary["faults"]}
    assert fired == {
        "nan loss": [NAN_LOSS_STEP],
        "inf gradient burst": list(BURST),
        "huge module output": [OVERFLOW_STEP],
    }
    # ... and those steps, and only those, were skipped, for the right reason
    assert summary["skipped_by_reason"] == {
        "nonfinite_loss": [NAN_LOSS_STEP],
        "nonfinite_grad": [*BURST, OVERFLOW_STEP],
    }
    assert summary["skipped"] == 1 + len(BURST) + 1
    for r in reports:
        assert r["skipped"] == (r["step"] in (NAN_LOSS_STEP, *BURST, OVERFLOW_STEP)), r

    # the NaN loss left the gradients finite; the overflowing steps did not
    assert reports[NAN_LOSS_STEP]["loss"] == "nan"
    assert isinstance(reports[NAN_LOSS_STEP]["grad_norm"], float)
    for step in (*BURST, OVERFLOW_STEP):
        assert reports[step]["grad_norm"] in ("inf", "nan"), reports[step]
    # the huge activation kept the forward pass finite: the overflow happened in fp16 backward
    assert isinstance(reports[OVERFLOW_STEP]["loss"], float)

    kinds = [(a["step"], a["kind"]) for a in summary["anomalies"] if a["kind"] != "grad_spike"]
    assert kinds == [
        (NAN_LOSS_STEP, "nonfinite_loss"),
        *[(s, "overflow") for s in BURST],
        (OVERFLOW_STEP, "overflow"),
    ]
    for a in summary["anomalies"]:
        if a["step"] in BURST:
            assert a["params"][0] == "head.weight"
        assert a["detail"]


def test_scale_backs_off_per_hysteresis(fp16_run: tuple[dict[str, Any], str]) -> None:
    summary, _ = fp16_run
    reports = summary["reports"]
    first, second, third = (reports[s] for s in BURST)
    scale = first["loss_scale"]
    # GuardConfig(hysteresis=2): kept on the 1st overflow, halved on the 2nd and on the 3rd (the
    # allowance refills only when the scale grows: docs/hysteresis.md)
    assert first["next_loss_scale"] == scale
    assert second["loss_scale"] == scale and second["next_loss_scale"] == scale / 2
    assert third["loss_scale"] == scale / 2 and third["next_loss_scale"] == scale / 4
    # a NaN loss with finite gradients holds the scale; a lone overflow with no growth since the
    # burst backs it off
    assert reports[NAN_LOSS_STEP]["next_loss_scale"] == reports[NAN_LOSS_STEP]["loss_scale"]
    overflow = reports[OVERFLOW_STEP]
    assert overflow["loss_scale"] == scale / 4 and overflow["next_loss_scale"] == scale / 8
    assert summary["scale_max"] == scale
    assert summary["scale_min"] == summary["scale_final"] == scale / 8
    # the scale moved only at the overflows that spent no allowance (growth_interval is far away)
    changes = [r["step"] for r in reports if r["next_loss_scale"] != r["loss_scale"]]
    assert changes == [BURST[1], BURST[2], OVERFLOW_STEP]


def test_model_learns_and_output_is_readable(fp16_run: tuple[dict[str, Any], str]) -> None:
    summary, stdout = fp16_run
    assert summary["learned"]
    assert summary["loss_last"] < summary["loss_first"] - 0.5
    assert "SKIPPED (nonfinite_loss)" in stdout
    assert "scale 65536 -> 32768" in stdout
    assert "summary:" in stdout


def test_bf16_without_faults_skips_nothing(tmp_path: Path) -> None:
    summary, _ = _run(tmp_path, "--no-faults", "--precision", "bf16")
    assert summary["precision"] == "bf16"
    assert summary["faults"] == []
    assert summary["skipped"] == 0
    assert summary["skipped_by_reason"] == {}
    assert all(r["loss_scale"] == 1.0 and not r["skipped"] for r in summary["reports"])
    assert not [a for a in summary["anomalies"] if a["kind"] != "grad_spike"]
    assert summary["learned"]
