"""Backends: how the guard talks to other ranks and orders reduction, unscale and step.

Importing this package imports no distributed framework: Horovod and torch.distributed
backends are loaded only when selected.
"""

from __future__ import annotations

import torch

from .base import Backend, Collective, GatherHandle, LocalBackend, ReadyHandle

__all__ = ["Backend", "Collective", "GatherHandle", "LocalBackend", "ReadyHandle", "select_backend"]


def _is_horovod_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    # hvd.DistributedOptimizer builds a class on the fly from horovod.torch.optimizer's class
    # dict (so its __module__ is horovod's): detect it by name, without importing horovod.
    return str(getattr(type(optimizer), "__module__", "")).startswith("horovod")


def select_backend(optimizer: torch.optim.Optimizer) -> Backend:
    """The backend ``wrap()`` uses when none is given:

    - a Horovod ``DistributedOptimizer`` -> :class:`~ampguard.backends.horovod.HorovodBackend`;
    - an initialised torch.distributed with more than one rank ->
      :class:`~ampguard.backends.torch_dist.TorchDistBackend` over the default group;
    - else :class:`LocalBackend` (one process).
    """
    if _is_horovod_optimizer(optimizer):
        from .horovod import HorovodBackend

        return HorovodBackend()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from .torch_dist import TorchDistBackend

        return TorchDistBackend()
    return LocalBackend()
