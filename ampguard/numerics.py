"""fp16 underflow and headroom, sampled every ``GuardConfig.numerics_every`` steps.

On a sampled step, before the gradients are unscaled (or, where somebody unscaled them already,
from the unscaled ones times the scale), one pass over this rank's gradients measures on device:

- the fraction of gradient elements that are exactly zero, over every gradient and per optimizer
  param group (exact counts: :func:`nonzero_count`; per large tensor, and once over the small ones of a
  group);
- with a GradScaler (fp16), the largest magnitude of a scaled gradient (``torch._foreach_norm(grads, inf)``), as
  the headroom ``log2(65504 / max|scaled grad|)``: how many doublings of the loss scale fp16 has left (bf16 and
  fp32 have no headroom to measure: that read is not made).

The values ride the step's payload (:mod:`ampguard.payload`) to the host; the headroom
also rides this rank's local vector (``stats.Loc.HEADROOM``), so the opt-in headroom scale policy
decides on the minimum over ranks, agreed through the step's one collective. Non-sampled steps
cost an int compare. Values are rank-local: this rank's gradients (frozen parameters, which have
no gradient, are not counted). Nothing here writes a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .stats import GradGroups, cpu_amax, cpu_amax_ok

__all__ = ["COUNT_CHUNK", "FP16_MAX", "Numerics", "chunked_count", "group_of", "nonzero_count"]

FP16_MAX = 65504.0
"""The largest finite float16 value."""

_SMALL = 1 << 16
"""Gradients with fewer elements are counted together per param group (one flat copy of them)."""

COUNT_CHUNK = 1 << 24
"""Elements per reduction of :func:`nonzero_count` off the CPU: a float32 count of at most 2**24 is exact."""


def nonzero_count(t: torch.Tensor) -> torch.Tensor:
    """The number of non-zero elements of ``t`` (NaN and Inf count), exact, a 0-d float64 tensor on ``t``'s device
    (no sync).

    On the CPU ``torch.count_nonzero`` (one pass there). Elsewhere ``torch.count_nonzero`` is ``(t != 0)``
    then a sum, which on CUDA writes a bool copy of ``t`` and a long one before it reduces (stop 43's H100 profile:
    ~1.25 ms of kernels a sampled step on GPT-2 124M's gradients, more than the guard's whole measurement); there
    the count is ``linalg.vector_norm(ord=0)``, one read and no temporary, over views of at most
    :data:`COUNT_CHUNK` elements (its float32 sums of 0s and 1s are exact up to 2**24), summed in float64 (exact
    up to 2**53). Either way the same integer."""
    if t.device.type == "cpu":
        return torch.count_nonzero(t).double()
    return chunked_count(t)


def chunked_count(t: torch.Tensor, chunk: int = COUNT_CHUNK) -> torch.Tensor:
    """:func:`nonzero_count` off the CPU (any device, for the tests): ``linalg.vector_norm(ord=0)`` over views of at
    most ``chunk`` elements, summed in float64."""
    flat = t.reshape(-1)
    if flat.numel() <= chunk:
        return torch.linalg.vector_norm(flat, ord=0).double()
    return torch.stack([torch.linalg.vector_norm(c, ord=0) for c in flat.split(chunk)]).double().sum()


def group_of(param_groups: Sequence[dict]) -> list[int]:  # type: ignore[type-arg]
    """The param group of every parameter, in ``param_groups`` order (the index order of
    :class:`~ampguard.stats.GradGroups`)."""
    return [g for g, group in enumerate(param_groups) for _ in group["params"]]


class Numerics:
    """When to sample, and the measurement (see the module docstring)."""

    def __init__(self, every: int | None, *, device: torch.device, headroom: bool) -> None:
        self.every = every
        self.device = device
        self.headroom = headroom
        """fp16 with a GradScaler: the headroom is measured (else NaN in the vector, None reported)."""

    def sampled(self, step: int) -> bool:
        """Whether step ``step`` is sampled: an int compare."""
        return self.every is not None and step % self.every == 0

    def measure(self, groups: GradGroups, param_groups: Sequence[dict],  # type: ignore[type-arg]
                factor: torch.Tensor | None) -> torch.Tensor:
        """``[zero fraction, headroom_log2, zero fraction of group 0, 1, ...]`` (float32, on the
        guard's device; no sync). ``factor``: the loss scale when the gradients were unscaled
        already (max|scaled| = max|unscaled| * scale), None when they are still scaled. A group
        without gradient elements has a NaN fraction; no gradient at all: fraction NaN, headroom inf."""
        where = group_of(param_groups)
        dev = self.device
        nonzero: list[list[torch.Tensor]] = [[] for _ in param_groups]  # per param group: float64 counts, exact
        numel = [0] * len(param_groups)
        peaks: list[torch.Tensor] = []
        # Device ops only (Python ints enter as kernel arguments): no host-to-device copy, no sync.
        # Small tensors (biases, norms) of one param group are counted together, one flat copy of
        # them: a few kernels per group instead of two per tensor.
        for grads, index in groups.with_index():
            small: list[list[torch.Tensor]] = [[] for _ in param_groups]
            for g, i in zip(grads, index):
                numel[where[i]] += g.numel()
                if g.numel() < _SMALL:
                    small[where[i]].append(g.reshape(-1))
                else:
                    nonzero[where[i]].append(nonzero_count(g).to(dev, non_blocking=True))
            for group, flat in enumerate(small):
                if flat:
                    both = flat[0] if len(flat) == 1 else torch.cat(flat)
                    nonzero[group].append(nonzero_count(both).to(dev, non_blocking=True))
            if self.headroom:  # fp16 with a GradScaler only: bf16 and fp32 report no headroom
                peaks.append(_peak(grads).to(dev, non_blocking=True))
        zeros = [n - (torch.stack(c).sum() if len(c) > 1 else c[0]) if c else None for c, n in zip(nonzero, numel)]
        nan = torch.full((), math.nan, dtype=torch.float64, device=dev)
        fractions = [nan if z is None else z.double() / n for z, n in zip(zeros, numel)]  # no element: NaN
        counted = [z for z in zeros if z is not None]
        total = torch.stack(counted).sum().double() / sum(numel) if counted else nan
        if self.headroom and peaks:
            peak = torch.stack(peaks).amax() if len(peaks) > 1 else peaks[0]
            if factor is not None:
                peak = peak * factor.to(dev, non_blocking=True).reshape(())
            headroom = torch.log2(FP16_MAX / peak)  # 0 -> inf; inf -> -inf; NaN stays NaN
        else:
            headroom = torch.full((), math.inf if self.headroom else math.nan, dtype=torch.float32, device=dev)
        return torch.stack([total, headroom.double().reshape(()), *fractions]).float()


def _peak(grads: list[torch.Tensor]) -> torch.Tensor:
    """max|g| over one (device, dtype) group's gradients, float32: ``_foreach_norm(inf)``'s maxima;
    dense, non-empty, real CPU gradients by :func:`ampguard.stats.cpu_amax` (the same value, 10-30x
    faster there). Anything else (a sparse or an empty gradient, which that norm refuses) as before."""
    g0 = grads[0]
    if cpu_amax_ok(g0.device, g0.dtype) and all(g.layout == torch.strided and g.numel() for g in grads):
        return cpu_amax(grads).float().amax()
    return torch.stack(torch._foreach_norm(grads, math.inf)).float().amax()
