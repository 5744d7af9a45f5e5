"""A pytest plugin (stop 59): cpu_stop55/forceplug.py (every non-fused guard on the CUDA path on the CPU) with the early
skip flag and the payload's landing on (AMPGUARD_EARLY_SKIP), their pinned buffers and external events stood in by
CPU tensors and a no-wait event; it counts the guards and the step graph's runs with them. Run from the repository root:
PYTHONPATH=$PWD:benchmarks/results/cpu_stop55:benchmarks/results/cpu_stop59 python -m pytest -p earlyplug
tests/frameworks/test_usage_patterns.py tests/unit/test_diagnosis_scenarios.py"""
from typing import Any

import forceplug  # noqa: F401
from standins import force_early

import ampguard

_wrap = ampguard.wrap
COUNT = [0]


def _early(*args: Any, **kwargs: Any) -> Any:
    opt = _wrap(*args, **kwargs)
    pipe = opt._pipeline
    if not pipe.fused:
        force_early(pipe)
        COUNT[0] += 1
    return opt


ampguard.wrap = _early
from ampguard.pipeline import StepPipeline  # noqa: E402

SLOTS = [0]
_land_last = StepPipeline._land_last


def _counted(self: Any) -> None:  # once a step graph run with the flag (the last run's landing filled first)
    SLOTS[0] += 1
    _land_last(self)


StepPipeline._land_last = _counted


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"earlyplug: {COUNT[0]} non-fused guards ran with the early flag; "
                                f"{SLOTS[0]} step graph runs with it")
