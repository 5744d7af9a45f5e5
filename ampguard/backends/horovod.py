"""Horovod backend (``horovod.torch``), for ``hvd.DistributedOptimizer``.

The order it enforces, every step::

    opt.synchronize()                 # before_unscale: finish Horovod's gradient all-reduce
    scaler.unscale_(opt)              # the guard: unscale, check, agree (one allgather)
    with opt.skip_synchronize():      # step_context: the all-reduce is done, don't redo it
        scaler.step(opt)              #   (or skip, on every rank alike)
    scaler.update(...)

(The common recipe's ``hvd.allreduce_gradients`` does not exist; the guard does the above.)

- ``backward_passes_per_step=N``: Horovod's optimizer counts the backward passes and starts
  the all-reduce on the N-th; the guard calls ``backward()`` N times and ``step()`` once.
- ``compression=hvd.Compression.fp16`` works; with a bf16 model or ``precision="bf16"`` the
  guard warns (fp16's range is far below bf16's: compressed gradients overflow).
- ``op=hvd.Adasum`` is refused: its optimizer applies the update inside backward (the
  all-reduce is of the parameter *deltas*), where no loss scaler can skip a step.
- Pre-reduction attribution: the optimizer's ``_compression`` is wrapped so that each
  compressed gradient is checked (on device, no host sync) before it is all-reduced.

Importing this module imports horovod; ``import ampguard`` does not.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import BackendError, BackendUnavailableError
from .base import AttachedGuard, GatherHandle, LocalBackend

__all__ = ["HorovodBackend", "broadcast_guard_state"]


def _hvd() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise BackendUnavailableError(
            "the Horovod backend needs horovod with PyTorch support: pip install 'ampguard[horovod]' "
            f"(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 to build it); import failed with: {e}"
        ) from e
    return hvd


class _HvdHandle:
    __slots__ = ("_handle", "_hvd", "_out")

    def __init__(self, hvd: Any, handle: Any) -> None:
        self._hvd, self._handle, self._out = hvd, handle, None

    def wait(self) -> torch.Tensor:
        if self._out is None:
            self._out = self._hvd.synchronize(self._handle)
        return self._out  # type: ignore[return-value]


class _FlaggingCompression:
    """Delegates to Horovod's compressor; records a non-finite value in what is about to be
    all-reduced (this rank's own contribution), after compression, so an fp16-compression
    overflow is attributed too."""

    def __init__(self, inner: Any, flag: torch.Tensor) -> None:
        self.inner = inner
        self.flag = flag

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        compressed, ctx = self.inner.compress(tensor)
        if compressed.is_floating_point():
            from .torch_dist import _nonfinite_into  # a float32 sum: NaN/inf propagate, one read

            _nonfinite_into(self.flag, compressed)
        return compressed, ctx

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.inner.decompress(tensor, ctx)


def _is_adasum(optimizer: torch.optim.Optimizer) -> bool:
    try:
        from horovod.torch.optimizer import _DistributedAdasumOptimizer
    except ImportError:  # pragma: no cover - layout changed
        return False
    # DistributedOptimizer copies the class dict into a new class; step() gets re-wrapped by torch's
    # profiling hook, so compare a method that is not.
    name = "_allreduce_grad_async"
    return type(optimizer).__dict__.get(name) is _DistributedAdasumOptimizer.__dict__.get(name)


class HorovodBackend(LocalBackend):
    """The guard's collective over Horovod (``hvd.init()`` must have been called).

    Chosen automatically by ``wrap()`` for a ``hvd.DistributedOptimizer``. Every method that
    talks to other ranks is a collective: every rank must call it, in the same order.
    """

    name = "horovod"

    def __init__(self) -> None:
        hvd = _hvd()
        try:
            self.rank = int(hvd.rank())
            self.local_rank = int(hvd.local_rank())
            self.world_size = int(hvd.size())
        except ValueError as e:  # horovod's "not initialized" error
            raise BackendError(f"HorovodBackend needs hvd.init() to have been called first ({e})") from e
        self._hvd = hvd
        self._calls = 0
        self._flag: torch.Tensor | None = None
        self._optimizer: Any = None
        self._original_compression: Any = None

    # ------------------------------------------------------------------ collectives
    def all_gather(self, vec: torch.Tensor) -> GatherHandle:
        """Start gathering ``vec`` into ``[world_size, k]`` (``hvd.allgather_async``). collective."""
        self._calls += 1
        handle = self._hvd.allgather_async(vec.unsqueeze(0), name=f"ampguard.gather.{self._calls}")
        return _HvdHandle(self._hvd, handle)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``hvd.broadcast_object`` from ``src``. collective; blocks."""
        self._calls += 1
        return self._hvd.broadcast_object(obj, root_rank=src, name=f"ampguard.bcast.{self._calls}")

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (forensics findings; non-finite steps only). collective; blocks."""
        self._calls += 1
        return list(self._hvd.allgather_object(obj, name=f"ampguard.gather.{self._calls}"))

    # ------------------------------------------------------------------ ordering
    def attach(self, guard: AttachedGuard) -> None:
        opt: Any = guard.optimizer  # a hvd.DistributedOptimizer: checked below
        if _is_adasum(opt):
            raise ValueError(
                "hvd.DistributedOptimizer(op=hvd.Adasum) cannot be guarded: Adasum applies the update "
                "inside backward (it all-reduces parameter deltas), where no loss scaler can skip a step. "
                "Use op=hvd.Average (the default) or hvd.Sum."
            )
        if not (hasattr(opt, "synchronize") and hasattr(opt, "skip_synchronize") and hasattr(opt, "_compression")):
            raise TypeError(
                f"HorovodBackend guards a hvd.DistributedOptimizer; got {type(opt).__name__}. "
                "Wrap it first: opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())"
            )
        compression = opt._compression
        from horovod.torch.compression import Compression

        params = [p for group in opt.param_groups for p in group["params"]]
        if compression is Compression.fp16 and (
            guard.precision == "bf16" or any(p.dtype == torch.bfloat16 for p in params)
        ):
            warnings.warn(
                "hvd.Compression.fp16 with a bf16 model: gradients are all-reduced in fp16, whose range "
                "(max 65504) is far below bf16's, so large gradients overflow to inf (and the guard skips "
                "those steps). Use Compression.none, or precision='fp16' with loss scaling.",
                stacklevel=3,
            )
        self._flag = torch.zeros((), dtype=torch.float32, device=guard.device)
        self._optimizer = opt
        self._original_compression = compression
        opt._compression = _FlaggingCompression(compression, self._flag)

    def before_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.synchronize()  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def step_context(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            yield

    def pre_reduction_flags(self) -> torch.Tensor | None:
        return self._flag

    def reset_pre_reduction(self) -> None:
        if self._flag is not None:
            self._flag.zero_()

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        # Horovod's zero_grad() takes no set_to_none; it only adds a check that no all-reduce is
        # in flight. Keep the check, then clear as torch does.
        if getattr(optimizer, "_handles", None):
            optimizer.zero_grad()  # raises Horovod's own explanation
        torch.optim.Optimizer.zero_grad(optimizer, set_to_none=set_to_none)

    def close(self) -> None:
        if self._optimizer is not None:
            self._optimizer._compression = self._original_compression
            self._optimizer = None


def broadcast_guard_state(opt: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s guard state: inner optimizer, loss scale and growth
    tracker, step and skip counts, running averages (``opt.state_dict()``). Call it after
    ``wrap()`` when resuming (load the checkpoint on ``root_rank``) or after an elastic reset,
    so every rank starts with the same scale.

    collective: every rank must call it; blocks (pickles the state through Horovod).
    """
    hvd = _hvd()
    state = opt.state_dict() if hvd.rank() == root_rank else None
    state = hvd.broadcast_object(state, root_rank=root_rank, name="ampguard.guard_state")
    if hvd.rank() != root_rank:
        opt.load_state_dict(state)
