#!/usr/bin/env python
"""Host time of a guarded ``step()`` on the CPU, two trees in one process: this tree's
``ampguard`` against an older tree's package imported under another name (every import inside
the package is relative, so a copy of its ``ampguard/`` directory named ``ampguard_old`` imports
side by side). Each round steps both guards once on the same batch (order alternating per
round); only ``opt.step()`` is timed (on the CPU the report is decoded inside it). Then the
report's construction alone, on the same payload values: ``Reporter.build`` (plus, in the old
tree, the indicators' ``attach``), interleaved likewise. Prints p25/median/p75 in microseconds.

    mkdir -p /tmp/oldpkg && git archive 4a6c9d3 ampguard | tar -x -C /tmp/oldpkg
    mv /tmp/oldpkg/ampguard /tmp/oldpkg/ampguard_old
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
from pack_cost import interleaved


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
        if kind == "fused":
            build_cost(runs, args.rounds * 4)
        for _, opt in runs.values():
            opt.close()  # type: ignore[attr-defined]


def build_cost(runs: dict[str, tuple[torch.nn.Module, object]], rounds: int) -> None:
    """The report built from one step's payload values, on each tree's own reporter."""
    from ampguard.payload import Layout
    from ampguard.stats import DECISION_K, LOCAL_K

    n = len(runs["new"][1].param_names)  # type: ignore[attr-defined]
    values = [float(i % 7) for i in range(DECISION_K + LOCAL_K + n)]
    values[6:18] = [0.0] * 12  # a healthy step: no reason, no flag (Dec.REASON .. Dec.ZCLIP_REBASELINE)
    index = list(range(n))
    old, new = runs["old"][1]._reporter, runs["new"][1]._reporter  # type: ignore[attr-defined]
    layout = Layout(world=1, norms=n)
    fns = {"old": lambda: old.build(0, values, index),
           "new": lambda: new.build(0, layout.unpack(values), index)}
    interleaved(fns, rounds, label="build    ")


if __name__ == "__main__":
    main()
