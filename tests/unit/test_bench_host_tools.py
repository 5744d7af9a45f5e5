"""The host-time instruments the next device run reads (stop 46), run for real on the CPU at tiny sizes.

- ``benchmarks/host_time.py`` reports each stage's mean a step beside its median, and the batched arm's added mean
  beside the per-step arm's. On the H100 (``benchmarks/results/gpu_stop46/``) the default guard's whole-step mean
  rose while its ``settle`` fell; the medians alone could not say where the mean went. Before stop 46 the per-step
  arm's line quoted the *stages-apart* arm's mean as "the default guard's".
- ``benchmarks/frameworks_cost.py --pstats`` profiles every arm's own loop thread (cProfile sees one thread) and
  prints, per framework, where the guarded arm's host time a step goes beside the plain arm's. The framework rows
  miss by 1-3 ms a step on the H100 while the guard's own ``step()`` adds ~0.1 ms.
- ``host_time.py --nested OWNER:NAME,...`` times more stages inside others, beside the sums (stop 60: where the early
  skip flag's extra ``guard._measure`` went on the H100).
- ``frameworks_cost.py --clock thread`` reads a block as the arm thread's own CPU time (stop 68).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_host_time_reports_stage_means_and_the_batched_arms_added_mean(tmp_path):
    out = tmp_path / "rows.json"
    text = _run(["benchmarks/host_time.py", "--device", "cpu", "--models", "mlp", "--optims", "fused", "--blocks", "1",
                 "--steps", "6", "--warmup", "2", "--step-graph", "--batch-arm", "--json", str(out),
                 "--nested", "_pipeline:_measure_scaled,_pipeline.adapter:record_found_inf"], timeout=240)
    (row,) = json.loads(out.read_text())["rows"]
    for arm in (row, row["guard_step"], row["guard_perstep"]):
        means = arm["breakdown_mean_us"]
        assert "outcome.settle" in means and "rest" in means
        assert all(v == v for v in means.values())  # no NaN: every stage timed on every step
    step = row["guard_step"]
    assert step["added_mean_us"] == pytest.approx(step["us"]["mean"] - row["plain_us"]["mean"])
    # the per-step arm is compared with the batched (step graph) arm's mean, not the stages-apart arm's
    assert f"(the batched arm's mean: added {step['added_mean_us']:+.0f})" in text
    assert "   mean " in text
    # --nested (stop 60): stages inside others, an attribute path's method among them, beside the sums
    for arm in (row, step):
        nested = arm["breakdown_us"]
        assert nested["(pipeline._measure_scaled)"] > 0 and nested["(pipeline.adapter.record_found_inf)"] > 0
        assert nested["rest"] == pytest.approx(arm["breakdown_total_us"] - sum(
            v for k, v in nested.items() if not k.startswith("(") and k != "rest"))

    # the stages already nested for an owner stay beside --nested's (stop 60: naming another _pipeline method dropped
    # the skip read from the early arm's breakdown)
    sys.path.insert(0, str(REPO / "benchmarks"))
    import host_time

    stages = {"_pipeline": ("_learn_skip",)}
    host_time.add_nested("_pipeline:_land_last,_pipeline.step_graph:run,_pipeline:_hold", stages)
    assert stages == {"_pipeline": ("_learn_skip", "_land_last", "_hold"), "_pipeline.step_graph": ("run",)}


def test_frameworks_cost_pstats_profiles_each_arms_own_thread(tmp_path):
    pytest.importorskip("lightning")
    where = tmp_path / "profiles"
    text = _run(["benchmarks/frameworks_cost.py", "--device", "cpu", "--quick", "--frameworks", "lightning",
                 "--no-syncs", "--blocks", "2", "--pstats", str(where)], timeout=300)
    assert sorted(p.name for p in where.iterdir()) == ["lightning_guarded.pstats", "lightning_plain.pstats"]
    assert "lightning: own time a step, guarded minus plain (us)" in text
    ours = text.split("lightning: ampguard's functions by cumulative time a step (us):")[1]
    # the guarded loop's thread was profiled: the guard's step is in it, once a step
    assert "step (ampguard/guard.py:" in ours
    waits = text.split("lightning: calls a step that may wait for the device, lightning_guarded:")[1].splitlines()[0]
    # the CPU's host decision reads its values with Tensor.item(), a C method pstats names "<method 'item' of ...>"
    assert "<method 'item' of 'torch._C.TensorBase' objects>" in waits, waits


def test_frameworks_cost_isolate_runs_each_arm_in_its_own_process(tmp_path):
    # stop 65: in one process the arms' loops share the CUDA caching allocator, and on an H100 each guarded loop's
    # gradients moved between its turns (a capture every round); --isolate gives each loop a process of its own, the
    # rounds and the figures as before (CPU: the harness, not the cost)
    pytest.importorskip("lightning")
    out = tmp_path / "isolated.json"
    _run(["benchmarks/frameworks_cost.py", "--device", "cpu", "--quick", "--frameworks", "lightning", "--no-syncs",
          "--blocks", "2", "--isolate", "--out", str(out)], timeout=300)
    results = json.loads(out.read_text())
    meta, guards = results["meta"], results["guards"]
    assert meta["isolate"] and "one process per framework loop" in meta["method"]
    pids = {guards[name]["pid"] for name in ("lightning_plain", "lightning_guarded")}
    assert len(pids) == 2 and meta["pid"] not in pids  # each arm in a process of its own
    guarded = guards["lightning_guarded"]
    assert guarded["guard_steps"] == guarded["steps"] >= 3 * 3 and guarded["skipped_steps"] == 0
    assert all(results["timing"][name]["samples"] == 2 for name in ("lightning_plain", "lightning_guarded"))
    assert results["ratios"]["lightning"]["paired_ratio_median"] > 0


@pytest.mark.parametrize("clock", ["wall", "thread"])
def test_frameworks_cost_thread_clock_times_the_arms_own_cpu_time(clock):
    # stop 68: --clock thread reads a block as the arm thread's own CPU time over its turn (time.thread_time), where
    # the wall clock also counts what the thread did not run (another process on the core; here, a sleep)
    sys.path.insert(0, str(REPO / "benchmarks"))
    import frameworks_cost
    import torch

    arm = frameworks_cost.Arm("sleeper", "none", False, 2, torch.device("cpu"))

    def body(arm: frameworks_cost.Arm) -> None:
        while True:
            time.sleep(0.05)  # not the thread's CPU time
            deadline = time.thread_time() + 0.01
            while time.thread_time() < deadline:  # 10 ms of it, spun
                pass
            if arm.step_done():
                return

    arm.body = body
    saved, frameworks_cost.CLOCK[0] = frameworks_cost.CLOCK[0], clock
    try:
        blocks = [arm.run_block() for _ in range(3)]
        arm.end()
    finally:
        frameworks_cost.CLOCK[0] = saved
    assert arm.error is None and all(b is not None for b in blocks)
    per_step = [b / 2 for b in blocks]  # type: ignore[operator]
    if clock == "wall":  # the sleeps counted
        assert all(t >= 0.059 for t in per_step), per_step
    else:  # the spins only: ~10 ms a step, never the 50 ms sleeps
        assert all(0.009 <= t < 0.03 for t in per_step), per_step
