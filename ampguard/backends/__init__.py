"""Backends: how the guard talks to other ranks and orders reduction, unscale and step.

Importing this package imports no distributed framework: Horovod and torch.distributed
backends are loaded only when selected.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Collective, GatherHandle, LocalBackend, ReadyHandle

__all__ = ["Collective", "GatherHandle", "LocalBackend", "ReadyHandle", "select_backend"]


def select_backend(optimizer: torch.optim.Optimizer) -> Any:
    """The backend ``wrap()`` uses when none is given: one process (more come with the
    distributed backends)."""
    return LocalBackend()
