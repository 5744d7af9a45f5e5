#!/usr/bin/env python
"""Where a step's host time goes: ``cProfile`` over guarded and plain steps of issue 16's table
models (``table.py``'s builders), one variant at a time, after a warm-up. Prints wall ms per step
without the profiler (median of 5 runs of ``--steps`` steps, synchronised at the edges), then
the profile's top functions by own time. Run (CUDA):

    python benchmarks/host_profile.py --device cuda --variants plain_unfused,guard_unfused [--compile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import table


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default=None, help="overhead.SIZES key (default gpt2 on CUDA, mlp-small on CPU)")
    ap.add_argument("--variants", default="plain_unfused,guard_unfused")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    size = args.size or ("gpt2" if device.type == "cuda" else "mlp-small")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as tmp:
        ctx = table.make_ctx(size, device, tmp, "inductor")
        for label in args.variants.split(","):
            v = table.build(label, ctx, compile_model=args.compile)
            for _ in range(8 if args.compile else 5):
                v.step()
            sync()
            runs = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    v.step()
                sync()
                runs.append((time.perf_counter() - t0) / args.steps * 1e3)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                v.step()
            sync()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
            what = f"{size}, compiled" if args.compile else size
            print(f"===== {label} ({what}): {statistics.median(runs):.2f} ms/step "
                  f"(runs {', '.join(f'{r:.2f}' for r in runs)}); profile over {args.steps} steps:")
            print("\n".join(line[:170] for line in out.getvalue().splitlines()[:args.top + 12]))
            table.free([v], device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
