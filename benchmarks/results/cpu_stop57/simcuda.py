"""The CUDA host path on the CPU (stop 57): a guard wrapping a non-fused optimizer takes the CUDA path (the tensor
decision on the fast path, reports lagged: as cpu_stop55/forceplug.py), and every step graph "replays" by handing
back its first run's outputs with no kernel (a capture runs ``fn`` once; a replay does nothing). What the guard's
step then costs the host is its Python and its launches outside the graph: the part of issue 26's host time a CPU
can show. The values are stale after the first run (a replay computes nothing): time it, do not test with it.

    PYTHONPATH=$PWD:benchmarks/results/cpu_stop57 python -c "import simcuda; simcuda.main()" --device cpu \
        --models mlp --optims foreach --blocks 4 --steps 30 --step-graph
"""

import runpy
import sys
from pathlib import Path
from typing import Any

import ampguard
from ampguard.decision_graph import MeasureGraph

_wrap = ampguard.wrap


def _forced(*args: Any, **kwargs: Any) -> Any:
    opt = _wrap(*args, **kwargs)
    pipe = opt._pipeline
    if not pipe.fused:
        pipe.host_decision, pipe.norms_first, pipe.unfused_fast = False, False, pipe.adapter is not None
        opt._lagged_reports = True
    return opt


class _Replay:
    def replay(self) -> None:
        pass


def _capture(self: MeasureGraph, fn: Any, device: Any) -> tuple[Any, Any]:
    return _Replay(), fn()


def _run_fixed(self: MeasureGraph, kind: Any, fn: Any, grads: Any, scale: Any = None) -> Any:
    """MeasureGraph.run with the gradients' count for their addresses in the key: the CPU allocator gives each
    step's gradients new addresses, where CUDA's caching allocator gives the same back (each address read cost
    ~0.1 us a gradient here, left out)."""
    key = (kind, grads[0].dtype, 0 if scale is None else scale.data_ptr(), len(grads))
    self.credit = min(self.credit + self.CREDIT_PER_RUN, float(self.MAX_CAPTURES))
    hit = self._graphs.get(key)
    if hit is not None:
        self._graphs.move_to_end(key)
        hit[0].replay()
        self.replays += 1
        self.misses = 0
        return hit[1]
    if key not in self._seen:
        self.misses += 1
        self._seen[key] = None
        return fn()
    graph, out = _capture(self, fn, None)
    self.captures += 1
    self._graphs[key] = (graph, out)
    self.replays += 1
    self.misses = 0
    return out


ampguard.wrap = _forced
MeasureGraph.capturable = staticmethod(lambda device: True)  # type: ignore[method-assign]
MeasureGraph._capture = _capture  # type: ignore[method-assign]
MeasureGraph.run = _run_fixed  # type: ignore[method-assign]


def main() -> None:
    script = Path(__file__).resolve().parents[2] / "host_time.py"
    sys.argv = [str(script), *sys.argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
