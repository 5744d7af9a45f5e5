"""Stop 59: how many of a non-fused fp16 step's step-graph ops come before the early skip flag's copy and event
(AMPGUARD_EARLY_SKIP=1), counted on the CPU as tests/unit/test_decision_kernels.py counts them (each op a kernel on
CUDA; the norms are a dot each here, one _foreach_norm there). The rest of the graph is what the skip read no longer
waits for. Run from the repository root:
PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop59/early_census.py
"""

from __future__ import annotations

import collections

import torch

from ampguard.payload import Layout
from tests.unit.test_decision_kernels import _Ops, census_guard, counting


class Event:
    def __init__(self, mode: _Ops) -> None:
        self.mode, self.at = mode, None

    def record(self) -> None:
        self.at = len(self.mode.seq)

    def synchronize(self) -> None:
        pass


def main() -> None:
    guard, step = census_guard("fp16", fused=False)
    pipe = guard._pipeline
    mode = _Ops()
    event = Event(mode)
    flag = torch.zeros(1, dtype=torch.bool)
    pipe.early_skip, pipe._new_flag = True, lambda: (flag, event)
    landing = Event(mode)  # the payload's landing (b057e19): a copy and an event at the graph's end
    buf = torch.zeros(Layout(1, 12).size)  # census_guard's 12 gradients; made here, outside the count
    pipe._new_slot = lambda size: (buf, landing)
    try:
        with counting("_through_decision", mode):
            step()
    finally:
        guard.close()
    seq = mode.seq
    assert event.at is not None, "the early flag was not handed over"
    dots = seq.count("dot")
    before, after = seq[: event.at], seq[event.at :]
    print(f"fp16 foreach step graph: {len(seq)} ops ({dots} dots, one _foreach_norm on CUDA); "
          f"{len(before)} up to the early flag's copy (its copy_ the last), {len(after)} after it")
    print(f"the payload's landing: its copy_ op number {landing.at}, {len(seq) - landing.at} after it (the scale's "
          "writes)")
    print("before:", dict(collections.Counter(before)))
    print("after: ", dict(collections.Counter(after)))


if __name__ == "__main__":
    main()
