"""Stop 52: the tensor decision cut to fewer kernels must decide the same bits. Dumps the decision vector, the new
growth tracker and every carried statistic of 3000 random decisions (tests/unit/test_host_decision.py's generators:
special values in any column, 1-8 ranks, every detector, ZClip, the headroom policy; 30 % with every detector off),
each on both executions (``decide`` on tensors, ``decide_host`` on host floats), and prints the dump's sha256. Run it
in a worktree of the code before and in this tree: the same hash is the same decisions.

    git worktree add /tmp/before 453fd82
    (cd /tmp/before && PYTHONPATH=$PWD OMP_NUM_THREADS=1 python $OLDPWD/benchmarks/results/cpu_stop52/same_decisions.py)
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop52/same_decisions.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import struct
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))  # the tree under test: its tests/ and ampguard/
from ampguard.policies import decide, decide_host
from tests.unit import test_host_decision as generators


def bits(x: float) -> str:
    return "nan" if math.isnan(x) else struct.pack("<f", x).hex()


def main() -> None:
    rows = []
    rng = random.Random(12345)
    for _ in range(3000):
        world = rng.choice([1, 1, 1, 2, 3, 8])
        g = torch.tensor([generators.rand_row(rng, p_bad=rng.choice([0.0, 0.2, 0.6])) for _ in range(world)],
                         dtype=torch.float32)
        config, carried = generators.rand_config(rng), generators.rand_carried(rng)
        if rng.random() < 0.3:  # every detector off: the constant flags the cut skips
            config = dataclasses.replace(config, spikes=dataclasses.replace(
                config.spikes, grad_factor=None, grad_zscore=None, loss_factor=None))
        sharded = world > 1 and rng.random() < 0.5
        for fn in (decide, decide_host):
            spikes, state, view = carried.tensors()
            vec, tracker = fn(g.clone(), config=config, spikes=spikes, scale_state=state, scaler=view,
                              grads_sharded=sharded)
            values = vec.tolist() if isinstance(vec, torch.Tensor) else vec
            row = [bits(v) for v in values] + [str(None if tracker is None else int(tracker))]
            row += [bits(getattr(spikes, n).item()) for n in generators.DETECTOR_FLOATS]
            row += [str(getattr(spikes, n).item()) for n in generators.DETECTOR_COUNTS]
            rows.append(" ".join([*row, str(state.overflow_run.item())]))
    text = "\n".join(rows)
    print(hashlib.sha256(text.encode()).hexdigest(), len(rows), "decisions")


if __name__ == "__main__":
    main()
