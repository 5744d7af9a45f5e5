"""Where the unsampled fp8 monitor's CPU wall time goes after the grad_output taps (stop 50): the 48-layer float8 MLP
of ``cpu_stop49/fp8_sampled_host.py`` (144 casts), unmonitored; monitored; without ``collect()`` (a constant row in
its place); without taking (``_took`` a no-op: the hooks, the visits and the taps' dispatch remain); without the
module hooks too (the taps on every cast, the grad_output ones taken and dropped). Paired blocks of 20 unsampled steps
in rotated order; the paired median of each arm minus the unmonitored one.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop50/fp8_attrib.py [ROUNDS]
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu_stop49"))
from fp8_sampled_host import model, paired

from ampguard.fp8 import Fp8Monitor


def arm(took: bool = True, hooks: bool = True, collect: bool = True) -> tuple:
    m = model()
    monitor = Fp8Monitor(m, numerics_every=10)
    if not took:
        monitor._took = lambda *a, **k: None  # type: ignore[method-assign]
    if not hooks:
        for handle in monitor._handles:
            handle.remove()
    if not collect:
        device = next(m.parameters()).device
        monitor.collect = types.MethodType(  # type: ignore[method-assign]
            lambda self: self._const(device, ("constant row",), [0.0] * 5).reshape(1, 5), monitor)
    return (m, monitor, 1)


arms = {"plain": (model(), None, 1), "monitored": arm(), "no collect": arm(collect=False),
        "no take, no collect": arm(took=False, collect=False),
        "no hooks, no take, no collect": arm(took=False, hooks=False, collect=False)}
paired(arms, int(sys.argv[1]) if len(sys.argv) > 1 else 40)
