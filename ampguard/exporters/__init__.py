"""Exporters: where the guard's reports go.

``Exporter`` (the protocol), ``MultiExporter`` and ``NullExporter`` live in :mod:`.base`.
The backends (``PrometheusExporter``, ``JsonlExporter``, ``TensorBoardExporter``) are loaded
on first use, so ``import ampguard`` imports neither tensorboard nor starts anything.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import Exporter, MultiExporter, NullExporter

if TYPE_CHECKING:
    from .console import ConsoleExporter
    from .jsonl import JsonlExporter
    from .prometheus import PortInUseError, PrometheusExporter
    from .tensorboard import TensorBoardExporter

__all__ = [
    "ConsoleExporter",
    "Exporter",
    "JsonlExporter",
    "MultiExporter",
    "NullExporter",
    "PortInUseError",
    "PrometheusExporter",
    "TensorBoardExporter",
]

_LAZY = {
    "ConsoleExporter": ".console",
    "PrometheusExporter": ".prometheus",
    "PortInUseError": ".prometheus",
    "JsonlExporter": ".jsonl",
    "TensorBoardExporter": ".tensorboard",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
