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
(exact in int64), so each tensor costs two reductions that accumulate its integer view in int64 and a few ops on
vectors of R and C entries. (``sum(dtype=torch.int64)`` of an int32 view copies it to int64 first, inside ATen's
``make_reduction``: :func:`params_digest` therefore widens each chunk to int64 once, and both reductions read that
copy.) Nothing is copied to the host (the caller reads the result when it needs it) and nothing
is widened to float64. Meant for a periodic check (every N steps), as Megatron's
``check_param_hashes_across_dp_replicas`` is, not for every step.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .decision_graph import captured
from .stats import local_tensor
from .switches import implementation_switches

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


class _Block(NamedTuple):
    """One reduction of :func:`params_digest`: ``parts`` (flat integer views, concatenated when several) read as
    ``[rows, cols]``; a ``rows == 1`` block is a chunk's tail, or a short chunk."""

    parts: tuple[torch.Tensor, ...]
    start: int
    """Where the block starts in its concatenation (a tail: after its chunk's rows)."""
    rows: int
    cols: int


class _Plan(NamedTuple):
    """How :func:`params_digest` reads one list of tensors, made once per list (their storage and shapes) and
    reused: the integer views, the blocks, and the int64 weights of all row sums and all column sums laid end to
    end (element ``(i, j)`` of a block at offset ``o`` has position ``o + i*cols + j + 1``:
    ``sum (o + i*cols) * rowsum_i + sum (j + 1) * colsum_j``)."""

    key: tuple[tuple[int, int, torch.dtype, bool], ...]
    blocks: tuple[_Block, ...]
    row_weights: torch.Tensor
    col_weights: torch.Tensor


_PLANS: dict[int, _Plan] = {}
"""The last plan per first tensor of a list (a guard digests one list: its parameters), kept only while that tensor
lives: a plan's views keep the tensors' storage alive, so a deleted model must take its plan with it."""


def _key(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, int, torch.dtype, bool], ...]:
    """What a kept plan depends on, read on the host without making a view: each tensor's storage address, size,
    dtype and contiguity (on the H200's host, making the views took ~2.5 ms for GPT-2's 148 tensors)."""
    return tuple((x.data_ptr(), x.numel(), x.dtype, x.is_contiguous()) for x in map(local_tensor, tensors))


def _viewable(key: tuple[tuple[int, int, torch.dtype, bool], ...]) -> bool:
    """Whether ``_ints`` of the tensors ``key`` describes are views of them (contiguous, not bool), so a cache may keep
    them: a non-contiguous or bool tensor is read through a copy, which a kept cache would go on reading after the
    tensor changed (and so is a tensor on another device than the digest's)."""
    return all(contiguous and dtype != torch.bool for _, _, dtype, contiguous in key)


def _by_width(views: Sequence[torch.Tensor], device: torch.device) -> list[list[torch.Tensor]]:
    """The flat integer views on ``device``, grouped by width (in ``sorted(str(dtype))`` order), in order within a
    width: the order :func:`params_digest` lays them end to end."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for v in views:
        groups.setdefault(v.dtype, []).append(v.to(device))
    return [groups[dtype] for dtype in sorted(groups, key=str)]


def _plan(tensors: Sequence[torch.Tensor], device: torch.device) -> _Plan:
    key = _key(tensors)
    cached = _PLANS.get(id(tensors[0]))
    if cached is not None and cached.key == key:
        return cached
    views = [_ints(t).reshape(-1) for t in tensors]
    keep = _viewable(key) and all(v.device == device for v in views)
    chunks: list[list[torch.Tensor]] = []
    for group in _by_width(views, device):  # one stream: the widths one after the other
        pending: list[torch.Tensor] = []
        size = 0
        for x in group:
            if x.numel() >= _CHUNK:
                if pending:
                    chunks.append(pending)
                    pending, size = [], 0
                chunks.append([x])
                continue
            pending.append(x)
            size += x.numel()
            if size >= _CHUNK:
                chunks.append(pending)
                pending, size = [], 0
        if pending:
            chunks.append(pending)
    blocks: list[_Block] = []
    row_w: list[torch.Tensor] = []
    col_w: list[torch.Tensor] = []
    offset = 0
    for parts in chunks:
        n = sum(x.numel() for x in parts)
        if n == 0:
            continue
        cols = min(n, _ROW)
        rows = n // cols
        spans = [(0, rows, cols)] + ([(rows * cols, 1, n - rows * cols)] if rows * cols < n else [])
        joined = tuple(parts)  # one tuple for the chunk's blocks: params_digest concatenates it once
        for start, r, c in spans:
            blocks.append(_Block(joined, start, r, c))
            row_w.append(torch.arange(r, device=device, dtype=torch.int64) * c + (offset + start))
            col_w.append(torch.arange(1, c + 1, device=device, dtype=torch.int64))
        offset += n
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    plan = _Plan(key, tuple(blocks), torch.cat(row_w) if row_w else empty, torch.cat(col_w) if col_w else empty)
    if keep:
        if id(tensors[0]) not in _PLANS:  # dropped with that tensor (its id may be reused after)
            weakref.finalize(tensors[0], _drop, id(tensors[0]))
        _PLANS[id(tensors[0])] = plan
    return plan


def _drop(first: int) -> None:
    _PLANS.pop(first, None)
    _REPLAYS.pop(first, None)


def params_digest(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[WORDS]`` int64: the plain and position-weighted sums of the bits of all ``tensors`` laid
    end to end (grouped by integer width, in order within a width). Bitwise like
    :func:`param_fingerprints` (a flipped bit, two swapped elements or two swapped tensors change
    it) but one pass over chunks of up to ``_CHUNK`` elements instead of a few kernels per tensor:
    what :mod:`ampguard.consistency` compares every N steps. Each chunk is concatenated straight into an int64
    buffer (widened once) and reduced twice (row and column sums); the weights are applied once to all of them
    together, from a plan made once per list of tensors (the same storage each call: a training run's parameters,
    checked on the host by :func:`_key`). On CUDA, with a kept plan, those kernels are captured once in a CUDA graph
    and replayed (:func:`_replayed`). No host sync after the first call."""
    if not tensors:
        return torch.zeros(WORDS, dtype=torch.int64)
    device = tensors[0].device
    plan = _plan(tensors, device)
    if not plan.blocks:
        return torch.zeros(WORDS, dtype=torch.int64, device=device)
    if device.type == "cuda" and _PLANS.get(id(tensors[0])) is plan:
        out = _replayed(id(tensors[0]), plan)
        if out is not None:
            return out
    return _words(plan)


def _words(plan: _Plan) -> torch.Tensor:
    """The two words of a plan, eagerly (each chunk widened to int64 once: one chunk's copy alive at a time)."""
    row_sums: list[torch.Tensor] = []
    col_sums: list[torch.Tensor] = []
    joined: tuple[tuple[torch.Tensor, ...], torch.Tensor] | None = None
    for block in plan.blocks:
        if joined is None or joined[0] is not block.parts:  # a chunk's rows and then its tail: widened once
            parts = block.parts
            wide = parts[0].to(torch.int64) if len(parts) == 1 else torch.cat(
                parts, out=torch.empty(sum(x.numel() for x in parts), dtype=torch.int64, device=parts[0].device))
            joined = (parts, wide)
        m = joined[1][block.start : block.start + block.rows * block.cols].view(block.rows, block.cols)
        row_sums.append(m.sum(1))
        col_sums.append(m.sum(0))
    rows, cols = torch.cat(row_sums), torch.cat(col_sums)
    return torch.stack([rows.sum(), (rows * plan.row_weights).sum() + (cols * plan.col_weights).sum()])


class _Replay(NamedTuple):
    plan: _Plan
    graph: Any
    out: torch.Tensor


_REPLAYS: dict[int, _Replay | None] = {}
"""Per first tensor of a list, its plan's kernels captured in a CUDA graph (None: capture failed or is switched
off: eager), dropped with that tensor as ``_PLANS``. The graph's memory pool keeps one chunk's temporaries (an int64
copy of up to ``_CHUNK`` elements, 32 MiB) for as long as the parameters live: the digest runs only where the user
turned ``consistency_every`` on."""


def _replayed(first: int, plan: _Plan) -> torch.Tensor | None:
    """The digest of a kept plan from its CUDA graph (captured on the first call for this plan: three eager runs on a
    side stream, then the capture, as torch's CUDA graph notes say, by :func:`ampguard.decision_graph.captured`); a
    copy of the graph's static output. None: run eagerly (``AMPGUARD_CUDA_GRAPH=0``, or the capture failed: warned
    once)."""
    if first in _REPLAYS and _REPLAYS[first] is None:
        return None
    replay = _REPLAYS.get(first)
    if replay is None or replay.plan is not plan:
        if not implementation_switches().cuda_graph:
            _REPLAYS[first] = None
            return None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    _words(plan)
            torch.cuda.current_stream().wait_stream(side)
            graph, out = captured(lambda: _words(plan))
        except Exception as exc:  # an optimisation: never fail a check over it
            _REPLAYS[first] = None
            warnings.warn(f"ampguard: CUDA graph capture of the replica digest failed ({exc}); computing it eagerly "
                          "(AMPGUARD_CUDA_GRAPH=0 silences this)", RuntimeWarning, stacklevel=3)
            return None
        replay = _REPLAYS[first] = _Replay(plan, graph, out)
    replay.graph.replay()
    return replay.out.clone()
