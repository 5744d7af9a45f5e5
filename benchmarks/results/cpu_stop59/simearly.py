"""Stop 59: the early flag's host path on the CPU, beside the default step graph's (cpu_stop57/simcuda.py's CUDA host
path: the tensor decision, the step graph "replayed" with no kernel), the early flag's pinned buffers and external
events replaced by CPU tensors and a stand-in event (no wait: on the CPU nothing is on its way). What it shows is the
Python and the launches each arm adds on the host, not a wait. Run from the repository root:

    PYTHONPATH=$PWD:benchmarks/results/cpu_stop57 OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop59/simearly.py \
        --device cpu --models mlp --optims foreach --blocks 6 --steps 30 --step-graph --early-arm --clock thread
"""

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu_stop57"))
import simcuda
from standins import force_early

from ampguard.pipeline import StepPipeline

_init = StepPipeline.__init__


def _init_early(self: StepPipeline, **kwargs: Any) -> None:
    _init(self, **kwargs)
    if os.environ.get("AMPGUARD_EARLY_SKIP") == "1" and not self.fused:  # CUDA's early flag, on the CPU
        force_early(self)


StepPipeline.__init__ = _init_early  # type: ignore[method-assign]

if __name__ == "__main__":
    simcuda.main()
