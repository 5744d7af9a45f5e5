"""benchmarks/numerics_indicators.py in its smoke mode: it runs, interleaves both variants, and
writes the quartiles of the per-block ratios (the lead measures the real cost on a GPU). And the A/B
benchmarks run the library ``PYTHONPATH`` names."""

from __future__ import annotations

import json
import os
import shutil
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


@pytest.mark.parametrize("script", ["frameworks_cost.py", "overhead.py"])
def test_a_library_named_on_pythonpath_is_the_one_a_benchmark_runs(tmp_path, script):
    """``gpu_issue26.sh FW_BASE=REV`` puts an archived ``ampguard`` first on ``PYTHONPATH`` and runs
    ``frameworks_cost.py`` (which imports ``overhead.py``) to time that library against the tree's. Both scripts put
    the tree's root at the front of ``sys.path``, so until stop 54 the archive was never imported: stop 48's and
    stop 54's "base" arms ran the tree's library. Imported as a script would be (``benchmarks/`` first), each
    must leave ``PYTHONPATH``'s copy in charge."""
    base = tmp_path / "base"
    shutil.copytree(ROOT / "ampguard", base / "ampguard", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); "
            "runpy.run_path(sys.argv[2], run_name='not_main'); import ampguard; print(ampguard.__file__)")
    env = {**os.environ, "PYTHONPATH": f"{base}{os.pathsep}{ROOT}"}
    res = subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / script)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert Path(res.stdout.strip().splitlines()[-1]).resolve() == (base / "ampguard" / "__init__.py").resolve()
