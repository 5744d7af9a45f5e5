"""One guarded step as named stages, each a method of :class:`StepPipeline`.

``measure`` → ``gather`` → ``decide`` → ``clip`` → ``inner_step`` → ``update_scale``: the
data a step carries from one to the next is a :class:`Measured` (the first and only read of
the gradients) and the decision vector (:class:`~ampguard.stats.Dec`), both on device. Where
the host waits for the device (the only places it does):

1. ``backend.before_unscale``  Horovod: ``synchronize()`` (its own wait on the all-reduce).
2. unscale                    GradScaler's fused unscale + non-finite check. No sync.
3. per-tensor norms           one ``torch._foreach_norm`` per (device, dtype) group. No sync.
4. gather                     one collective of ``LOCAL_K`` floats per rank. NCCL: no host sync
                              (the stream waits); gloo/CPU: blocking, as every CPU op is.
5. decide                     tensor ops on device (:func:`ampguard.policies.decide`), replayed
                              from a CUDA graph on CUDA. No sync.
6. clip                       ``_foreach_mul_`` by the decided coefficient. No sync.
7. inner step or skip         the skip is folded into GradScaler's ``found_inf``:
                              - fused optimizers (``_step_supports_amp_scaling``) read it on
                                device: no sync;
                              - other optimizers: GradScaler's own ``found_inf.item()`` (fp16), or
                                one ``.item()`` on the skip flag (bf16/fp32): the one sync a
                                skipping step needs, and the one GradScaler already makes.
8. scale update               ``GradScaler.update(new_scale=tensor)``. No sync.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .config import GuardConfig
from .errors import GuardStateError
from .policies import SpikeState, decide
from .scaling import GradScalerAdapter, ScalerView, ScaleState
from .stats import Dec, GradGroups, grads_by_device_and_dtype, local_vector, per_tensor_norms

__all__ = ["DecisionGraph", "LossMeter", "Measured", "StepPipeline"]


class LossMeter:
    """The loss of the optimizer step being prepared, summed on device over its micro-batches.

    ``reduction="mean"`` (``opt.backward(loss)``: each micro-batch's loss is a full loss) reports
    the mean; ``"sum"`` (a framework that divides each micro-batch's loss by the accumulation steps
    before backward) reports the sum, which is then the loss of the whole batch. No sync.
    """

    __slots__ = ("count", "reduction", "total")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0
        self.reduction: str | None = None

    def add(self, loss: torch.Tensor, reduction: str) -> None:
        if self.reduction is not None and reduction != self.reduction:
            raise GuardStateError(
                f"this step's losses were given with reduction={self.reduction!r} and now {reduction!r}: give every "
                "micro-batch loss of one step the same way (opt.backward(loss) means 'mean'). Nothing was changed."
            )
        detached = loss.detach().float().reshape(())
        self.total = detached if self.total is None else self.total + detached
        self.count += 1
        self.reduction = reduction

    def value(self) -> torch.Tensor | None:
        if self.total is None or self.count == 1 or self.reduction == "sum":
            return self.total
        return self.total / self.count


@dataclasses.dataclass(slots=True)
class Measured:
    """The first read of one step's gradients: unscaled, checked, per-tensor norms."""

    found_inf_per_device: dict[torch.device, torch.Tensor]
    """GradScaler's ``found_inf`` per device (empty without loss scaling)."""
    found_inf: torch.Tensor | None
    """The same, summed on the guard's device (None without loss scaling)."""
    groups: GradGroups
    norms: torch.Tensor
    """Per-tensor L2 norms (float32, on the guard's device), in ``groups.index`` order."""


class DecisionGraph:
    """The decision, replayed from a CUDA graph on CUDA (``GuardConfig.cuda_graph``): ~70 tiny
    kernels become one launch. The first decision of the process runs eagerly (lazy init);
    capture happens on the next one. A failed capture falls back to eager, with one warning."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._graph: tuple[Any, Any, torch.Tensor, Any] | None = None
        self._failed = False
        self._ran_eagerly = False

    def run(self, fn: Callable[[torch.Tensor], Any], gathered: torch.Tensor, key: Any) -> Any:
        if gathered.device.type != "cuda" or not self.enabled or self._failed:
            return fn(gathered)
        key = (tuple(gathered.shape), key)
        if self._graph is None or self._graph[0] != key:
            if not self._ran_eagerly:
                self._ran_eagerly = True
                return fn(gathered)
            gc_was_on = gc.isenabled()
            try:
                static_in = gathered.clone()
                graph = torch.cuda.CUDAGraph()
                # No garbage collection inside the capture: a collection there frees whatever cyclic
                # garbage is about, and a destructor that calls CUDA invalidates the capture (seen on
                # an H200, torch 2.11, tests/gpu/test_gpu.py: "operation failed due to a previous
                # error during capture" with the collector on, a clean capture with it off).
                gc.disable()
                with torch.cuda.graph(graph):  # records (does not run) the kernels; one-time sync
                    static_out = fn(static_in)
                self._graph = (key, graph, static_in, static_out)
            except Exception as exc:  # capture is an optimisation: never fail a step over it
                self._failed = True
                warnings.warn(f"ampguard: CUDA graph capture of the step decision failed ({exc}); running it "
                              "eagerly (set GuardConfig(cuda_graph=False) to silence this)", RuntimeWarning,
                              stacklevel=4)
                return fn(gathered)
            finally:
                if gc_was_on:
                    gc.enable()
        _, graph, static_in, static_out = self._graph
        static_in.copy_(gathered)
        graph.replay()
        return static_out


class StepPipeline:
    """The stages of one guarded step. Holds the on-device state the decision carries from
    step to step (spike averages, hysteresis run); nothing here reads a value to the host
    except where the module docstring says."""

    def __init__(
        self,
        *,
        optimizer: torch.optim.Optimizer,
        adapter: GradScalerAdapter | None,
        backend: Any,
        config: GuardConfig,
        device: torch.device,
    ) -> None:
        self.optimizer = optimizer
        self.adapter = adapter
        self.backend = backend
        self.config = config
        self.device = device
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.spikes = SpikeState.fresh(device)
        self.scale_state = ScaleState.fresh(device)
        self.graph = DecisionGraph(config.cuda_graph)

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def measure(self, guard: object) -> Measured:
        """Unscale (adopting an ``unscale_`` already done this iteration), check and measure the
        gradients: one read. ``guard``: the guarded optimizer (GradScaler may know it by its id)."""
        found: dict[torch.device, torch.Tensor] = {}
        if self.adapter is not None:
            found = self.adapter.unscale(guard, self.optimizer)
        found_inf = None
        if len(found) == 1:
            (found_inf,) = found.values()
        elif found:
            found_inf = torch.stack([t.to(self.device, non_blocking=True).reshape(()) for t in found.values()]).sum()
        groups = grads_by_device_and_dtype(self.params())
        return Measured(found, found_inf, groups, per_tensor_norms(groups, self.device))

    def gather(self, measured: Measured, loss: torch.Tensor | None, *, no_grads: bool = False,
               sentinel: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's statistics, all-gathered: ``[world_size, LOCAL_K]`` on device. collective:
        every rank gathers, also one whose backward reached no parameter (``no_grads``): the
        decision then skips the step on every rank. ``sentinel``:
        :meth:`ampguard.sentinel.Sentinel.value` (None: off)."""
        vec = local_vector(loss=loss, tensor_norms=measured.norms, found_inf=measured.found_inf,
                           pre_reduction=self.backend.pre_reduction_flags(), device=self.device, no_grads=no_grads,
                           sentinel=sentinel)
        return self.backend.all_gather(vec).wait()  # type: ignore[no-any-return]

    def decide(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decision vector and the scaler's next growth tracker (None without a scaler)."""
        view: ScalerView | None = self.adapter.view() if self.adapter is not None else None

        def run(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return decide(g, config=self.config, spikes=self.spikes, scale_state=self.scale_state, scaler=view,
                          grads_sharded=self.backend.grads_sharded)

        key = None if view is None else (view.growth_factor, view.backoff_factor, view.growth_interval)
        return self.graph.run(run, gathered, key)  # type: ignore[no-any-return]

    def clip(self, measured: Measured, decision: torch.Tensor) -> None:
        if self.config.clip_grad_norm is None:
            return
        coef = decision[Dec.CLIP_COEF]
        for grads in measured.groups.tensors.values():
            torch._foreach_mul_(grads, coef.to(grads[0].device))

    def inner_step(self, decision: torch.Tensor, measured: Measured) -> bool:
        """Step the inner optimizer unless the decision says skip. Returns whether it synced."""
        if not measured.groups.index:
            # No gradient on this rank: the decision skips everywhere (Loc.NO_GRADS), and there is
            # nothing to step here (GradScaler.step would refuse: it recorded no inf check).
            return False
        skip = decision[Dec.SKIP]
        inner = self.optimizer
        if self.adapter is not None:
            self.adapter.force_found_inf(measured.found_inf_per_device, skip)
            with self.backend.step_context(inner):
                self.adapter.step(inner)  # non-fused: GradScaler's own found_inf.item() (a sync)
            return not self.fused
        if self.fused:
            inner.grad_scale = None  # type: ignore[attr-defined]
            inner.found_inf = skip  # type: ignore[attr-defined]
            try:
                with self.backend.step_context(inner):
                    inner.step()
            finally:
                del inner.grad_scale, inner.found_inf  # type: ignore[attr-defined]
            return False
        if not skip.item():  # SYNC: the one a non-fused optimizer needs to skip (GradScaler's too)
            with self.backend.step_context(inner):
                inner.step()
        return True

    def update_scale(self, decision: torch.Tensor, tracker: torch.Tensor | None) -> None:
        if self.adapter is not None:
            self.adapter.update(decision[Dec.NEXT_SCALE], tracker)


def payload(decision: torch.Tensor, gathered: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """Everything the host report needs from one step, in one float32 vector (one copy)."""
    return torch.cat([decision, gathered.reshape(-1).float(), norms])


def grad_marks(params: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """Which gradient tensors exist, and their autograd version counters: a backward that adds
    to a gradient, or replaces it, changes this. One attribute read per parameter, no sync."""
    return tuple(None if p.grad is None else (id(p.grad), p.grad._version) for p in params)
