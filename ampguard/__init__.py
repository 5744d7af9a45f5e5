"""ampguard: numerical-stability middleware for mixed-precision PyTorch training.

Importing ampguard registers nothing and starts nothing: no hook, no thread, no server,
no global state. Everything happens in :func:`wrap` and the objects it returns.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import faults
from .config import GuardConfig
from .errors import (
    AmpGuardError,
    BackendUnavailableError,
    GuardStateError,
    NonFiniteError,
    RankDivergenceError,
)
from .exporters.base import Exporter, MultiExporter, NullExporter
from .guard import GuardedOptimizer, wrap
from .hardware import UnsupportedPrecisionError
from .report import Anomaly, History, RunInfo, StepReport

__all__ = [
    "AmpGuardError",
    "Anomaly",
    "BackendUnavailableError",
    "Exporter",
    "GuardConfig",
    "GuardStateError",
    "GuardedOptimizer",
    "History",
    "MultiExporter",
    "NonFiniteError",
    "NullExporter",
    "RankDivergenceError",
    "RunInfo",
    "StepReport",
    "UnsupportedPrecisionError",
    "__version__",
    "faults",
    "wrap",
]
