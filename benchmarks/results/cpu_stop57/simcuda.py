"""The CUDA host path on the CPU (stop 57): a guard wrapping a non-fused optimizer takes the CUDA path (the tensor
decision on the fast path, reports lagged: cpu_stop55/forceplug.py, imported), and every step graph "replays" by
handing back its first run's outputs with no kernel (a capture runs ``fn`` once; a replay does nothing). What the
guard's step then costs the host is its Python and its launches outside the graph: the part of issue 26's host time
a CPU can show. The values are stale after the first run (a replay computes nothing): time it, do not test with it.

    PYTHONPATH=$PWD:benchmarks/results/cpu_stop57 python -c "import simcuda; simcuda.main()" --device cpu \
        --models mlp --optims foreach --blocks 4 --steps 30 --step-graph
"""

import runpy
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu_stop55"))
import forceplug  # noqa: F401  (its ampguard.wrap: a non-fused optimizer takes the CUDA path)

from ampguard.decision_graph import MeasureGraph


class _Replay:
    def replay(self) -> None:
        pass


def _capture(self: MeasureGraph, fn: Any, device: Any) -> tuple[Any, Any]:
    return _Replay(), fn()


_run = MeasureGraph.run
_STAND_INS: dict[tuple[Any, ...], list[torch.Tensor]] = {}


def _run_kept(self: MeasureGraph, kind: Any, fn: Any, grads: Any, scale: Any = None) -> Any:
    """MeasureGraph.run keyed by kept stand-ins of the gradients (a one-float tensor each, of their dtype and
    device, the same objects every step): the CPU allocator gives each step's gradients new addresses, where CUDA's
    caching allocator gives the same back. ``fn`` reads the gradients themselves (its closure), not the stand-ins."""
    key = (len(grads), grads[0].dtype, grads[0].device)
    stand_ins = _STAND_INS.get(key)
    if stand_ins is None:
        stand_ins = _STAND_INS[key] = [torch.zeros(1, dtype=key[1], device=key[2]) for _ in grads]
    return _run(self, kind, fn, stand_ins, scale)


MeasureGraph.capturable = staticmethod(lambda device: True)  # type: ignore[method-assign]
MeasureGraph._capture = _capture  # type: ignore[method-assign]
MeasureGraph.run = _run_kept  # type: ignore[method-assign]


def main() -> None:
    script = Path(__file__).resolve().parents[2] / "host_time.py"
    sys.argv = [str(script), *sys.argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
