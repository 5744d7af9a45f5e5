"""What the grad_output casts taken through the taps (by each layer's ``linear_mm_config``, no gradient hook) save
on this CPU against the gradient hook on each layer's output that told the monitor whose grad_output a cast was
(stop 49's way, kept for layers the taps cannot tell apart): the 48-layer float8 MLP of
``cpu_stop49/fp8_sampled_host.py`` (144 casts), unmonitored, monitored with gradient hooks (the monitor disowned
from the taps: what every eager step did before), monitored through the taps; unsampled steps, paired blocks of 20
steps in rotated order; the paired median of each arm minus the unmonitored one.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop50/fp8_grad_taps_cost.py [ROUNDS]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu_stop49"))
from fp8_sampled_host import model, paired

from ampguard.fp8 import _TAPS, Fp8Monitor

arms: dict[str, tuple] = {"plain": (model(), None, 1)}
for name, owned in (("gradient hooks", False), ("taps", True)):
    m = model()
    monitor = Fp8Monitor(m, numerics_every=10)
    assert all(monitor._owned)
    if not owned:  # as before: no layer registered with the taps, a gradient hook on each output
        _TAPS.disown(monitor)
        monitor._owned = [False] * len(monitor.modules)
    arms[name] = (m, monitor, 1)
paired(arms, int(sys.argv[1]) if len(sys.argv) > 1 else 30)
