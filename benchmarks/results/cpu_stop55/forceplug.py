"""A pytest plugin (stop 55): every guard wrapping a non-fused optimizer takes the CUDA path on the CPU (the tensor
decision, the fast path with a GradScaler, reports lagged). Run: PYTHONPATH=$PWD:benchmarks/results/cpu_stop55
python -m pytest -p forceplug tests/frameworks/test_usage_patterns.py"""

from typing import Any

import ampguard

_wrap = ampguard.wrap


def _forced(*args: Any, **kwargs: Any) -> Any:
    opt = _wrap(*args, **kwargs)
    pipe = opt._pipeline
    if not pipe.fused:
        pipe.host_decision, pipe.norms_first, pipe.unfused_fast = False, False, pipe.adapter is not None
        opt._lagged_reports = True
    return opt


ampguard.wrap = _forced
