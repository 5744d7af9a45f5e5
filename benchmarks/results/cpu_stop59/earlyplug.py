"""A pytest plugin (stop 59): cpu_stop55/forceplug.py (every non-fused guard on the CUDA path on the CPU) with the early
skip flag and the payload's landing on (AMPGUARD_EARLY_SKIP), their pinned buffers and external events stood in by
CPU tensors and a no-wait event; it counts the guards and the step graph's runs with them. Run from the repository root:
PYTHONPATH=$PWD:benchmarks/results/cpu_stop55:benchmarks/results/cpu_stop59 python -m pytest -p earlyplug
tests/frameworks/test_usage_patterns.py tests/unit/test_diagnosis_scenarios.py"""
from typing import Any

import forceplug  # noqa: F401
import torch

import ampguard


class _Event:
    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_wrap = ampguard.wrap
COUNT = [0]


def _early(*args: Any, **kwargs: Any) -> Any:
    opt = _wrap(*args, **kwargs)
    pipe = opt._pipeline
    if not pipe.fused:
        pipe.early_skip, pipe._early = True, (torch.zeros(1, dtype=torch.bool), _Event())
        pipe._new_slot = lambda size: (torch.zeros(size), _Event())
        COUNT[0] += 1
    return opt


ampguard.wrap = _early
from ampguard.pipeline import StepPipeline  # noqa: E402

SLOTS = [0]
_slot = StepPipeline._landing_slot


def _counted(self: Any, groups: Any) -> Any:
    SLOTS[0] += 1
    return _slot(self, groups)


StepPipeline._landing_slot = _counted


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"earlyplug: {COUNT[0]} non-fused guards ran with the early flag; "
                                f"{SLOTS[0]} step graph runs with it")
