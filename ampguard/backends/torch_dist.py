"""torch.distributed backend: DDP, FSDP2 (``fully_shard``) and plain process groups.

- One all-gather per step (``all_gather_into_tensor``, ``async_op=True``): on NCCL the
  handle's ``wait()`` only orders the current stream after the collective (no host sync);
  on gloo it blocks, as every CPU op does.
- Pre-reduction attribution (which rank's *own* gradients were non-finite before they were
  averaged with the others'): a DDP communication hook that looks at each bucket before
  delegating to the all-reduce, or, where no hook can be installed (FSDP2, a DDP model whose
  user hook was not composed, no model given), per-parameter tensor hooks. Both keep a device
  flag with ``torch.maximum``: no host sync.

DDP allows one ``register_comm_hook`` call per model. If you register a hook of your own, build
it with :func:`compose_comm_hook` so the guard's check runs first and your hook does the
reduction::

    ddp.register_comm_hook(state, ampguard.backends.torch_dist.compose_comm_hook(my_hook))
    opt = ampguard.wrap(opt, model=ddp)   # finds the composed hook and reads its flag
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..errors import BackendError
from ..module_hooks import Hook
from .base import AttachedGuard, GatherHandle, LocalBackend

__all__ = ["FlaggingCommHook", "Replicas", "TorchDistBackend", "compose_comm_hook"]


# torch >= 2.10 names it all_gather_single (all_gather_into_tensor warns there); older: the latter.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _WorkHandle:
    """An all-gather in flight on a torch.distributed ``Work``."""

    __slots__ = ("_out", "_work")

    def __init__(self, work: Any, out: torch.Tensor) -> None:
        self._work, self._out = work, out

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()  # NCCL: a stream wait, not a host wait
            self._work = None
        return self._out


def _nonfinite_into(flag: torch.Tensor, t: torch.Tensor) -> None:
    """flag = max(flag, any non-finite in t), on device, without reading anything back.

    A float32 sum propagates NaN/inf and is one streaming read with no temporary (cheaper than
    ``isfinite(t).all()``, which materialises a mask); finite values whose
    sum exceeds float32's range (~3e38) would also flag, a case the norms flag anyway."""
    total = torch.sum(t, dtype=torch.float32) if t.is_floating_point() else torch.zeros((), device=t.device)
    bad = torch.logical_not(torch.isfinite(total)).to(device=flag.device, dtype=flag.dtype, non_blocking=True)
    torch.maximum(flag, bad, out=flag)


class FlaggingCommHook:
    """A DDP communication hook that records whether this rank's bucket held a NaN/inf *before*
    the reduction, then delegates to ``user_hook`` (or to DDP's default all-reduce).

    Build it with :func:`compose_comm_hook`; the guard finds it on the DDP model and reads
    :attr:`flag`. Costs one float32 sum per bucket (a read of it); no host sync.
    """

    def __init__(self, user_hook: Callable[[Any, Any], Any] | None = None) -> None:
        self.user_hook = user_hook
        self.flag: torch.Tensor | None = None

    def __call__(self, state: Any, bucket: Any) -> Any:
        buf = bucket.buffer()
        if self.flag is None or self.flag.device != buf.device:
            self.flag = torch.zeros((), dtype=torch.float32, device=buf.device)
        _nonfinite_into(self.flag, buf)
        if self.user_hook is not None:
            return self.user_hook(state, bucket)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state, bucket)

    def reset(self) -> None:
        if self.flag is not None:
            self.flag.zero_()


def compose_comm_hook(user_hook: Callable[[Any, Any], Any] | None = None) -> Callable[[Any, Any], Any]:
    """A DDP comm hook that runs the guard's pre-reduction check, then ``user_hook(state, bucket)``
    (DDP's default all-reduce when None). Register it with ``ddp.register_comm_hook(state, hook)``
    *before* ``ampguard.wrap()``; with no user hook, ``wrap()`` registers one itself.

    The returned function carries its :class:`FlaggingCommHook` as ``hook.ampguard_check``."""
    check = FlaggingCommHook(user_hook)

    # No annotations: DDP compares them with dist.GradBucket, and a plain function (not a
    # callable object) because DDP reads hook.__name__.
    def ampguard_comm_hook(state, bucket):  # type: ignore[no-untyped-def]
        return check(state, bucket)

    ampguard_comm_hook.ampguard_check = check  # type: ignore[attr-defined]
    return ampguard_comm_hook


def _is_ddp(model: Any) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _is_sharded_fsdp1(model: Any) -> bool:
    """FSDP1 (FullyShardedDataParallel) with a sharding strategy: each rank holds a shard of the
    flat gradients (use ShardedGradScaler with it)."""
    if model is None:
        return False
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    except ImportError:  # pragma: no cover
        return False
    for m in model.modules():
        if isinstance(m, FullyShardedDataParallel):
            return getattr(m, "sharding_strategy", None) != ShardingStrategy.NO_SHARD
    return False


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - very old torch
        return False
    return isinstance(t, DTensor)


def _replication(params: Sequence[Any]) -> int:
    """The number of ranks holding the same shard of the first DTensor parameter: the product of its mesh's sizes
    along its ``Replicate`` dimensions (HSDP: the replicate dimension; FSDP2: 1)."""
    for p in params:
        if _is_dtensor(p):
            mesh = p.device_mesh
            n = 1
            for dim, placement in enumerate(p.placements):
                if placement.is_replicate():
                    n *= mesh.size(dim)
            return n
    return 1


class Replicas(NamedTuple):
    """What :meth:`TorchDistBackend.replicas` finds: where the replicas of one shard live (HSDP)."""

    backend: TorchDistBackend
    """The guard's collectives over the replicate dimension's process group."""
    members: tuple[int, ...]
    """The replicated parameters (indices into the guard's parameter list)."""
    ranks: tuple[int, ...]
    """The global rank of each rank of that group, by group rank."""


class TorchDistBackend(LocalBackend):
    """The guard's collective over a torch.distributed process group (NCCL, Gloo, ...).

    - ``group``: the process group whose ranks take the decision together (default: the world).
    - ``pre_reduction``: observe each rank's own gradients before they are reduced, for
      ``StepReport.nonfinite_ranks`` (DDP: a comm hook, which replaces DDP's built-in C++
      all-reduce by the same all-reduce called from Python, plus one float32 sum per bucket;
      FSDP: post-accumulate-grad hooks). ``False`` leaves DDP's reducer untouched; attribution
      then rests on the losses and on which ranks' reduced gradients were non-finite.

    - ``gather``: how the per-step vectors travel. "all_gather" (one hop per rank in a ring:
      latency grows linearly with the world size); "all_reduce" (each rank writes its row of a
      zeroed ``[world, k]`` matrix and a sum all-reduce assembles it: the same matrix, bit for
      bit, in O(log world) hops where the transport uses a tree, e.g. NCCL); "auto" (the
      default): all_reduce above ``ALL_REDUCE_ABOVE`` ranks. ``benchmarks/scaling.py`` has the
      model behind the threshold.

    ``torch.distributed`` must be initialised before this is built. Every method that talks
    to other ranks is a collective: every rank of ``group`` must call it, in the same order.
    """

    name = "torch.distributed"
    #: World size above which ``gather="auto"`` assembles the matrix with an all-reduce.
    ALL_REDUCE_ABOVE = 64

    def __init__(self, group: Any = None, *, pre_reduction: bool = True, gather: str = "auto") -> None:
        if gather not in ("auto", "all_gather", "all_reduce"):
            raise ValueError(f"TorchDistBackend gather={gather!r}; allowed: 'auto' | 'all_gather' | 'all_reduce'")
        if not (dist.is_available() and dist.is_initialized()):
            raise BackendError(
                "TorchDistBackend needs an initialised torch.distributed: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        local = os.environ.get("LOCAL_RANK")
        if local is not None:
            self.local_rank = int(local)
        else:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or (
                torch.cuda.device_count() if torch.cuda.is_available() else 0
            )
            self.local_rank = self.rank % local_world if local_world else self.rank
        self.grads_sharded = False
        self.gather = gather if gather != "auto" else (
            "all_reduce" if self.world_size > self.ALL_REDUCE_ABOVE else "all_gather")
        self._want_pre_reduction = pre_reduction
        self._flag: torch.Tensor | None = None
        self._comm_hook: FlaggingCommHook | None = None
        self._handles: list[Any] = []
        self.grad_replicas = 1
        """How many ranks hold each gradient shard (HSDP: the replicate dimension's size; else 1). The global norm
        of sharded gradients adds every rank's sum of squares: each rank's share is its norm over sqrt of this."""
        self._replicas: dict[tuple[int, int], Replicas] = {}
        """HSDP's replicate groups by (mesh, dimension): :meth:`replicas`, made once."""

    # ------------------------------------------------------------------ collectives
    def all_gather(self, vec: torch.Tensor) -> GatherHandle:
        """Start gathering ``vec`` (1-D, same length on every rank) into ``[world_size, k]``.
        collective: every rank must call it."""
        vec = vec.contiguous()
        if self.gather == "all_reduce":
            # x + 0 == x exactly (NaN and inf included): the summed matrix is the gathered one.
            out = vec.new_zeros(self.world_size, vec.numel())
            out[self.rank].copy_(vec)
            work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            return _WorkHandle(work, out)
        out = vec.new_empty(self.world_size * vec.numel())  # flat: gloo insists, NCCL accepts
        work = _all_gather_single(out, vec, group=self.group, async_op=True)
        return _WorkHandle(work, out.view(self.world_size, vec.numel()))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from group rank ``src`` to every rank. collective; blocks."""
        box = [obj if self.rank == src else None]
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        dist.broadcast_object_list(box, src=global_src, group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every group rank's ``obj``, in rank order (forensics findings; non-finite steps only).
        collective; blocks."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # ------------------------------------------------------------------ hooks
    def attach(self, guard: AttachedGuard) -> None:
        """Detect sharded gradients (FSDP2) and install the pre-reduction check."""
        params = [p for group in guard.optimizer.param_groups for p in group["params"]]
        self.grads_sharded = any(_is_dtensor(p) for p in params) or _is_sharded_fsdp1(guard.model)
        self.grad_replicas = _replication(params)
        device = guard.device
        self._flag = torch.zeros((), dtype=torch.float32, device=device)
        if not self._want_pre_reduction:
            return
        model: Any = guard.model  # DDP, FSDP or a plain module: told apart below
        if _is_ddp(model):
            hook = _find_comm_hook(model)
            if hook is None and not getattr(model, "_comm_hooks", None):
                composed = compose_comm_hook()
                # state = DDP's own process group: the default all-reduce then reduces over it
                model.register_comm_hook(getattr(model, "process_group", None), composed)
                hook = composed.ampguard_check  # type: ignore[attr-defined]
            if hook is not None:
                self._comm_hook = hook
                return
            warnings.warn(
                "the DDP model already has a communication hook that was not built with "
                "ampguard.backends.torch_dist.compose_comm_hook(); pre-reduction attribution falls back to "
                "per-parameter tensor hooks (one extra read of the gradients per backward).",
                stacklevel=3,
            )
        self._install_tensor_hooks(model, params)

    def _install_tensor_hooks(self, model: Any, params: list[torch.Tensor]) -> None:
        flag = self._flag
        assert flag is not None  # internal: set in attach

        # Post-accumulate-grad hooks: they run after every tensor hook on the parameter (so they see
        # what those hooks made of the gradient) and before the AccumulateGrad node's post hooks,
        # where DDP and FSDP1 start the reduction.
        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is not None:
                _nonfinite_into(flag, g.to_local() if _is_dtensor(g) else g)  # type: ignore[attr-defined]

        if model is not None and any(_is_dtensor(p) for p in params):
            # FSDP2: the sharded DTensor parameters get their gradients from the reduce-scatter,
            # not from autograd. The unsharded parameters that forward uses are in the graph: a
            # hook on them sees this rank's own gradient before the reduce-scatter. They exist
            # after the first all-gather, so hooks are added after each FSDP module's forward
            # (a set lookup once they are in place).
            hooked: set[int] = set()

            def after_forward(module: torch.nn.Module, args: Any, out: Any) -> None:
                for fp in _fsdp_params(module):
                    unsharded = getattr(fp, "_unsharded_param", None)
                    if unsharded is not None and id(unsharded) not in hooked and unsharded.requires_grad:
                        hooked.add(id(unsharded))
                        self._handles.append(unsharded.register_post_accumulate_grad_hook(hook))

            for module in model.modules():
                if hasattr(module, "_get_fsdp_state"):
                    self._handles.append(module.register_forward_hook(Hook(after_forward)))
            return
        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def pre_reduction_flags(self) -> torch.Tensor | None:
        if self._comm_hook is not None:
            if self._comm_hook.flag is None:
                return self._flag
            return self._comm_hook.flag
        return self._flag

    def reset_pre_reduction(self) -> None:
        if self._comm_hook is not None:
            self._comm_hook.reset()
        if self._flag is not None:
            self._flag.zero_()

    def replicas(self, params: Sequence[torch.Tensor]) -> Replicas | None:
        """HSDP (FSDP2 on a mesh with a ``Replicate`` dimension): the parameters that are replicated along a mesh
        dimension (``params`` indices) and that dimension's process group, in which every rank holds the same
        shard, so ``consistency_every`` compares their bits there (every rank is in one such group). FSDP2's
        ``fully_shard`` on a 2-D mesh ``("replicate", "shard")`` gives every parameter the placements
        ``(Replicate(), Shard(0))``. Parameters are grouped by that group's ranks (the same layout on several
        mesh objects is one group); where parameters are replicated over different groups, those of the first
        parameter's group are taken. None where no parameter is a DTensor with a ``Replicate`` placement: plain
        DDP compares over this backend's own group, and FSDP shards differ by design."""
        found: Replicas | None = None
        index = []
        for i, p in enumerate(params):
            if not _is_dtensor(p):
                continue
            dims = [d for d, placement in enumerate(p.placements) if placement.is_replicate()]  # type: ignore[attr-defined]
            if not dims:
                continue
            group = self._replica_group(p.device_mesh, dims[0])  # type: ignore[attr-defined]
            if found is None:
                found = group
            if group.ranks == found.ranks:
                index.append(i)
        if found is None:
            return None
        return Replicas(found.backend, tuple(index), found.ranks)

    def _replica_group(self, mesh: Any, dim: int) -> Replicas:
        """The backend and global ranks of ``mesh``'s dimension ``dim`` (no members), made once per group."""
        key = (id(mesh), dim)
        replicas = self._replicas.get(key)
        if replicas is None:
            group = mesh.get_group(mesh_dim=dim)
            ranks = tuple(dist.get_process_group_ranks(group))
            same = next((r for r in self._replicas.values() if r.ranks == ranks), None)
            replicas = self._replicas[key] = same or Replicas(TorchDistBackend(group, pre_reduction=False), (), ranks)
        return replicas

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _find_comm_hook(model: Any) -> FlaggingCommHook | None:
    for entry in getattr(model, "_comm_hooks", ()) or ():
        hook = entry[0] if isinstance(entry, tuple) else entry
        check = getattr(hook, "ampguard_check", None)
        if isinstance(check, FlaggingCommHook):
            return check
    return None


def _fsdp_params(module: torch.nn.Module) -> list[Any]:
    """The FSDPParam objects an FSDP2 module manages (private API, read defensively)."""
    try:
        state = module._get_fsdp_state()  # type: ignore[operator]
    except Exception:  # pragma: no cover - layout changed
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [one] if one is not None else []
    return [fp for g in groups for fp in getattr(g, "fsdp_params", ())]
