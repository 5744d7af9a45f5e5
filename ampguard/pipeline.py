"""One guarded step as named stages, each a method of :class:`StepPipeline`.

``measure`` → ``gather`` → ``decide`` → ``clip`` → ``inner_step`` → ``update_scale``: the
data a step carries from one to the next is a :class:`Measured` (the first and only read of
the gradients) and the decision vector (:class:`~ampguard.stats.Dec`), both on device. Where
the host waits for the device (the only places it does):

1. ``backend.before_unscale``  Horovod: ``synchronize()`` (its own wait on the all-reduce).
2. unscale                    GradScaler's fused unscale + non-finite check. No sync.
3. per-tensor norms           one ``torch._foreach_norm`` per (device, dtype) group (CPU float32:
                              ``sqrt(dot(g, g))``, :func:`ampguard.stats.cpu_norms`). No sync.
4. gather                     one collective of ``LOCAL_K`` floats per rank. NCCL: no host sync
                              (the stream waits); gloo/CPU: blocking, as every CPU op is.
5. decide                     fused optimizers off the CPU: tensor ops on device
                              (:func:`ampguard.policies.decide`), replayed from a CUDA graph on
                              CUDA. No sync. On CPU (no device to wait for), and for non-fused
                              optimizers (whose step must know the skip on the host anyway): the
                              same rule on host floats (:func:`ampguard.policies.decide_host`),
                              bit for bit the same decision, from one copy of the gathered
                              statistics (:class:`HostCopy`): off the CPU, that copy is the
                              step's one sync, where GradScaler's ``found_inf.item()`` was.
6. clip                       ``_foreach_mul_`` by the decided coefficient. No sync.
7. inner step or skip         the skip is folded into GradScaler's ``found_inf``:
                              - fused optimizers (``_step_supports_amp_scaling``) read it on
                                device: no sync;
                              - other optimizers: ``inner.step()`` unless the host decision
                                skips (``found_inf`` filled in for GradScaler's records). No sync
                                beyond stage 5's copy.
8. scale update               ``GradScaler.update(new_scale=tensor)`` (a host float after a host
                              decision). No sync.

The fused fast path (on; ``AMPGUARD_FUSED_FAST_PATH=0`` off, tests only; see :meth:`StepPipeline.fast_path`
for when it is taken: a GradScaler, a fused optimizer, nobody unscaled this iteration) replaces
stages 2, 3, 6 and 7:

2+3. per-tensor norms         of the **still-scaled** gradients (the one read), times ``1/scale``
                              on device (exact for a power-of-two scale: the norms and the total
                              stay bitwise ``clip_grad_norm_``'s on unscaled gradients, barring
                              float32 over/underflow); ``found_inf`` := some norm is non-finite,
                              recorded as GradScaler's own (a norm that overflows float32 on finite
                              scaled values counts too: skipped and backed off, conservatively;
                              torch's norm kernels sum squares in float32, so that is a scaled
                              norm above ~1.8e19, an unscaled one above 1.8e19/scale). No sync.
6+7. clip + inner step        no pass of their own: the fused optimizer gets ``grad_scale = scale``
                              (``scale / clip_coef`` when clipping) and ``found_inf = skip``, as
                              GradScaler.step hands them to such optimizers, and unscales, clips
                              and updates in its kernel, or skips there. No sync.

Passes over the gradients: today's path reads+writes (unscale), reads (norms), reads+writes (clip,
when clipping) before the optimizer's own pass; the fast path reads once. Given a ``grad_scale``,
torch's fused kernels (Adam/AdamW/SGD/Adagrad) also write the unscaled (and clipped) gradients
back as they update, as in the plain fused GradScaler loop, and leave them untouched, scaled, on
a skipped step: ``.grad`` afterwards is the plain fused loop's.
"""

from __future__ import annotations

import array
import dataclasses
import gc
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .config import GuardConfig
from .errors import GuardStateError
from .numerics import Numerics
from .policies import SpikeState, decide, decide_host, uses_clipping
from .scaling import GradScalerAdapter, ScalerView, ScaleState, f32
from .stats import Dec, GradGroups, grads_by_device_and_dtype, local_vector, per_tensor_norms, sparse_values
from .switches import implementation_switches

__all__ = ["DecisionGraph", "HostCopy", "LossMeter", "Measured", "StepPipeline", "local_vector_host"]


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

    def check(self, reduction: str) -> None:
        """Raise, changing nothing, when ``reduction`` differs from this step's earlier losses'."""
        if self.reduction is not None and reduction != self.reduction:
            raise GuardStateError(
                f"this step's losses were given with reduction={self.reduction!r} and now {reduction!r}: give every "
                "micro-batch loss of one step the same way (opt.backward(loss) means 'mean'). Nothing was changed."
            )

    def add(self, loss: torch.Tensor, reduction: str) -> None:
        self.check(reduction)
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
    """Per-tensor L2 norms (float32, on the guard's device), in ``groups.index`` order: of the
    unscaled gradients, also on the fast path (the scaled norms times ``1/scale``)."""
    numerics: torch.Tensor | None = None
    """On a step sampled by ``GuardConfig.numerics_every``: :meth:`ampguard.numerics.Numerics.measure`'s
    vector (zero fractions and headroom), taken before the gradients were unscaled. None otherwise."""
    scaled: bool = False
    """The fused fast path: the gradients are still scaled, ``found_inf`` comes from the norms,
    and the fused optimizer unscales (and clips) them in its kernel (:meth:`StepPipeline.measure`)."""


@dataclasses.dataclass(slots=True)
class HostCopy:
    """What a host decision reads, brought to the host in one copy (off the CPU: the step's one
    sync): the gathered matrix, this rank's per-tensor norms and sampled numerics (the report's
    part after the decision, in :func:`payload`'s order), and the scaler's scale and growth
    tracker (so the decision reads no device tensor one value at a time)."""

    gathered: torch.Tensor
    """``[world_size, LOCAL_K]`` float32, on the CPU."""
    report_part: torch.Tensor | None
    """gathered (flattened), norms, numerics: the payload after the decision (None on the CPU,
    where :func:`payload` builds it from the tensors themselves)."""
    view: ScalerView | None
    """The scaler's view, its scale and growth tracker as CPU tensors (None without a scaler)."""

    @classmethod
    def read(cls, gathered: torch.Tensor, measured: Measured | None, view: ScalerView | None,
             device: torch.device, *, copy: bool | None = None) -> HostCopy:
        """``copy``: bring the values over in one copy (default: unless they are on the CPU already;
        a test forces it on CPU tensors to run the path CUDA takes)."""
        if not (gathered.device.type != "cpu" if copy is None else copy):
            return cls(gathered, None, view)
        parts = (report_parts(gathered, measured.norms, measured.numerics) if measured is not None
                 else [gathered.reshape(-1).float()])
        n = sum(p.numel() for p in parts)
        # The growth tracker (< growth_interval) rides as a float32, exact up to 2**24; a larger
        # interval (not a realistic one) reads it on its own.
        exact = view is not None and view.growth_interval <= 2**24
        if view is not None:
            parts.append(view.scale.reshape(1).float())
            if exact:
                parts.append(view.growth_tracker.reshape(1).float())
        flat = torch.cat([p.to(device, non_blocking=True) for p in parts]).cpu()  # SYNC off the CPU: the one
        if view is not None:
            tracker = flat[n + 1 :].int() if exact else view.growth_tracker.reshape(1).cpu()
            view = ScalerView(flat[n : n + 1], tracker, view.growth_factor, view.backoff_factor, view.growth_interval)
        return cls(flat[: gathered.numel()].view(gathered.shape), flat[:n], view)


class DecisionGraph:
    """The decision, replayed from a CUDA graph on CUDA (``AMPGUARD_CUDA_GRAPH=0``: eager): ~70 tiny
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
                              "eagerly (set AMPGUARD_CUDA_GRAPH=0 to silence this)", RuntimeWarning,
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
        self._takes_grad_scaler = self.fused and _takes_grad_scaler(optimizer)
        """A fused optimizer of GradScaler's older protocol (``step(grad_scaler=...)``)."""
        switches = implementation_switches()  # AMPGUARD_* environment variables, read once per wrap
        self.fast_capable = (switches.fused_fast_path and adapter is not None and self.fused
                             and not self._takes_grad_scaler and getattr(backend, "name", None) in _FAST_BACKENDS
                             and adapter.fast_path_capable())
        """The fused fast path may be taken (each step also asks :meth:`fast_path`)."""
        self.host_decision = device.type == "cpu" or not self.fused
        """Decide on host floats (:func:`decide_host`): on CPU, where reading a tensor costs nothing
        and each tiny tensor op costs microseconds; and for a non-fused optimizer on any device,
        whose step synchronises anyway (to skip, the host must know the decision): there the
        gathered statistics come to the host in one copy, which is that step's one sync, instead
        of GradScaler's ``found_inf.item()`` after a decision taken on device. Fused optimizers
        off the CPU: the tensor path (no host sync)."""
        state_device = torch.device("cpu") if self.host_decision else device
        self.spikes = SpikeState.fresh(state_device)
        self.scale_state = ScaleState.fresh(state_device)
        """The decision's carried state lives where the decision is taken (host: no sync to read it)."""
        self.graph = DecisionGraph(switches.cuda_graph)
        self._host: tuple[torch.Tensor, list[float], HostCopy] | None = None
        """The last host decision: the tensor handed out, its values, and the step's host copy."""
        self.numerics = Numerics(config.numerics_every, device=device,
                                 headroom=adapter is not None and adapter.scaler.is_enabled())
        """The sampled fp16 numerics (``GuardConfig.numerics_every``)."""

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def fast_path(self, guard: object) -> bool:
        """Whether this step takes the fused fast path: a GradScaler (GradScaler's own unscaling,
        not a subclass's) with a fused optimizer of the current protocol, on a local or
        torch.distributed backend with unsharded gradients, the fast path not switched off,
        and nobody has unscaled this iteration."""
        return (self.fast_capable and not self.backend.grads_sharded
                and self.adapter.fast_path_ok(guard, self.optimizer))  # type: ignore[union-attr]

    def measure(self, guard: object, *, fast: bool = False, sample: bool = False) -> Measured:
        """Unscale (adopting an ``unscale_`` already done this iteration), check and measure the
        gradients: one read. ``guard``: the guarded optimizer (GradScaler may know it by its id).
        ``fast`` (only from ``step()``, never from ``unscale_()``, whose caller wants unscaled
        gradients): take the fused fast path where :meth:`fast_path` allows it. ``sample``: a step
        sampled by ``GuardConfig.numerics_every``: also measure the zero fractions and headroom
        (:mod:`ampguard.numerics`) of the still-scaled gradients, before they are unscaled."""
        if self.adapter is not None and self.adapter.shared:
            self.adapter.check_iteration()  # before anything changes: one step per guard and iteration
        if fast and self.fast_path(guard):
            measured = self._measure_scaled()
            if measured is not None:
                if sample:
                    measured.numerics = self.numerics.measure(measured.groups, self.optimizer.param_groups, None)
                return measured
        numerics = None
        if sample:
            # Before the unscale, unless somebody unscaled already: then max|scaled| = max|unscaled| * scale.
            unscaled = self.adapter is not None and not self.adapter.fast_path_ok(guard, self.optimizer)
            scale = self.adapter.scale if unscaled else None  # type: ignore[union-attr]
            _, numerics = self._sparse_tolerant(
                lambda gs: self.numerics.measure(gs, self.optimizer.param_groups, scale),
                grads_by_device_and_dtype(self.params()))
        found: dict[torch.device, torch.Tensor] = {}
        if self.adapter is not None:
            found = self.adapter.unscale(guard, self.optimizer)
        found_inf = None
        if len(found) == 1:
            (found_inf,) = found.values()
        elif found:
            found_inf = torch.stack([t.to(self.device, non_blocking=True).reshape(()) for t in found.values()]).sum()
        groups, norms = self._sparse_tolerant(lambda gs: per_tensor_norms(gs, self.device),
                                              grads_by_device_and_dtype(self.params()))
        return Measured(found, found_inf, groups, norms, numerics)

    def _sparse_tolerant(self, fn: Callable[[GradGroups], Any], groups: GradGroups) -> tuple[GradGroups, Any]:
        """``(groups, fn(groups))``; where ``fn`` fails because some gradients are sparse (no norm
        kernel takes them): their values (views, which clipping scales) and ``fn`` of their coalesced
        values (:func:`~ampguard.stats.sparse_values`), as GradScaler checks them. Dense gradients
        pay nothing for this (an exception handler)."""
        try:
            return groups, fn(groups)
        except RuntimeError:
            values = sparse_values(self.params())
            if values is None:
                raise
            views, coalesced = values
            return views, fn(coalesced)

    def _measure_scaled(self) -> Measured | None:
        """The fused fast path's measurement: per-tensor norms of the still-scaled gradients (the
        one read), times ``1/scale`` on device: with a power-of-two scale that is exact, so the
        norms (and the total) are bitwise those of the unscaled gradients, barring float32 over-
        or underflow. A non-finite norm is GradScaler's ``found_inf``; so is a norm that
        overflows float32 on finite scaled values (conservative: the step is skipped and the
        scale backed off, where GradScaler's element check would have stepped; the norm kernels
        sum squares in float32, so any scaled norm above sqrt(float32 max) ~ 1.8e19, i.e. an
        unscaled norm above 1.8e19/scale: 2.8e14 at scale 65536). None (take
        today's path) where there is no gradient or a float16 gradient (GradScaler refuses to
        unscale those: today's path raises its error). No sync."""
        adapter = self.adapter
        assert adapter is not None  # internal: fast_path() checked
        groups = grads_by_device_and_dtype(self.params())
        if not groups.index or any(dtype == torch.float16 for _, dtype in groups.tensors):
            return None
        try:
            norms = per_tensor_norms(groups, self.device)
        except RuntimeError:
            if sparse_values(self.params()) is None:
                raise
            return None  # sparse gradients, which no fused kernel takes: today's path, and torch's own error
        if self.device.type == "cpu":  # host floats: the same float32 values, no tensor op to make them
            norms = norms * adapter.inv_scale_host()
            bad = not all(math.isfinite(n) for n in norms.tolist())
            found = adapter.record_found_inf(self.optimizer, torch.full((), 1.0 if bad else 0.0))
        else:
            inv = adapter.inv_scale()
            norms = norms * inv.to(self.device, non_blocking=True)
            found = adapter.record_found_inf(self.optimizer, torch.isfinite(norms).all().logical_not())
        (found_inf,) = found.values()
        if found_inf.device != self.device:
            found_inf = found_inf.to(self.device, non_blocking=True)
        return Measured(found, found_inf, groups, norms, scaled=True)

    def gather(self, measured: Measured, loss: torch.Tensor | None, *, no_grads: bool = False,
               sentinel: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's statistics, all-gathered: ``[world_size, LOCAL_K]`` on device. collective:
        every rank gathers, also one whose backward reached no parameter (``no_grads``): the
        decision then skips the step on every rank. ``sentinel``:
        :meth:`ampguard.forensics.sentinel.Sentinel.value` (None: off)."""
        pack = local_vector_host if self.device.type == "cpu" else local_vector
        vec = pack(loss=loss, tensor_norms=measured.norms, found_inf=measured.found_inf,
                   pre_reduction=self.backend.pre_reduction_flags(), device=self.device, no_grads=no_grads,
                   sentinel=sentinel, headroom=None if measured.numerics is None else measured.numerics[1])
        return self.backend.all_gather(vec).wait()  # type: ignore[no-any-return]

    def decide(self, gathered: torch.Tensor,
               measured: Measured | None = None) -> tuple[torch.Tensor, torch.Tensor | int | None]:
        """The decision vector and the scaler's next growth tracker (None without a scaler; an
        int from the host decision). ``measured``: the step's measurement, whose norms (and
        sampled numerics) the host decision copies to the host with the gathered matrix."""
        view: ScalerView | None = self.adapter.view() if self.adapter is not None else None
        if self.host_decision:
            host = HostCopy.read(gathered, measured, view, self.device)  # off the CPU: the step's one sync
            values, tracker = decide_host(host.gathered, config=self.config, spikes=self.spikes,
                                          scale_state=self.scale_state, scaler=host.view,
                                          grads_sharded=self.backend.grads_sharded)
            decision = host_tensor(values)
            self._host = (decision, values, host)
            return decision, tracker

        def run(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return decide(g, config=self.config, spikes=self.spikes, scale_state=self.scale_state, scaler=view,
                          grads_sharded=self.backend.grads_sharded)

        key = None if view is None else (view.growth_factor, view.backoff_factor, view.growth_interval)
        return self.graph.run(run, gathered, key)  # type: ignore[no-any-return]

    def host_values(self, decision: torch.Tensor) -> list[float] | None:
        """The host decision's values when ``decision`` is the tensor it handed out, else None."""
        host = self._host
        return host[1] if host is not None and host[0] is decision else None

    def payload(self, decision: torch.Tensor, gathered: torch.Tensor, measured: Measured,
                indicators: torch.Tensor | None = None) -> torch.Tensor:
        """The step's report payload (:func:`payload`). After a host decision it is built on the
        host from the copy the decision read (no second copy, nothing to wait for); a sampled
        step's leading indicators, computed after the inner step, are then copied to the host
        (off the CPU: a wait for the inner step, on sampled steps only)."""
        host = self._host
        if host is None or host[0] is not decision or host[2].report_part is None:
            return payload(decision, gathered, measured.norms, measured.numerics, indicators)
        parts = [decision, host[2].report_part]
        if indicators is not None:
            parts.append(indicators.float().cpu())
        return torch.cat(parts)

    def clip(self, measured: Measured, decision: torch.Tensor) -> None:
        if not uses_clipping(self.config) or measured.scaled:
            return  # the fast path folds the coefficient into the fused optimizer's grad_scale
        host = self.host_values(decision)
        if host is not None and host[Dec.CLIP_COEF] == 1.0:
            return  # a multiply by 1 changes no value: skip the pass over the gradients
        coef = decision[Dec.CLIP_COEF]
        for grads in measured.groups.tensors.values():
            c, dev = coef, grads[0].device
            if c.device != dev:  # a host coefficient by a fill (the same float32 value): a copy would sync
                c = c.to(dev) if host is None else torch.full((), host[Dec.CLIP_COEF], dtype=c.dtype, device=dev)
            torch._foreach_mul_(grads, c)

    def inner_step(self, decision: torch.Tensor, measured: Measured) -> bool:
        """Step the inner optimizer unless the decision says skip. Returns whether it synced."""
        if not measured.groups.index:
            # No gradient on this rank: the decision skips everywhere (Loc.NO_GRADS), and there is
            # nothing to step here (GradScaler.step would refuse: it recorded no inf check).
            return False
        skip = decision[Dec.SKIP]
        if measured.scaled:
            self._step_scaled(decision, skip, measured)
            return False
        host = self.host_values(decision)
        if host is not None:
            return self._inner_step_host(host[Dec.SKIP] > 0, skip, measured)
        # The tensor decision: a fused optimizer off the CPU (non-fused ones decide on the host,
        # unless host_decision is turned off, as tests do to run both paths on the same inputs).
        inner = self.optimizer
        if self.adapter is not None:
            self.adapter.force_found_inf(measured.found_inf_per_device, skip)
            with self.backend.step_context(inner):
                self.adapter.step(inner)  # fused: found_inf read on device; non-fused: GradScaler's .item()
            return not self.fused
        if self.fused:
            self._step_fused(skip, None)
            return False
        if not skip.item():  # SYNC: what a non-fused optimizer needs to skip
            with self.backend.step_context(inner):
                inner.step()
        return True

    def _inner_step_host(self, skipped: bool, skip: torch.Tensor, measured: Measured) -> bool:
        """The inner step when the skip is a host bool (CPU): what GradScaler.step does, without
        what it does to learn the skip. Non-fused: its ``if not found_inf.item(): step()``, the
        answer known already. Fused: the kernel reads ``found_inf`` (GradScaler's per-call
        ``inspect.signature`` and ``found_inf`` sum are not needed). GradScaler's ``found_inf``
        still holds the skip; its ``update()``, next, resets its per-step records."""
        inner = self.optimizer
        if self.adapter is not None:
            self.adapter.force_found_inf(measured.found_inf_per_device, skipped)
            if self.fused and self._takes_grad_scaler:  # GradScaler's older protocol: let it step
                with self.backend.step_context(inner):
                    self.adapter.step(inner)
                return False
        if self.fused:  # stepped even when skipping, as GradScaler does (the kernel skips)
            # GradScaler.step on unscaled gradients passes on a grad_scale the caller set, or None
            self._step_fused(skip, getattr(inner, "grad_scale", None) if self.adapter is not None else None)
            return False
        if not skipped:
            with self.backend.step_context(inner):
                inner.step()
        return True

    def _step_scaled(self, decision: torch.Tensor, skip: torch.Tensor, measured: Measured) -> None:
        """The fast path's step: what GradScaler.step does for a fused optimizer whose gradients
        it did not unscale (``grad_scale = scale``, ``found_inf``), with the skip as ``found_inf``
        and the clip coefficient folded in: ``grad_scale = scale / clip_coef``. The kernel skips
        on device, or unscales, clips and updates in one pass. No sync."""
        adapter = self.adapter
        assert adapter is not None  # internal: measured.scaled
        adapter.force_found_inf(measured.found_inf_per_device, skip)  # GradScaler's record: the decision
        scale = adapter.scale
        grad_scale = scale
        if uses_clipping(self.config):
            host = self.host_values(decision)
            if host is None or host[Dec.CLIP_COEF] != 1.0:
                grad_scale = scale / decision[Dec.CLIP_COEF].to(scale.device, non_blocking=True)
        self._step_fused(skip, grad_scale)

    def _step_fused(self, found_inf: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        """A fused optimizer's step (``_step_supports_amp_scaling``): it skips in its kernel."""
        inner = self.optimizer
        inner.grad_scale = grad_scale  # type: ignore[attr-defined]
        inner.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            with self.backend.step_context(inner):
                inner.step()
        finally:
            del inner.grad_scale, inner.found_inf  # type: ignore[attr-defined]

    def update_scale(self, decision: torch.Tensor, tracker: torch.Tensor | int | None) -> None:
        """The next scale; on a GradScaler several guards share, this step's overflow and skip join
        the iteration's one update instead (:class:`~ampguard.scaling.SharedScaler`)."""
        adapter = self.adapter
        if adapter is None:
            return
        host = self.host_values(decision)
        if adapter.shared:
            if host is not None:
                adapter.contribute(host[Dec.GRAD_NONFINITE] > 0, host[Dec.SKIP] > 0)
            else:
                adapter.contribute(decision[Dec.GRAD_NONFINITE] > 0, decision[Dec.SKIP] > 0)
            return
        adapter.update(decision[Dec.NEXT_SCALE] if host is None else host[Dec.NEXT_SCALE], tracker)


_FAST_BACKENDS = ("local", "torch.distributed")
"""Backends the fast path is taken on (Horovod: today's path; untested there)."""


def _takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """GradScaler.step's own test, made once: does ``step`` take a ``grad_scaler`` argument?"""
    try:
        return "grad_scaler" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):  # no signature: let GradScaler decide, every step
        return True


def local_vector_host(*, loss: torch.Tensor | None, tensor_norms: torch.Tensor, found_inf: torch.Tensor | None,
                      pre_reduction: torch.Tensor | None, device: torch.device, no_grads: bool = False,
                      sentinel: torch.Tensor | None = None, headroom: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`ampguard.stats.local_vector` for the host decision (CPU tensors; ``device`` is the
    CPU): the same ``LOCAL_K`` float32 values, counted and packed on the host (no op packs them).
    The total norm is the same torch reduction (so it stays bitwise ``clip_grad_norm_``'s)."""
    total = torch.linalg.vector_norm(tensor_norms, 2.0).item() if tensor_norms.numel() else 0.0
    # A non-finite tensor norm makes the total non-finite: only then are they counted.
    nonfinite = 0 if math.isfinite(total) else sum(not math.isfinite(n) for n in tensor_norms.tolist())
    value = math.nan if loss is None else loss.item()
    return host_tensor([
        value,
        0.0 if loss is None or math.isfinite(value) else 1.0,
        total,
        float(nonfinite),
        0.0 if found_inf is None else f32(float(found_inf.item())),
        0.0 if pre_reduction is None else f32(float(pre_reduction.item())),
        1.0 if no_grads else 0.0,
        -1.0 if sentinel is None else f32(float(sentinel.item())),
        math.nan if headroom is None else f32(float(headroom.item())),
    ])


def host_tensor(values: list[float]) -> torch.Tensor:
    """A float32 CPU tensor of ``values`` (float32 values), over a fresh array of its own:
    ``torch.frombuffer`` costs about half of ``torch.tensor`` parsing a list."""
    return torch.frombuffer(array.array("f", values), dtype=torch.float32)


def payload(decision: torch.Tensor, gathered: torch.Tensor, norms: torch.Tensor,
            numerics: torch.Tensor | None = None, indicators: torch.Tensor | None = None) -> torch.Tensor:
    """Everything the host report needs from one step, in one float32 vector (one copy):
    decision, gathered matrix, per-tensor norms, then the sampled numerics (if any), then a sampled
    step's leading indicators (:mod:`ampguard.indicators`; the reporter takes them from the end)."""
    parts = [decision, *report_parts(gathered, norms, numerics)]
    if indicators is not None:
        parts.append(indicators)
    return torch.cat(parts)


def report_parts(gathered: torch.Tensor, norms: torch.Tensor, numerics: torch.Tensor | None) -> list[torch.Tensor]:
    """The report's part after the decision, in the order the reporter reads it: the gathered
    matrix (flattened), the per-tensor norms, a sampled step's numerics. :func:`payload` and
    :class:`HostCopy` both lay it out here."""
    parts = [gathered.reshape(-1).float(), norms]
    if numerics is not None:
        parts.append(numerics.to(norms.device))
    return parts


def grad_marks(params: Sequence[torch.Tensor]) -> list[Any]:
    """Which gradient tensors exist, and their autograd version counters: a backward that adds
    to a gradient, or replaces it, changes this. One attribute read per parameter, no sync."""
    return [None if (g := p.grad) is None else (id(g), g._version) for p in params]
