"""Stop 60: which gradients move between steps inside the frameworks' loops, so that the guard's graphs miss.

Stop 59's framework rows (``gpu_stop59/frameworks_{c,d}.json``, ``guards``) replayed the gradient measurement's graph
on 79 of 330 guarded steps in accelerate's loop, 32 in the Trainer's and 128 in Lightning's (58 + 70 of the step
graph), the same counts in both runs, where the hand loop replays on all but its first steps (``host_time.py``: 277
of 280). Every other step measures eagerly: per-tensor norms and the decision launched from Python, and a capture
now and then. A graph replays only where every gradient lies where it lay at capture (``MeasureGraph``).

This runs each framework's guarded arm of ``benchmarks/frameworks_cost.py`` (the same builders, model and data) for
``--steps`` steps alone and logs every ``MeasureGraph.run`` call: which graph, what it did (``e``: eager, a first
sighting or no capture credit; ``C``: captured; ``R``: replayed; ``-``: graphs off, as on the CPU), and where the
gradients lay (a letter per distinct tuple of addresses). For each call whose place differs from the previous
call's, it counts the gradients that moved, split by the caching allocator's pools (below 1 MiB: the small pool; at
or above: the large one). Diagnosis only: nothing here is asserted. On the device:

    PYTHONPATH=$PWD python benchmarks/results/cpu_stop60/fw_graph_keys.py --frameworks accelerate,transformers,lightning

On the CPU (a smoke run of the script: no graph, every call ``-``):

    PYTHONPATH=$PWD python benchmarks/results/cpu_stop60/fw_graph_keys.py --device cpu --size tiny --steps 6
"""

from __future__ import annotations

import argparse
import collections
import copy
import itertools
import statistics
import string
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import frameworks_cost as fc

from ampguard.decision_graph import MeasureGraph

SMALL = 1 << 20
"""The caching allocator serves requests below 1 MiB from its small pool."""

LOG: list[tuple[str, str, tuple[int, ...], tuple[int, ...], str]] = []
_run = MeasureGraph.run


def _logged(self: MeasureGraph, kind: Any, fn: Any, grads: Any, scale: Any = None) -> Any:
    captures, replays = self.captures, self.replays
    usable = self.enabled and not self.failed and self.capturable(grads[0].device)
    out = _run(self, kind, fn, grads, scale)
    what = "-" if not usable else "C" if self.captures > captures else "R" if self.replays > replays else "e"
    name = kind[0] if isinstance(kind, tuple) else str(kind)
    LOG.append((self.what, name, tuple(g.data_ptr() for g in grads), tuple(g.numel() * g.element_size() for g in grads),
                what))
    return out


def report(framework: str, log: list[tuple[str, str, tuple[int, ...], tuple[int, ...], str]]) -> None:
    by_graph: dict[tuple[str, str], list[tuple[tuple[int, ...], tuple[int, ...], str]]] = collections.defaultdict(list)
    for what, name, ptrs, sizes, did in log:
        by_graph[(what, name)].append((ptrs, sizes, did))
    print(f"\n{framework}: {len(log)} graph runs")
    for (what, name), calls in by_graph.items():
        places: dict[tuple[int, ...], str] = {}
        letters = "".join(places.setdefault(p, (string.ascii_letters + string.digits)[min(len(places), 61)])
                          for p, _, _ in calls)
        did = "".join(d for _, _, d in calls)
        moved_small, moved_large, moved_all = [], [], []
        for (prev, _, _), (ptrs, sizes, _) in itertools.pairwise(calls):
            if prev == ptrs or len(prev) != len(ptrs):
                continue
            moved = [s for a, b, s in zip(prev, ptrs, sizes) if a != b]
            moved_small.append(sum(s < SMALL for s in moved))
            moved_large.append(sum(s >= SMALL for s in moved))
            moved_all.append(len(moved))
        sizes = calls[0][1]
        n_small = sum(s < SMALL for s in sizes)
        print(f"  {what} ({name}): {len(calls)} calls over {len(sizes)} gradients ({n_small} below 1 MiB), "
              f"{len(places)} places; replays {did.count('R')}, captures {did.count('C')}, eager {did.count('e')}")
        print(f"    places:   {letters}")
        print(f"    outcomes: {did}")
        if moved_all:
            print(f"    calls after a move: {len(moved_all)}; gradients moved, median (max): "
                  f"{statistics.median(moved_all):g} ({max(moved_all)}), of them below 1 MiB "
                  f"{statistics.median(moved_small):g} ({max(moved_small)}), at or above "
                  f"{statistics.median(moved_large):g} ({max(moved_large)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--frameworks", default="accelerate,transformers,lightning")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--size", default="gpt2", choices=sorted(fc.SIZES))
    args = ap.parse_args()
    device = torch.device(args.device)
    size = fc.SIZES[args.size]
    MeasureGraph.run = _logged  # type: ignore[method-assign]
    base = fc.build_model(size, device)
    total = args.steps + 4
    ctx: dict[str, Any] = {"device": device, "size": size, "tmpdir": tempfile.mkdtemp(prefix="ampguard-keys-"),
                           "total_steps": total, "dataset": fc.Tokens(total * size["batch"], size)}
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"GPT-2 {args.size}, {args.steps} guarded steps a framework")
    for framework in [f.strip() for f in args.frameworks.split(",") if f.strip()]:
        if framework.startswith(("accelerate", "transformers")):
            fc._fresh_accelerate_state()
        LOG.clear()
        arm = fc.Arm(f"{framework}_guarded", framework, True, args.steps, device)
        fc.BUILDERS[framework](arm, copy.deepcopy(base), ctx)
        arm.run_block()
        arm.end()
        if arm.error:
            print(f"\n{framework}: failed\n{arm.error}")
            continue
        report(framework, list(LOG))


if __name__ == "__main__":
    main()
