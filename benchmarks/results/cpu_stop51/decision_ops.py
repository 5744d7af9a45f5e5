"""Stop 51: the aten ops of the guard's tensor decision, one step, on the CPU (the census of what the step graph
replays on CUDA, where each non-view op is a kernel). Stop 44's compiled fp8 profile put the guard's own device time
at ~150 us of `_foreach_norm` plus ~60 small kernels of ~1 us each; issue 28's unsampled target (1.005) was missed by
~0.001 (40 us of a 40 ms step). This counts those kernels by op so a change to the decision can be weighed on the CPU
before a device run: bf16 (`_through_unscaled`) and fp16 with a GradScaler (`_through_decision`), fused AdamW, the
tensor decision forced as tests/unit/test_fast_path.py does. Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python
benchmarks/results/cpu_stop51/decision_ops.py"""

from __future__ import annotations

import collections

from torch.profiler import ProfilerActivity, profile

import ampguard.pipeline as pipeline
from tests.unit.test_decision_kernels import census_guard

VIEWS = {"aten::as_strided", "aten::unsqueeze", "aten::view", "aten::flatten", "aten::reshape", "aten::select",
         "aten::empty", "aten::empty_strided", "aten::to", "aten::_to_copy", "aten::scalar_tensor", "aten::alias",
         "aten::expand", "aten::squeeze", "aten::slice", "aten::detach", "aten::lift_fresh"}
"""No kernel of their own (views, allocations, the dispatch of a copy whose ``copy_`` is counted)."""


def census(precision: str, method: str) -> collections.Counter[str]:
    # the guard and its step: the test's (tests/unit/test_decision_kernels.py, stop 52; this script ran a 64-wide
    # model at batch 8 at stop 51: the op counts do not depend on the widths)
    guard, step = census_guard(precision)
    original = getattr(pipeline.StepPipeline, method)
    counts: collections.Counter[str] = collections.Counter()

    def counted(self: object, *args: object, **kwargs: object) -> object:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = original(self, *args, **kwargs)
        for event in prof.events():
            parent = event.cpu_parent
            if event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
                counts[event.name] += 1  # top-level ops only: a composite's own children are not counted twice
        return out

    setattr(pipeline.StepPipeline, method, counted)
    try:
        step()
    finally:
        setattr(pipeline.StepPipeline, method, original)
        guard.close()
    return counts


def main() -> None:
    for precision, method in (("bf16", "_through_unscaled"), ("fp16", "_through_decision")):
        counts = census(precision, method)
        kernels = {k: v for k, v in counts.items() if k not in VIEWS}
        print(f"{precision} {method}: {sum(counts.values())} top-level aten ops, {sum(kernels.values())} that launch "
              f"work on a device (12 parameters: the norms are 12 aten::dot here, one _foreach_norm on CUDA)")
        print("   " + ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in sorted(kernels.items(),
                                                                                    key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
