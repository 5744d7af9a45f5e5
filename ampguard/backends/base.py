"""The Backend protocol and the single-process backend.

A *backend* tells the guard how its world is laid out (rank, world size), moves the packed
per-step statistics between ranks (one all-gather per step) and knows how its framework
orders gradient synchronisation, unscaling and the optimizer step. ``LocalBackend`` is
the one-process case; ``torch_dist`` and ``horovod`` add the distributed ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["AttachedGuard", "Backend", "Collective", "GatherHandle", "LocalBackend", "ReadyHandle"]


class AttachedGuard(Protocol):
    """What a backend reads of the guard ``wrap()`` attaches it to (the ``GuardedOptimizer``)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def model(self) -> torch.nn.Module | None: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def precision(self) -> str: ...


@runtime_checkable
class GatherHandle(Protocol):
    """An all-gather in flight."""

    def wait(self) -> torch.Tensor:
        """The gathered ``[world_size, k]`` tensor, on the device of the input. On NCCL this only
        orders the current stream after the collective: it does not block the host."""


class ReadyHandle:
    """A handle whose result is already there (one process, or a blocking transport)."""

    __slots__ = ("_value",)

    def __init__(self, value: torch.Tensor) -> None:
        self._value = value

    def wait(self) -> torch.Tensor:
        return self._value


@runtime_checkable
class Backend(Protocol):
    """Everything the guard asks of its backend. ``LocalBackend`` implements it for one process;
    ``TorchDistBackend`` and ``HorovodBackend`` derive from it.

    The transport methods (``all_gather``, ``broadcast_object``, ``all_gather_object``) are
    collectives: every rank calls them, in the same order. The hooks put the framework's gradient
    reduction in the right place relative to unscaling and stepping.
    """

    name: str
    rank: int
    local_rank: int
    world_size: int
    grads_sharded: bool
    """True when each rank holds a shard of every gradient (FSDP): the global norm is then the
    square root of the *sum* over ranks of the local sums of squares."""

    def all_gather(self, vec: torch.Tensor) -> GatherHandle:
        """Start gathering a 1-D float tensor of the same length ``k`` from every rank."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from ``src`` to every rank (set-up time only: blocks)."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (forensics on non-finite steps only: blocks)."""

    def attach(self, guard: AttachedGuard) -> None:
        """Called once by ``wrap()`` with the guard (reads ``guard.optimizer``, ``guard.model``,
        ``guard.device``, ``guard.precision``), to install what attribution needs."""

    def before_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Finish the gradient reduction before the gradients are read (Horovod: synchronize())."""

    def step_context(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
        """Wraps the inner optimizer's step (Horovod: skip_synchronize())."""

    def pre_reduction_flags(self) -> torch.Tensor | None:
        """A device scalar: 1.0 when this rank's own gradient contribution held a non-finite value
        before it was reduced (None: not observed by this backend)."""

    def reset_pre_reduction(self) -> None:
        """Clear what ``pre_reduction_flags`` accumulated (called after each step)."""

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        """Clear the gradients (Horovod: also its pending-handle bookkeeping)."""

    def close(self) -> None:
        """Remove what :meth:`attach` installed. Idempotent."""


#: Deprecated name of :class:`Backend` (``wrap(collective=...)`` is now ``wrap(backend=...)``);
#: kept for one release.
Collective = Backend


class LocalBackend:
    """One process: the gather is the identity, and nothing needs synchronising.

    Subclasses override the hooks below to put their framework's gradient reduction in the
    right place relative to unscaling and stepping.
    """

    name = "local"
    rank = 0
    local_rank = 0
    world_size = 1
    #: True when each rank holds a shard of every gradient (FSDP): the global norm is then
    #: the square root of the *sum* over ranks of the local sums of squares.
    grads_sharded = False

    def all_gather(self, vec: torch.Tensor) -> GatherHandle:
        return ReadyHandle(vec.unsqueeze(0))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (set-up and forensics only: blocks)."""
        return [obj]

    def attach(self, guard: AttachedGuard) -> None:
        """Called once by ``wrap()`` with the guard (to install hooks that count non-finite
        gradients before reduction, for attribution)."""

    def before_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Finish the gradient reduction before the gradients are read (Horovod: synchronize())."""

    @contextlib.contextmanager
    def step_context(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Wraps the inner optimizer's step (Horovod: skip_synchronize())."""
        yield

    def pre_reduction_flags(self) -> torch.Tensor | None:
        """A device scalar: 1.0 when this rank's own gradient contribution held a non-finite value
        before it was reduced with the other ranks' (None: not observed by this backend)."""
        return None

    def reset_pre_reduction(self) -> None:
        """Clear what ``pre_reduction_flags`` accumulated (called after each step)."""

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Remove hooks installed by :meth:`attach`."""


