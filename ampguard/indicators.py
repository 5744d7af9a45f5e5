"""Leading indicators: per top-level module, the gradient norm and the update-to-weight
ratio ``||delta w|| / ||w||``, sampled every ``GuardConfig.indicators_every`` steps on the device.

Loss spikes tend to follow a rise in one part of the model's gradient norms and update sizes;
the global gradient norm hides which part. These two numbers, per top-level module, are what
``docs/indicators.md`` teaches to read.

Top-level modules are the direct children of the model given to ``wrap(model=...)``, as the user
wrote it (:func:`ampguard.forensics.compile.user_module`: without DDP's / FSDP's ``module`` wrapper and
``torch.compile``'s ``OptimizedModule``; names never hold ``_orig_mod``), that own at least one
parameter, in registration order. A parameter shared by two children (tied weights) belongs to the
first. Parameters of the optimizer that belong to no child (the root's own, or one the model does
not hold) go to the bucket :data:`ROOT` ``"(root)"``, listed last when the root holds parameters of
its own or some parameter of the optimizer maps to it. Modules are listed whether or not the optimizer
trains them (one it does not train reports 0 and 0), so the names stay fixed for the run. The
parameter index (``param_groups`` order, the order of :class:`ampguard.stats.GradGroups`'s
``index``) -> module map is built once, at wrap time (again after ``add_param_group``).

On a sampled step, with no host sync:

- **gradient norm**: from the per-tensor norms the step already computed (``Measured.norms``: of
  the unscaled gradients, before clipping; on the fused fast path the scaled norms times
  ``1/scale``): their squares summed per module with one ``index_add_`` over the gradients'
  parameter index, then a square root. No extra read of the gradients. A module with no gradient
  this step (frozen, unused) reports **0.0**; a non-finite gradient makes its module's norm
  non-finite.
- **update ratio**: before the inner optimizer's step, one ``torch._foreach_mul(params, 1.0)`` copy of the
  parameters that have a gradient (the ones a torch optimizer may update) and their norms
  (``_foreach_norm``); after it, ``_foreach_sub_`` and ``_foreach_norm`` give ``||delta w||``, the
  exact difference (in the parameters' dtype) of what the step wrote. Per module
  ``sqrt(sum ||delta w_i||^2) / sqrt(sum ||w_i||^2)`` with ``w`` the weights before the step; 0.0
  where nothing moved (a skipped step: the kernel or GradScaler did not step, so delta w is exactly
  0; a frozen module), inf for a module whose weights were all zero and moved. **Memory**: one
  transient copy of those parameters on sampled steps only (the caching allocator keeps the
  blocks reserved for the next sample); nothing on other steps.

The values end the step's payload (:mod:`ampguard.payload`): one ``non_blocking`` copy with the
decision, decoded with the step's report (on CUDA a step later, as every report), named by
:attr:`Indicators.modules`. They are **rank-local**: this rank's
gradients and parameters (with DDP the gradients are the same on every rank after the all-reduce;
with sharded gradients, FSDP, they are this rank's shard). Steps that are not sampled cost one
integer compare.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .forensics.compile import user_module, user_name
from .pipeline import Measured
from .stats import GradGroups, local_tensor, per_tensor_norms

__all__ = ["ROOT", "Indicators", "top_level_owners"]

ROOT = "(root)"
"""The bucket of the optimizer's parameters that belong to no top-level child module."""


def top_level_owners(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> tuple[tuple[str, ...], list[int]]:
    """The top-level modules of ``model`` (see the module docstring) and, for each of ``params``,
    the index of its module in that tuple (:data:`ROOT` last, when the root holds parameters of its own or
    some of ``params`` belong to no child)."""
    root = user_module(model)
    names: list[str] = []
    owner: dict[int, int] = {}
    for name, child in root.named_children():
        mine = [p for p in child.parameters() if id(p) not in owner]
        if not mine:
            continue
        for p in mine:
            owner[id(p)] = len(names)
        names.append(user_name(name))
    owners = [owner.get(id(p), -1) for p in params]
    if -1 in owners or next(root.parameters(recurse=False), None) is not None:
        owners = [len(names) if k == -1 else k for k in owners]
        names.append(ROOT)
    return tuple(names), owners


class _Sample:
    """One sampled step between :meth:`Indicators.before_step` and :meth:`Indicators.after_step`."""

    __slots__ = ("before", "grad_norms", "groups", "params", "segments", "weight_sq")

    def __init__(self, groups: GradGroups, grad_norms: torch.Tensor, segments: torch.Tensor,
                 params: list[list[torch.Tensor]], before: list[list[torch.Tensor]], weight_sq: torch.Tensor) -> None:
        self.groups, self.grad_norms, self.segments, self.params, self.before, self.weight_sq = (
            groups, grad_norms, segments, params, before, weight_sq)


class Indicators:
    """The leading indicators of one guarded optimizer (built by the guard when
    ``GuardConfig.indicators_every`` is set and a model is given)."""

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.Tensor], device: torch.device) -> None:
        self.device = device
        self._model = model
        self.modules: tuple[str, ...] = ()
        """Top-level module names, in the order of ``StepReport.module_grad_norms``."""
        self._owners: list[int] = []
        self._segments: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.remap(params)
        held = {id(p) for p in user_module(model).parameters()}
        if not any(id(p) in held for p in params):
            raise ValueError(
                "GuardConfig.indicators_every: none of the optimizer's parameters belongs to wrap(model=...) "
                f"({type(user_module(model)).__name__}), so no gradient or update can be given to a module of it. "
                "Pass the model whose parameters the optimizer trains.")

    def remap(self, params: Sequence[torch.Tensor]) -> None:
        """Build the parameter index -> module map (at wrap time, and after ``add_param_group``)."""
        self.modules, self._owners = top_level_owners(self._model, params)
        self._segments.clear()

    # ------------------------------------------------------------------ on device, no sync
    def before_step(self, measured: Measured, params: Sequence[torch.Tensor]) -> _Sample:
        """Before the inner step of a sampled step: the module gradient norms (from
        ``measured.norms``) and a copy of the parameters that have a gradient, with their norms."""
        groups = measured.groups
        segments = self._segments_for(groups)
        grad_norms = self._sum_sq(measured.norms, segments).sqrt()
        grouped = _params_like(groups, params)
        with torch.no_grad():
            before = [list(torch._foreach_mul(ps, 1.0)) for ps in grouped]
        weight_sq = self._sum_sq(self._norms(groups, before), segments)
        return _Sample(groups, grad_norms, segments, grouped, before, weight_sq)

    def after_step(self, sample: _Sample) -> torch.Tensor:
        """After the inner step: ``[module grad norms..., module update ratios...]`` (float32, on
        the guard's device), the tail of the step's payload. The parameter copy is released."""
        with torch.no_grad():
            for old, new in zip(sample.before, sample.params):
                torch._foreach_sub_(old, new)  # w_before - w_after: exactly 0 where the step wrote nothing
        delta = self._sum_sq(self._norms(sample.groups, sample.before), sample.segments).sqrt()
        sample.before = []
        ratio = torch.where(delta == 0, torch.zeros_like(delta), delta / sample.weight_sq.sqrt())
        return torch.cat([sample.grad_norms, ratio])

    def _segments_for(self, groups: GradGroups) -> torch.Tensor:
        """The module of each per-tensor norm, on device: made once per set of gradients (from
        pinned memory, ``non_blocking``: no sync), then reused."""
        key = tuple(groups.index)
        hit = self._segments.get(key)
        if hit is None:
            if len(self._segments) >= 8:  # the set of gradients keeps changing: keep a few
                self._segments.clear()
            host = torch.tensor([self._owners[i] for i in key], dtype=torch.long)
            if self.device.type == "cuda":
                host = host.pin_memory()
            hit = self._segments[key] = (host, host.to(self.device, non_blocking=True))  # host kept alive
        return hit[1]

    def _sum_sq(self, norms: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(self.modules), dtype=torch.float32, device=self.device)
        return out.index_add_(0, segments, norms.square())

    def _norms(self, groups: GradGroups, tensors: list[list[torch.Tensor]]) -> torch.Tensor:
        """Per-tensor norms of ``tensors`` (grouped as ``groups``' gradients), on the guard's device."""
        return per_tensor_norms(GradGroups(dict(zip(groups.tensors, tensors)), groups.index), self.device)


def _params_like(groups: GradGroups, params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters whose gradients ``groups`` holds, in the same groups and order (their local
    shards for DTensor parameters)."""
    return [[local_tensor(params[i]) for i in index] for _, index in groups.with_index()]
