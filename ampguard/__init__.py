"""ampguard: numerical-stability middleware for mixed-precision PyTorch training.

Importing ampguard registers nothing and starts nothing: no hook, no thread, no server,
no global state. Everything happens in :func:`wrap` and the objects it returns.
"""

from __future__ import annotations

from . import faults
from ._version import __version__
from ._versions import IntegrationVersionError  # imports no framework
from .config import Escalation, GuardConfig, Spikes, ZClip
from .ema import EMA
from .errors import (
    AmpGuardError,
    BackendError,
    BackendUnavailableError,
    CheckpointError,
    GuardStateError,
    NonFiniteError,
    RankDivergenceError,
)
from .exporters.base import Exporter, MultiExporter, NullExporter
from .factory import wrap
from .fp8 import Fp8Monitor  # imports torchao only when a monitor is made
from .guard import GuardedOptimizer
from .hardware import UnsupportedPrecisionError
from .integrity import Verdict
from .preflight import Recommendation, preflight
from .records import Anomaly, Fp8Cast, History, RunInfo, StepReport

__all__ = [
    "AmpGuardError",
    "ConsoleExporter",
    "JsonlExporter",
    "MlflowExporter",
    "OtelExporter",
    "PortInUseError",
    "PrometheusExporter",
    "TensorBoardExporter",
    "WandbExporter",
    "Anomaly",
    "BackendError",
    "CheckpointError",
    "BackendUnavailableError",
    "EMA",
    "Fp8Cast",
    "Escalation",
    "Exporter",
    "Fp8Monitor",
    "GuardConfig",
    "GuardStateError",
    "GuardedOptimizer",
    "History",
    "IntegrationVersionError",
    "MultiExporter",
    "NonFiniteError",
    "NullExporter",
    "RankDivergenceError",
    "Recommendation",
    "RunInfo",
    "Spikes",
    "StepReport",
    "Verdict",
    "UnsupportedPrecisionError",
    "ZClip",
    "__version__",
    "faults",
    "preflight",
    "wrap",
]


# The exporters that import optional or heavy parts load on first use: ``import ampguard``
# imports no tensorboard, rich, wandb, mlflow or opentelemetry, and starts no server.
_LAZY = {"PrometheusExporter", "JsonlExporter", "TensorBoardExporter", "PortInUseError", "ConsoleExporter",
         "WandbExporter", "MlflowExporter", "OtelExporter"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from . import exporters

        return getattr(exporters, name)
    raise AttributeError(f"module 'ampguard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
