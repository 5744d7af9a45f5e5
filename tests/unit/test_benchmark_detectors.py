"""``benchmarks/detectors.py --quick``: the detectors' comparison runs end to end in seconds, from
a real event log, and its numbers mean what the table says."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_mode(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("detectors_bench", REPO / "benchmarks" / "detectors.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "quick"
    result = bench.main(["--quick", "--keep-log", "--out", str(out)])
    assert json.loads(Path(f"{out}.json").read_text())["replay"] == result["replay"]
    table = Path(f"{out}.md").read_text()
    assert "--quick" in table and "| zscore |" in table and "| zclip | clip |" in table
    events = Path(f"{out}.events.jsonl").read_text().splitlines()
    assert len([e for e in events if '"event":"step"' in e or '"event": "step"' in e]) == result["plan"]["steps"]
    replay = result["replay"]
    for name in ("factor", "zscore", "zclip"):  # every bad batch (targets x30) is caught by every detector
        assert all(e["caught"] for e in replay[name]["events"] if e["kind"] == "bad_batch"), name
    for sp in replay["zclip"]["spikes"]:
        if sp["kind"] == "bad_batch":
            assert sp["share_let_through"] < 0.1 and sp["let_through"] < 3 * result["healthy_norm_median"]
    assert result["live"]["none"]["skipped"] == 0 and result["live"]["zclip"]["clipped"] > 0
    assert result["live"]["zscore"]["skipped"] > 0
