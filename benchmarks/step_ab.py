#!/usr/bin/env python
"""Host time of a guarded ``step()`` on the CPU, two trees in one process: this tree's
``ampguard`` against an older tree's package imported under another name (every import inside
the package is relative, so a copy of its ``ampguard/`` directory named ``ampguard_old`` imports
side by side). Each round steps both guards once on the same batch (order alternating per
round); only ``opt.step()`` is timed (on the CPU the report is decoded inside it). Prints
p25/median/p75 in microseconds per step, per optimizer.

    git worktree add /tmp/old 4a6c9d3 && mkdir -p /tmp/oldpkg && cp -r /tmp/old/ampguard /tmp/oldpkg/ampguard_old
    PYTHONPATH=$PWD:/tmp/oldpkg python benchmarks/step_ab.py [--rounds 400] [--width 32]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
import warnings

import torch
import torch.nn.functional as F


def build(pkg: object, kind: str, width: int) -> tuple[torch.nn.Module, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.GELU())],
                                torch.nn.Linear(width, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if kind == "fused" else {}))
    opt = pkg.wrap(inner, model=model, precision="fp16",  # type: ignore[attr-defined]
                   scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--old", default="ampguard_old")
    ap.add_argument("--width", type=int, default=32, help="small: the step is mostly the guard's host work")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    pkgs = {"old": importlib.import_module(args.old), "new": importlib.import_module("ampguard")}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, args.width, generator=g), torch.randn(8, 1, generator=g)) for _ in range(8)]
    for kind in ("fused", "foreach"):
        runs = {name: build(pkg, kind, args.width) for name, pkg in pkgs.items()}
        times: dict[str, list[int]] = {name: [] for name in runs}
        order = list(runs.items())
        for r in range(50 + args.rounds):
            x, y = batches[r % len(batches)]
            for name, (model, opt) in order if r % 2 else order[::-1]:
                with opt.autocast():  # type: ignore[attr-defined]
                    loss = F.mse_loss(model(x).float(), y)
                opt.backward(loss)  # type: ignore[attr-defined]
                t = time.perf_counter_ns()
                opt.step()  # type: ignore[attr-defined]
                if r >= 50:
                    times[name].append(time.perf_counter_ns() - t)
                opt.zero_grad()  # type: ignore[attr-defined]
        a, b = (runs[n][0] for n in ("old", "new"))
        same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        for name, ts in times.items():
            q = statistics.quantiles(ts, n=4)
            print(f"{kind:8s} {name:4s} p25 {q[0] / 1e3:7.1f}  median {q[1] / 1e3:7.1f}  p75 {q[2] / 1e3:7.1f} us"
                  f"   (parameters bitwise equal: {same})")
        for _, opt in runs.values():
            opt.close()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
