#!/usr/bin/env python
"""Per-step host cost of packing the local vector on the CPU: the old pair of packs (the host
``pipeline.local_vector_host`` and the tensor ``stats.local_vector``, from git ``--base``) against
the one ``stats.local_vector`` of this tree, interleaved in one process (order alternating per
round), on one thread, with inputs shaped like a CPU step's (``--norms`` per-tensor norms, a loss,
GradScaler's found_inf). Prints p25/median/p75 in microseconds per call.

    python benchmarks/pack_cost.py [--base 4a6c9d3] [--rounds 4000] [--norms 18]
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from ampguard import stats
from ampguard.ops import device_constants
from ampguard.scaling import f32
from ampguard.stats import host_tensor


def old_packs(base: str) -> dict[str, object]:
    """The base tree's two packs, each defined from its own source (``git show``)."""
    pipeline = subprocess.run(["git", "show", f"{base}:ampguard/pipeline.py"], capture_output=True, text=True,
                              check=True).stdout
    old_stats = subprocess.run(["git", "show", f"{base}:ampguard/stats.py"], capture_output=True, text=True,
                               check=True).stdout
    ns: dict[str, object] = {"torch": torch, "math": math, "host_tensor": host_tensor, "f32": f32,
                             "_constants": lambda device: device_constants(device)[:4]}  # the old 4-tuple
    for source, name, stop in ((pipeline, "local_vector_host", "\ndef host_tensor("),
                               (old_stats, "local_vector", "\ndef origin_ranks(")):
        start = source.index(f"def {name}(")
        exec("from __future__ import annotations\n" + source[start:source.index(stop, start)], ns)
    return {"old host": ns["local_vector_host"], "old tensor": ns["local_vector"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="4a6c9d3")
    ap.add_argument("--rounds", type=int, default=4000)
    ap.add_argument("--norms", type=int, default=18)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fns = {**old_packs(args.base), "new": stats.local_vector}
    kw = dict(loss=torch.tensor(1.234), tensor_norms=torch.rand(args.norms), found_inf=torch.tensor(0.0),
              pre_reduction=None, device=torch.device("cpu"), no_grads=False, sentinel=None, headroom=None)
    ref = fns["old host"](**kw).tolist()  # type: ignore[operator]
    # The same values in the base's columns; columns added since (the fp8 flag, the parameter check) are 0 when off
    for name, fn in fns.items():
        got = fn(**kw).tolist()  # type: ignore[operator]
        if repr(got[:len(ref)]) != repr(ref) or any(v != 0 for v in got[len(ref):]):
            raise SystemExit(f"pack_cost: {name} packs {got}, the base's host pack {ref}: not the same step")
    interleaved({name: functools.partial(fn, **kw) for name, fn in fns.items()}, args.rounds)  # type: ignore[arg-type]


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 200, label: str = "") -> None:
    """Time each of ``fns`` once per round, in an order alternating per round, after ``warmup``
    rounds; print p25/median/p75 per function in microseconds."""
    times: dict[str, list[int]] = {k: [] for k in fns}
    order = list(fns.items())
    for r in range(warmup + rounds):
        for name, fn in order if r % 2 else order[::-1]:
            t = time.perf_counter_ns()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter_ns() - t)
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        print(f"{label}{name:10s} p25 {q[0] / 1e3:7.1f}  median {q[1] / 1e3:7.1f}  p75 {q[2] / 1e3:7.1f} us")


if __name__ == "__main__":
    main()
