"""benchmarks/numerics_indicators.py in its smoke mode: it runs, interleaves both variants, and
writes the quartiles of the per-block ratios (the lead measures the real cost on a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


def test_quick_cpu_run_writes_the_ratio_quartiles(tmp_path):
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "numerics_indicators.py"), "--device", "cpu",
                          "--quick", "--out", str(out)], capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert set(data["variants"]) == {"off", "indicators"}
    ratio = data["variants"]["indicators"]["ratio_vs_off"]
    assert 0 < ratio["p25"] <= ratio["median"] <= ratio["p75"]
    assert data["config"]["every"] == 10 and data["config"]["block"] == 10
    assert data["modules"] == ["wte", "wpe", "blocks", "ln_f"]  # GPT's tied head belongs to wte
    assert "ratio vs off p25/median/p75" in res.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "numerics_indicators.py"), "--every", "0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--every=0" in bad.stderr
