"""Stop 60: stop 59's framework rows read by their fastest rounds (no device needed). frameworks_cost.py's JSON keeps
every round's ms a step per arm (``rounds_ms``); the paired per-round ratios spread +-5-10 % on that lease, so the
medians could not resolve a 1 % target. This prints, per framework and run: the median of the per-round ratios, its
bootstrap 95 % interval (2000 resamples), the per-round ratios' spread (sd of their logs), the ratio of the arms'
fastest-quartile means and of their fastest rounds, and how many rounds a 1 % interval half-width would need.
Run from the repository root: python benchmarks/results/cpu_stop60/fw_fastest.py
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

RUNS = Path(__file__).resolve().parents[1] / "gpu_stop59"


def main() -> None:
    for tag in ("c", "d"):
        rounds = json.loads((RUNS / f"frameworks_{tag}.json").read_text())["rounds_ms"]
        for fw in ("accelerate", "transformers", "lightning"):
            plain, guarded = rounds[f"{fw}_plain"], rounds[f"{fw}_guarded"]
            ratios = [g / p for p, g in zip(plain, guarded)]
            sd = statistics.stdev(math.log(r) for r in ratios)
            rng = random.Random(0)
            meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
            q = len(plain) // 4
            fq = statistics.fmean(sorted(guarded)[:q]) / statistics.fmean(sorted(plain)[:q])
            need = math.ceil((1.96 * 1.2533 * sd / 0.01) ** 2)  # the median's standard error ~1.2533 sd / sqrt(n)
            print(f"run {tag} {fw:<12} paired median {statistics.median(ratios):.3f} (95 % {meds[50]:.3f}-"
                  f"{meds[1950]:.3f}), sd(log) {sd:.3f}; fastest quartile {fq:.3f}, fastest round "
                  f"{min(guarded) / min(plain):.3f} ({min(plain):.1f} / {min(guarded):.1f} ms); "
                  f"rounds for +-1 %: ~{need}")


if __name__ == "__main__":
    main()
