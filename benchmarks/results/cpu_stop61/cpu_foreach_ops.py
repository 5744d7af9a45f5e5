"""Stop 61: where the guard's extra time goes on the CPU's foreach row (table.py --device cpu --groups mlp-small,
guard_unfused against plain_unfused, 1.048-1.052 at stop 59). Both arms built as table.py builds them (overhead.py's
build_variant, fp16 GradScaler on the CPU, autocast off as --cpu-autocast off), warmed, then STEPS steps of each under
torch.profiler: self CPU time by op, per step, the guard's against the plain arm's, and the wall time of each arm's
steps interleaved (medians). Run from the repository root: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python THIS."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import overhead as oh

STEPS = int(os.environ.get("STEPS", 200))


def main() -> None:
    device = torch.device("cpu")
    size = oh.SIZES["mlp-small"]
    ctx = dict(device=device, size=size, batch=oh.make_batch(size, device), init_scale=2.0**16,
               autocast=contextlib.nullcontext, tmpdir="/tmp")
    arms = {k: oh.build_variant(k, False, ctx) for k in ("plain", "guard")}
    for v in arms.values():
        for _ in range(30):
            v.step()
    wall: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(STEPS):
        for k, v in arms.items():
            t = time.perf_counter_ns()
            v.step()
            wall[k].append((time.perf_counter_ns() - t) / 1e3)
    print(f"torch {torch.__version__}, {STEPS} steps an arm, interleaved; wall us a step, p25 / median / p75")
    for k, w in wall.items():
        q = statistics.quantiles(w, n=4)
        print(f"  {k:<6} {q[0]:8.1f} {q[1]:8.1f} {q[2]:8.1f}")
    tables = {}
    for k, v in arms.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(STEPS // 2):
                v.step()
        tables[k] = {e.key: (e.self_cpu_time_total / (STEPS // 2), e.count / (STEPS // 2))
                     for e in prof.key_averages()}
    keys = sorted(set(tables["plain"]) | set(tables["guard"]),
                  key=lambda key: -(tables["guard"].get(key, (0, 0))[0] - tables["plain"].get(key, (0, 0))[0]))
    print("\nself CPU us a step (profiled): guard - plain, by op (the 25 largest differences), calls a step")
    for key in [*keys[:25], "...", *keys[-10:]]:
        if key == "...":
            print("  ...")
            continue
        g, p = tables["guard"].get(key, (0.0, 0.0)), tables["plain"].get(key, (0.0, 0.0))
        print(f"  {key:<55} {g[0] - p[0]:+8.1f}   guard {g[0]:8.1f} ({g[1]:4.1f})   plain {p[0]:8.1f} ({p[1]:4.1f})")
    tot = {k: sum(x[0] for x in t.values()) for k, t in tables.items()}
    print(f"\nself CPU total a step: guard {tot['guard']:.1f}, plain {tot['plain']:.1f}")


if __name__ == "__main__":
    main()
