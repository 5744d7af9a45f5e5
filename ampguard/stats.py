"""Device-side statistics of one step, and the layout of the vectors that carry them.

Everything here runs on the gradients' device with foreach kernels and never reads a
value back to the host: no ``.item()``, no ``bool(tensor)``, no data-dependent Python branch.

Per rank, one *local vector* of ``LOCAL_K`` floats is all-gathered each step (the one
collective per step). Every rank then derives the same *decision vector* from the
gathered ``[world_size, LOCAL_K]`` matrix, so every rank takes the same decision.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

try:  # the helper clip_grad_norm_ itself uses; private, hence the fallback
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
except ImportError:  # pragma: no cover
    _group_tensors_by_device_and_dtype = None  # type: ignore[assignment]

__all__ = [
    "DECISION_K",
    "LOCAL_K",
    "Dec",
    "Loc",
    "grads_by_device_and_dtype",
    "local_vector",
    "per_tensor_norms",
]


class Loc:
    """Indices into the per-rank local vector."""

    LOSS = 0  # mean of the losses given to backward() since the last step (this rank)
    LOSS_NONFINITE = 1  # 1.0 when any of those losses was NaN/inf
    GRAD_NORM = 2  # L2 norm of this rank's (unscaled) gradients, or of its shard (FSDP)
    NONFINITE_TENSORS = 3  # number of this rank's gradient tensors holding NaN/inf
    FOUND_INF = 4  # GradScaler's found_inf summed over devices (0 without a scaler)
    PRE_REDUCTION = 5  # 1.0 when this rank's own contribution was non-finite before reduction
    SCALE = 6  # the loss scale that scaled this step's loss (1.0 without scaling)


LOCAL_K = 7


class Dec:
    """Indices into the decision vector (identical on every rank). Values first, then 0/1 flags,
    so the vector is assembled with two stacks."""

    LOSS = 0  # mean loss over ranks
    GRAD_NORM = 1  # global gradient norm
    NONFINITE_TENSORS = 2  # summed over ranks
    CLIP_COEF = 3
    SCALE = 4
    NEXT_SCALE = 5
    REASON = 6  # 0 none, 1 nonfinite_loss, 2 nonfinite_grad, 3 grad_spike, 4 loss_spike
    SKIP = 7  # 1.0: the inner optimizer does not step
    LOSS_NONFINITE = 8  # any rank
    GRAD_NONFINITE = 9  # any rank (non-finite tensors or GradScaler found_inf)
    GRAD_SPIKE = 10
    LOSS_SPIKE = 11
    BACKOFF = 12  # 1.0 when the scale was backed off this step
    GROWTH = 13  # 1.0 when the scale grew this step
    FLOOR = 14  # 1.0 when a backoff hit min_scale


DECISION_K = 15

REASONS = (None, "nonfinite_loss", "nonfinite_grad", "grad_spike", "loss_spike")


def grads_by_device_and_dtype(
    params: Sequence[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The params' gradients grouped exactly as ``clip_grad_norm_`` groups them (same helper,
    same order), so norms derived from them are bitwise clip_grad_norm_'s."""
    # Sharded (DTensor, FSDP2) gradients: this rank's shard, as a plain tensor sharing its storage.
    # Norms are then local (decide() adds the squares across ranks) and no op dispatches a collective.
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if _group_tensors_by_device_and_dtype is not None:
        grouped = _group_tensors_by_device_and_dtype([grads])  # type: ignore[list-item]
        return {key: list(tensors[0]) for key, (tensors, _) in grouped.items()}  # type: ignore[arg-type]
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:  # pragma: no cover - torch without the helper
        groups[(g.device, g.dtype)].append(g)
    return groups


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def per_tensor_norms(
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]], device: torch.device
) -> torch.Tensor:
    """L2 norm of every gradient tensor, in group order, stacked on ``device``.

    One ``torch._foreach_norm`` per (device, dtype) group: a single read of the gradients.
    The order and the kernels are those of ``torch.nn.utils.clip_grad_norm_``, so the total
    norm derived from this vector is bitwise the one clip_grad_norm_ would compute.
    """
    parts: list[torch.Tensor] = []
    for (dev, _), grads in groups.items():
        n = torch.stack(torch._foreach_norm(grads, 2.0))  # one stack per group, no per-tensor copies
        if n.dtype != torch.float32:
            n = n.float()
        if dev != device:
            n = n.to(device=device, non_blocking=True)
        parts.append(n)
    if not parts:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def local_vector(
    *,
    loss_sum: torch.Tensor | None,
    loss_count: int,
    tensor_norms: torch.Tensor,
    found_inf: torch.Tensor | None,
    pre_reduction: torch.Tensor | None,
    scale: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack this rank's statistics into the ``LOCAL_K`` vector; also return the local total norm
    (the 0-d tensor clip_grad_norm_ would return for these gradients)."""
    if tensor_norms.numel():
        total = torch.linalg.vector_norm(tensor_norms, 2.0)
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
    nonfinite = (~torch.isfinite(tensor_norms)).sum()
    zero, one, nan = _constants(device)
    if loss_sum is None:
        loss, loss_bad = nan, zero
    else:
        loss = loss_sum if loss_count == 1 else loss_sum / loss_count
        loss_bad = ~torch.isfinite(loss_sum)
    vec = torch.stack(
        [
            loss,
            loss_bad,
            total,
            nonfinite,
            zero if found_inf is None else found_inf.to(device).reshape(()),  # ShardedGradScaler: [1]
            zero if pre_reduction is None else pre_reduction.to(device),
            one if scale is None else scale,
        ]
    ).float()
    return vec, total


_CONSTANTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """0, 1 and NaN as float32 0-d tensors on ``device``, made once (only ever read)."""
    c = _CONSTANTS.get(device)
    if c is None:
        c = _CONSTANTS[device] = tuple(  # type: ignore[assignment]
            torch.full((), v, dtype=torch.float32, device=device) for v in (0.0, 1.0, math.nan)
        )
    return c  # type: ignore[return-value]
