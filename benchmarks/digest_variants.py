"""Variants of the replica digest (``ampguard.fingerprint.params_digest``), timed alone on one model's
parameters: which one reads the bits fastest (issue 27: the digest at N=100 must cost at most 0.1 % of a step).

- ``main``: the code on main (chunks of ``_CHUNK`` elements, row and column sums of each chunk in int64);
- ``chunk16M`` / ``chunk64M``: the same with larger chunks (fewer kernels, more temporary memory);
- ``rows``: one read per chunk: row sums only, weighted by the row (a swap within a row of 4096 is not seen;
  a flipped bit and a swap across rows are);
- ``tensors``: no concatenation: each tensor summed on its own (the per-parameter fingerprints, folded).

    python benchmarks/digest_variants.py --device cuda --model gpt2 --reps 30 --out digest.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import overhead

from ampguard import fingerprint as F


def _rows_sums(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    cols = min(n, 4096)
    rows = n // cols
    main = x[: rows * cols].view(rows, cols)
    row_sums = main.sum(1, dtype=torch.int64)
    plain = row_sums.sum()
    weighted = (row_sums * F._weights(x.device, rows, 1, 1)).sum()
    if rows * cols < n:
        tail = x[rows * cols :].to(torch.int64)
        plain, weighted = plain + tail.sum(), weighted + tail.sum() * (rows + 1)
    return torch.stack([plain, weighted])


def _digest(tensors, chunk: int, sums) -> torch.Tensor:
    old, old_sums = F._CHUNK, F._sums
    F._CHUNK, F._sums = chunk, sums
    try:
        return F.params_digest(tensors)
    finally:
        F._CHUNK, F._sums = old, old_sums


VARIANTS = {
    "main": lambda ts: F.params_digest(ts),
    "chunk16M": lambda ts: _digest(ts, 1 << 24, F._sums),
    "chunk64M": lambda ts: _digest(ts, 1 << 26, F._sums),
    "rows": lambda ts: _digest(ts, 1 << 22, _rows_sums),
    "rows64M": lambda ts: _digest(ts, 1 << 26, _rows_sums),
    "tensors": lambda ts: F.param_fingerprints(ts).sum(0),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="gpt2", choices=sorted(overhead.SIZES))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    model = overhead.build_model(overhead.SIZES[args.model], device)
    params = [q.detach() for q in model.parameters()]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for fn in VARIANTS.values():  # warm-up
        fn(params)
    for r in range(args.reps):
        for name in list(VARIANTS)[r % len(VARIANTS):] + list(VARIANTS)[: r % len(VARIANTS)]:
            sync()
            t = time.perf_counter()
            VARIANTS[name](params)
            sync()
            times[name].append((time.perf_counter() - t) * 1e3)
    out = {"n_params": sum(q.numel() for q in params), "tensors": len(params), "ms": {}}
    for name, xs in times.items():
        q = statistics.quantiles(xs, n=4)
        out["ms"][name] = {"p25": q[0], "median": statistics.median(xs), "p75": q[2]}
        print(f"{name:10s} p25 {q[0]:8.3f}  median {statistics.median(xs):8.3f}  p75 {q[2]:8.3f} ms")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
