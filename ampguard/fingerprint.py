"""Bitwise fingerprints of tensors, computed on device.

A fingerprint reads a tensor's bits, not its value: the tensor is viewed as integers of its own
width (``int16`` for fp16/bf16, ``int32`` for fp32, ``int64`` for fp64) and summed in int64, twice:
plainly, and weighted by position (element k counts k + 1 times), so one flipped bit anywhere changes
the first sum and two swapped elements change the second. Integer sums wrap modulo 2**64 and are
associative, so the result is exact and the same whatever the kernel's order of summation: two
replicas holding the same bits get the same fingerprint on any device, and any difference in their
bits (a NaN payload, a flipped mantissa bit, a -0.0 against a +0.0) shows.

The position-weighted sum is not computed element by element: the tensor is viewed as rows of C
(its last dimension, or 4096), and ``sum_k (k + 1) x_k = sum_i i*C * rowsum_i + sum_j (j + 1) * colsum_j``
(exact in int64), so each tensor costs two reductions that accumulate its integer view in int64
(``sum(dtype=torch.int64)``: no int64 copy of the tensor) and a few ops on vectors of R and C
entries. Nothing is copied to the host (the caller reads the result when it needs it) and nothing
is widened to float64. Meant for a periodic check (every N steps), as Megatron's
``check_param_hashes_across_dp_replicas`` is, not for every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .stats import local_tensor

__all__ = ["WORDS", "param_fingerprints", "params_digest"]

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ROW = 4096  # the row length of a tensor whose last dimension is not a usable one

WORDS = 2
"""Integers per tensor in :func:`param_fingerprints`' result (plain sum, position-weighted sum)."""

_WEIGHTS: dict[tuple[torch.device, int, int], torch.Tensor] = {}
"""``arange(n) * step + 1`` per (device, n, step), made once: the weights of row and column sums.
Bounded (a model has a few distinct shapes); cleared when it grows past 256 entries."""


def _weights(device: torch.device, n: int, step: int, start: int) -> torch.Tensor:
    key = (device, n, step)
    w = _WEIGHTS.get(key)
    if w is None:
        if len(_WEIGHTS) > 256:
            _WEIGHTS.clear()
        w = _WEIGHTS[key] = torch.arange(n, device=device, dtype=torch.int64) * step
    return w + start if start else w


def _ints(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width (a plain tensor of this rank: a DTensor's local shard)."""
    x = local_tensor(t).detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.contiguous()
    if x.dtype == torch.bool:
        return x.to(torch.int8)
    width = x.element_size()
    if width not in _INT_OF_WIDTH:
        raise TypeError(f"no integer view for a tensor of dtype {x.dtype}")
    return x.view(_INT_OF_WIDTH[width])


def _sums(x: torch.Tensor) -> torch.Tensor:
    """``[plain sum, position-weighted sum]`` of an integer tensor, int64 (module docstring)."""
    n = x.numel()
    if n == 0:
        return torch.zeros(WORDS, dtype=torch.int64, device=x.device)
    cols = x.shape[-1] if x.dim() >= 2 and 1 < x.shape[-1] <= 1 << 16 else min(n, _ROW)
    flat = x.reshape(-1)
    rows = n // cols
    main = flat[: rows * cols].view(rows, cols)
    row_sums = main.sum(1, dtype=torch.int64)
    col_sums = main.sum(0, dtype=torch.int64)
    plain = row_sums.sum()
    weighted = (row_sums * _weights(x.device, rows, cols, 0)).sum() + (col_sums * _weights(x.device, cols, 1, 1)).sum()
    if rows * cols < n:  # the tail: fewer than ``cols`` elements, whose positions follow the last row
        tail = flat[rows * cols :].to(torch.int64)
        plain = plain + tail.sum()
        weighted = weighted + (tail * _weights(x.device, tail.numel(), 1, rows * cols + 1)).sum()
    return torch.stack([plain, weighted])


def param_fingerprints(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(tensors), WORDS]`` int64 on the first tensor's device: each tensor's fingerprint
    (see the module docstring). No host sync. An empty sequence gives a ``[0, WORDS]`` tensor on the CPU."""
    if not tensors:
        return torch.zeros((0, WORDS), dtype=torch.int64)
    device = tensors[0].device
    return torch.stack([_sums(_ints(t)).to(device) for t in tensors])


_CHUNK = 1 << 22
"""Elements per chunk of :func:`params_digest`: small tensors are concatenated up to this many, so a
model of many small tensors costs a few reductions, not a few per tensor (and at most this many
elements of temporary memory per chunk)."""


def params_digest(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[WORDS]`` int64: the plain and position-weighted sums of the bits of all ``tensors`` laid
    end to end (grouped by integer width, in order within a width). Bitwise like
    :func:`param_fingerprints` (a flipped bit, two swapped elements or two swapped tensors change
    it) but one pass over chunks of up to ``_CHUNK`` elements instead of a few kernels per tensor:
    what :mod:`ampguard.consistency` compares every N steps. No host sync."""
    if not tensors:
        return torch.zeros(WORDS, dtype=torch.int64)
    device = tensors[0].device
    by_width: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        x = _ints(t).reshape(-1).to(device)
        by_width.setdefault(x.dtype, []).append(x)
    plain = torch.zeros((), dtype=torch.int64, device=device)
    weighted = torch.zeros((), dtype=torch.int64, device=device)
    offset = 0
    for dtype in sorted(by_width, key=str):  # one stream: the widths one after the other
        pending: list[torch.Tensor] = []
        size = 0
        chunks: list[torch.Tensor] = []
        for x in by_width[dtype]:
            if x.numel() >= _CHUNK:
                if pending:
                    chunks.append(torch.cat(pending))
                    pending, size = [], 0
                chunks.append(x)
                continue
            pending.append(x)
            size += x.numel()
            if size >= _CHUNK:
                chunks.append(torch.cat(pending))
                pending, size = [], 0
        if pending:
            chunks.append(torch.cat(pending))
        for chunk in chunks:
            s = _sums(chunk)  # positions from 1 within the chunk: shifted by the elements before it
            plain = plain + s[0]
            weighted = weighted + s[1] + offset * s[0]
            offset += chunk.numel()
    return torch.stack([plain, weighted])
