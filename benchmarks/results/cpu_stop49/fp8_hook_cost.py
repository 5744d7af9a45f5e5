"""Where the unsampled fp8 monitor's CPU wall time goes: the 48-layer float8 MLP of fp8_sampled_host.py, unmonitored,
monitored (unsampled), monitored with its forward hooks removed (the pre-forward hook's visits for the input and the
weight remain; no grad_output), and monitored with every hook removed (the taps in place, nothing taken). Paired
blocks of 20 steps, 30 rounds; the paired median of each arm minus the unmonitored one.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop49/fp8_hook_cost.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_sampled_host import model, paired

from ampguard.fp8 import Fp8Monitor

arms: dict[str, tuple] = {"plain": (model(), None, 1)}
for name, keep in (("monitored", None), ("pre-forward hook only", slice(0, None, 2)), ("no hooks", slice(0, 0))):
    m = model()
    monitor = Fp8Monitor(m, numerics_every=10)
    if keep is not None:
        kept = monitor._handles[keep]
        for handle in monitor._handles:
            if handle not in kept:
                handle.remove()
    arms[name] = (m, monitor, 1)
paired(arms, 30)
