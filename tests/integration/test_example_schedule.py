"""``examples/schedule_ema.py`` run as a user runs it: the schedule advances once per taken step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_schedule_ema_example_holds_the_schedule_on_skipped_steps() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "schedule_ema.py"), "--steps", "16",
                           "--fault-step", "9"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    skipped = lines[0].split("skipped ")[1].split("  taken")[0]
    taken = int(lines[0].rsplit("taken ", 1)[1])
    assert "9" in skipped.strip("[]").split(", ") and taken < 16
    assert lines[1].startswith(f"scheduler stepped {taken} times")
