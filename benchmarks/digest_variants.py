"""Variants of the replica digest (``ampguard.fingerprint.params_digest``), timed alone on one model's
parameters: which one reads the bits fastest (issue 27: the digest at N=100 must cost at most 0.1 % of a step).

- ``before``: the digest before its plan (chunks of ``_CHUNK`` elements, each reduced and weighted on its own:
  about 14 kernels a chunk, launch-bound on a GPU);
- ``main``: the code on main (a plan made once per parameter list; per chunk its concatenation and two
  reductions; the weights applied once to all row and column sums). Bitwise the same digest;
- ``tensors``: no concatenation: each tensor summed on its own (the per-parameter fingerprints, folded).

Run ``a`` (2026-12-04) timed the first version's larger chunks and a row-sums-only variant instead; see
benchmarks/RESULTS.md.

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


def _before(tensors) -> torch.Tensor:
    """``params_digest`` as it was before its plan (commit c158234): per chunk, a concatenation, ``_sums`` (row and
    column sums, weighted there) and the offset folded in, about 14 kernels a chunk."""
    device = tensors[0].device
    by_width: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        x = F._ints(t).reshape(-1).to(device)
        by_width.setdefault(x.dtype, []).append(x)
    plain = torch.zeros((), dtype=torch.int64, device=device)
    weighted = torch.zeros((), dtype=torch.int64, device=device)
    offset = 0
    for dtype in sorted(by_width, key=str):
        pending: list[torch.Tensor] = []
        size = 0
        chunks: list[torch.Tensor] = []
        for x in by_width[dtype]:
            if x.numel() >= F._CHUNK:
                if pending:
                    chunks.append(torch.cat(pending))
                    pending, size = [], 0
                chunks.append(x)
                continue
            pending.append(x)
            size += x.numel()
            if size >= F._CHUNK:
                chunks.append(torch.cat(pending))
                pending, size = [], 0
        if pending:
            chunks.append(torch.cat(pending))
        for chunk in chunks:
            s = F._sums(chunk)
            plain = plain + s[0]
            weighted = weighted + s[1] + offset * s[0]
            offset += chunk.numel()
    return torch.stack([plain, weighted])


VARIANTS = {
    "before": _before,
    "main": lambda ts: F.params_digest(ts),
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
    for fn in VARIANTS.values():  # warm-up (and main's plan)
        fn(params)
    assert torch.equal(VARIANTS["before"](params), VARIANTS["main"](params))
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
