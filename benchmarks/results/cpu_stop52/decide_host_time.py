"""Stop 52: the CPU's host decision (``policies.decide_host``: one rank, the default configuration, a GradScaler),
microseconds a call, 2000 calls a round, min and median of 7 rounds. The tensor decision's kernel cut changed the
rule both executions share: this checks the host's side did not slow. Run in a worktree of the code before and in
this tree, on a quiet machine:
PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop52/decide_host_time.py"""

from __future__ import annotations

import math
import time

import torch

from ampguard.config import GuardConfig
from ampguard.policies import SpikeState, decide_host
from ampguard.scale_rule import ScalerView, ScaleState


def main() -> None:
    g = torch.tensor([[1.5, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, -1.0, math.nan, 0.0, 0.0]])
    config = GuardConfig()
    spikes = SpikeState.fresh(torch.device("cpu"))
    state = ScaleState(torch.zeros((), dtype=torch.int32))
    view = ScalerView(torch.tensor(65536.0), torch.tensor(0, dtype=torch.int32), 2.0, 0.5, 2000)
    rounds = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(2000):
            decide_host(g, config=config, spikes=spikes, scale_state=state, scaler=view, grads_sharded=False)
        rounds.append((time.perf_counter() - t) / 2000 * 1e6)
    print(f"decide_host: min {min(rounds):.2f} us, median {sorted(rounds)[3]:.2f} us a call")


if __name__ == "__main__":
    main()
