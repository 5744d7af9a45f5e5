"""One guarded step as named stages, each a method of :class:`StepPipeline`.

``measure`` → ``gather`` → ``decide`` → ``clip`` → ``inner_step`` → ``update_scale`` →
``payload``: a step carries a :class:`Measured` (the first and only read of the gradients) and a
:class:`Decision` (the decision vector, and the path it was taken on). Where the host waits for
the device (the only places it does; ``docs/design.md``, "One step, and where the host waits"):

1. ``backend.before_unscale``: Horovod's ``synchronize()`` (its own wait on the all-reduce).
2. unscale (GradScaler's fused unscale + check), per-tensor norms (one ``torch._foreach_norm``
   per (device, dtype) group; CPU float32: :func:`ampguard.stats.cpu_norms`). No sync.
3. gather: one collective of ``LOCAL_K`` floats per rank. NCCL: no host sync; gloo/CPU: blocking.
4. decide, on one of two paths picked once per guard (:attr:`StepPipeline.host_decision`):
   the tensor path (off the CPU: :func:`ampguard.policies.decide` on device, replayed from a CUDA
   graph on CUDA; no sync) or the host path (the CPU: the same rule on host floats,
   :func:`ampguard.policies.decide_host`, bit for bit the same decision; off the CPU, with
   ``AMPGUARD_UNFUSED_HOST_DECISION=1``, a non-fused optimizer's, from one copy of the statistics,
   :class:`ampguard.payload.HostCopy`, that step's one sync, as every non-fused step was before stop 55).
5. clip (``_foreach_mul_``), inner step or skip (the skip folded into GradScaler's ``found_inf``;
   fused optimizers read it on device; a non-fused optimizer's step reads the decision's skip flag
   first, its one sync, where GradScaler's ``found_inf.item()`` was), scale update.

The fused fast path (on; ``AMPGUARD_FUSED_FAST_PATH=0`` turns it off, tests only; :meth:`StepPipeline.fast_path`
says when)
reads the **still-scaled** gradients once: per-tensor norms times ``1/scale`` on device (exact for
a power-of-two scale; a norm that overflows float32, a scaled norm above ~1.8e19, counts as
non-finite: skipped and backed off, conservatively), ``found_inf`` := some norm is non-finite,
recorded as GradScaler's own; the fused optimizer gets ``grad_scale = scale`` (``scale /
clip_coef`` when clipping) and ``found_inf = skip``, as ``GradScaler.step`` hands them, and
unscales, clips and updates in its kernel, or skips there: one read of the gradients before the
optimizer's pass instead of three, and ``.grad`` afterwards is the plain fused loop's.

Non-fused optimizers off the CPU (:attr:`StepPipeline.unfused_fast`, the same switch) are measured as on the fused
fast path (the decision in the same replay), and once the skip flag is read, one ``_foreach_mul_`` by GradScaler's
``1/scale`` unscales their gradients (its values) before the optimizer's own step; a finite gradient whose squares
overflow float32 is skipped there, conservatively, as on the fused fast path.

Non-fused optimizers on the CPU (:attr:`StepPipeline.norms_first`, the same switch) read the norms
from the still-scaled gradients too, unscaling each gradient by GradScaler's ``1/scale`` (its values) right
after its norm, and record GradScaler's stage as its ``unscale_`` would; a step whose scaled
norms are not all finite is handed to GradScaler's element check (today's path), so a finite
gradient whose squares overflow float32 is stepped on, as in the plain loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import inspect
import math
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .backends.base import Backend
from .config import GuardConfig
from .decision_graph import DecisionGraph, MeasureGraph
from .numerics import Numerics
from .ops import capturing, f32
from .payload import HostCopy, Landing, Layout, Packed, Unpacked, pack, pinned_view, unpacked_on_host
from .policies import SpikeState, decide, decide_host, uses_clipping
from .scaling import GradScalerAdapter, ScalerView, ScaleState
from .stats import (
    Dec,
    GradGroups,
    all_strided,
    cpu_norms,
    grads_by_device_and_dtype,
    host_tensor,
    local_vector,
    per_tensor_norms,
    sparse_values,
    total_and_nonfinite,
)
from .switches import implementation_switches

__all__ = ["Decision", "Measured", "StepPipeline", "first_ref", "grad_marks", "marks_after_step", "marks_changed"]


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
    """The fast path: the gradients are still scaled, ``found_inf`` comes from the norms, and the fused optimizer
    unscales (and clips) them in its kernel (:meth:`StepPipeline.measure`), or a non-fused one's step unscales them
    first (:meth:`StepPipeline._step_unscaling`, which sets this back to False)."""
    clip_norm: float | None = None
    """``GuardedOptimizer.clip_grad_norm_``'s ``max_norm`` this step (None: not called): the decision
    clips to it as to ``GuardConfig.clip_grad_norm`` (on the fast path folded into ``grad_scale``)."""
    reductions: tuple[torch.Tensor, torch.Tensor] | None = None
    """``(total norm, count of non-finite norms)`` of ``norms``, made with them on the fast path off the CPU
    (in the measurement's graph) for :func:`~ampguard.stats.local_vector`; None: it makes them."""
    clip_applied: bool = False
    """The clip to ``clip_norm`` was already applied to ``.grad`` (torch's ``clip_grad_norm_``): the
    decision still reports its coefficient, the clip stage does not apply it again."""
    gathered: torch.Tensor | None = None
    """The gathered matrix, where the measurement went on to the decision (:meth:`StepPipeline.measure`'s
    ``decide``: one replay from the gradients to the decision); None: :meth:`StepPipeline.gather` makes it."""
    decided: Decision | None = None
    """The step's decision, made with :attr:`gathered`; None: :meth:`StepPipeline.decide` takes it."""
    host_flat: torch.Tensor | None = None
    """The host decision's copy, made on device with :attr:`gathered` (:meth:`ampguard.payload.HostCopy.flat`), in
    the step graph's replay: :meth:`StepPipeline.decide` brings it to the host in one copy. None: it makes it."""


@dataclasses.dataclass(slots=True)
class Decision:
    """One step's decision, and the path it was taken on: decided once, in
    :meth:`StepPipeline.decide`; every later stage reads the path from here."""

    vector: torch.Tensor
    """The decision vector (:class:`~ampguard.stats.Dec`): on device on the tensor path, a CPU
    tensor of :attr:`host` on the host path."""
    tracker: torch.Tensor | int | None
    """The scaler's next growth tracker (None without a scaler; an int on the host path)."""
    host: list[float] | None = None
    """The host decision's values (:func:`~ampguard.policies.decide_host`); None on the tensor path."""
    copied: HostCopy | None = None
    """The host decision's one copy, whose statistics the step's payload reuses."""
    grad_scale: torch.Tensor | None = None
    """The fused optimizer's ``grad_scale`` (the scale this step was measured at, divided by the clip coefficient
    when clipping), made in the step graph's replay, which also wrote the next scale and growth tracker into
    GradScaler's own tensors (:meth:`StepPipeline.update_scale` then clears its per-iteration records only);
    None: made by :meth:`StepPipeline.inner_step`, the scale set by :meth:`StepPipeline.update_scale`."""
    unscale_by: torch.Tensor | None = None
    """A non-fused optimizer's :attr:`grad_scale`: GradScaler's ``1/scale`` at the scale this step was measured at,
    made in the step graph's replay before it wrote the next scale (:meth:`StepPipeline._step_unscaling` unscales
    the gradients by it); None: off the step graph (the scale is read then), or a fused optimizer."""
    learnt: bool | None = None
    """The skip, learnt on the host by a non-fused optimizer's step on the tensor path (its one sync: the flag read
    before the optimizer steps, where GradScaler's ``found_inf.item()`` was); None before that, and elsewhere."""
    packed: Packed | None = None
    """The step's payload as :func:`~ampguard.payload.pack` makes it without the optional parts (no sampled
    numerics, indicators, parameter check or fp8 rows), made in the same replay as the decision (the step graph);
    :meth:`StepPipeline.payload` takes it on a step with none of those parts. A graph's output, rewritten by the
    next replay: the reporter copies it into pinned memory before that (stream order); on the CPU (tests), where
    the reporter keeps a payload as it is, it is cloned."""
    early: tuple[torch.Tensor, Any] | None = None
    """``(flag, event)``: the step graph's early skip flag (``AMPGUARD_EARLY_SKIP``, a non-fused optimizer on CUDA): a
    pinned 1-element buffer the replay copies the skip into as soon as the rule made it, and the external event it
    records there; :meth:`StepPipeline._learn_skip` waits on the event, not for the whole graph. None: off."""
    landing: Landing | None = None
    """Where the step graph copied :attr:`packed` to the host itself, with the early flag (``AMPGUARD_EARLY_SKIP``):
    the reporter reads its floats, no copy of its own launched. None: off."""
    packed_host: torch.Tensor | None = None
    """:attr:`packed`'s vector, on the host: a non-fused optimizer's skip read (:meth:`StepPipeline._learn_skip`)
    copies the whole payload, where it read the one flag (the same one sync), so the reporter has nothing to copy,
    no event to record, and no optimizer kernel to wait behind. None: not copied. Unused on a step whose payload
    gets more parts after the inner step (a parameter check's, sampled indicators, fp8 rows): packed anew then."""

    @property
    def skipped(self) -> bool | None:
        """The skip as a host bool on the host path, and on the tensor path once a non-fused optimizer's step learnt
        it (:attr:`learnt`); None on the tensor path before that, and with a fused optimizer (no sync to learn it)."""
        return self.learnt if self.host is None else self.host[Dec.SKIP] > 0

    @property
    def wrote_scale(self) -> bool:
        """The step graph wrote the next scale and growth tracker into GradScaler's own tensors."""
        return self.grad_scale is not None or self.unscale_by is not None


class StepPipeline:
    """The stages of one guarded step. Holds the on-device state the decision carries from
    step to step (spike averages, hysteresis run); nothing here reads a value to the host
    except where the module docstring says."""

    def __init__(
        self,
        *,
        optimizer: torch.optim.Optimizer,
        adapter: GradScalerAdapter | None,
        backend: Backend,
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
        self.norms_first = (switches.fused_fast_path and adapter is not None and not self.fused
                            and device.type == "cpu" and getattr(backend, "name", None) in _FAST_BACKENDS
                            and adapter.fast_path_capable())
        """A non-fused optimizer on the CPU (each step also asks :meth:`fast_path`): the norms are read
        from the still-scaled gradients fresh from the backward, ``found_inf`` taken from them as on the fast
        path, and each gradient is multiplied by ``1/scale`` right after its norm (the values GradScaler's
        unscale gives; :meth:`_measure_scaled`'s ``unscale``): one read fewer than GradScaler's check-and-unscale
        followed by the norms (-74 to -137 us a step on the CPU MLPs, benchmarks/RESULTS.md, "Stop 36"), and
        the multiply while the gradient is in cache (-132 to -152 us on mlp-small, "Stop 67")."""
        self.host_decision = device.type == "cpu" or (not self.fused and switches.unfused_host_decision)
        """Decide on host floats (:func:`decide_host`): on CPU, where reading a tensor costs nothing
        and each tiny tensor op costs microseconds. Off the CPU the tensor path, fused optimizers or not: a non-fused
        one learns the skip after the decision, in one read of its flag (that step's one sync, where GradScaler's
        ``found_inf.item()`` was), which the decision in the step graph's replay makes cheaper on the host than the
        host decision's copy of the statistics and its Python (stop 55); ``AMPGUARD_UNFUSED_HOST_DECISION=1`` gives
        a non-fused optimizer the host decision, as before stop 55, for benchmarks."""
        self.unfused_fast = (switches.fused_fast_path and adapter is not None and not self.fused
                             and not self.host_decision and getattr(backend, "name", None) in _FAST_BACKENDS
                             and adapter.fast_path_capable())
        """A non-fused optimizer off the CPU with a GradScaler (each step also asks :meth:`fast_path`): measured as on
        the fused fast path (the still-scaled gradients' norms, ``found_inf`` from them, the decision in the step
        graph's replay where :meth:`_decides_through` allows); the skip then learnt on the host, and the gradients
        unscaled by GradScaler's ``1/scale`` and clipped, each by one ``_foreach_mul_``, before the optimizer's own
        step (:meth:`_step_unscaling`): the values of the plain loop's ``unscale_`` and ``clip_grad_norm_``."""
        self.host_copies = device.type != "cpu"
        """The host decision reads device tensors: the statistics come over in one copy (:class:`HostCopy`), the
        local vector is made on device and the payload packed from the copy. Off on the CPU, where the host path
        reads them as they are; tests turn it on there to run the path CUDA takes."""
        state_device = torch.device("cpu") if self.host_decision else device
        self.spikes = SpikeState.fresh(state_device)
        self.scale_state = ScaleState.fresh(state_device)
        """The decision's carried state lives where the decision is taken (host: no sync to read it)."""
        self._params: tuple[list[tuple[list[torch.Tensor], int]], list[torch.Tensor]] | None = None
        self._param_ids: tuple[list[torch.Tensor], frozenset[int]] | None = None
        self.graph = DecisionGraph(switches.cuda_graph)
        self.measure_graph = MeasureGraph(switches.cuda_graph)
        """The fast path's measurement, replayed over gradients that lie where they lay (CUDA)."""
        self.step_graph = MeasureGraph(switches.cuda_graph and switches.step_graph,
                                       "the step from the gradients to the decision", "AMPGUARD_STEP_GRAPH=0")
        """The fast path from the gradients to the decision in one replay (:meth:`measure`'s ``decide``): graphs of
        their own, so that a failure there leaves :attr:`measure_graph` as it was."""
        self.param_graph = MeasureGraph(switches.cuda_graph, "the parameter check")
        """The parameter check's max|p| (``GuardConfig.param_check_every``), replayed where the parameters lie
        (:meth:`params_graphable`): an optimizer updates them in place, so they lie where they lay."""
        self._graphable: tuple[list[torch.Tensor], bool] | None = None
        self._step_graph_rested = 0
        """Steps the step graph was not tried since it missed :data:`STEP_GRAPH_MISSES` runs in a row."""
        self._held: dict[str, torch.Tensor] = {}
        """The step graph's own buffers for its 0-d inputs that somebody else allocates each step (:meth:`_hold`)."""
        self._scalar: torch.Tensor | None = None
        """:meth:`_host_scalar`'s buffer."""
        self.fused_rule = switches.fused_rule
        """The step graph's :meth:`_tail` compiled into a few kernels (``AMPGUARD_FUSED_RULE``, :meth:`_decided`)."""
        self._compiled_tail: Callable[..., Any] | None = None
        self._compile_failed = False
        self.fused_rule_capture_misses = 0
        """Captures of the step graph whose compiled tail missed dynamo's cache and so recorded the tail op by op (its
        replays then run the ~45 small kernels the rule would fuse). 0 where the rule ran compiled in every capture."""
        self.early_skip = switches.early_skip and not self.fused and device.type == "cuda"
        """The step graph hands a non-fused step its skip flag before it ends (``AMPGUARD_EARLY_SKIP``:
        :attr:`Decision.early`)."""
        self._landing_slots: dict[int, tuple[Any, ...]] = {}
        """With the early flag: the payload's pinned buffer and external event by its count of norms (which sizes the
        payload: :class:`Landing`), made outside any capture, shared by every graph and eager run of that size."""
        self._landing: Landing | None = None
        """The last run's landing, filled before the next run overwrites its pinned buffer."""
        self._early_pair: tuple[tuple[torch.Tensor, Any], Callable[[torch.Tensor], None]] | None = None
        """:meth:`_early_flag`'s answer, made once (outside any capture), shared by every graph and eager run: each
        run's flag is read before the next run is launched."""
        self._clip_configs: dict[float, GuardConfig] = {}
        self.numerics = Numerics(config.numerics_every, device=device,
                                 headroom=adapter is not None and adapter.scaler.is_enabled())
        """The sampled fp16 numerics (``GuardConfig.numerics_every``)."""

    def config_for(self, measured: Measured) -> GuardConfig:
        """The configuration this step decides with: the guard's, with ``clip_grad_norm`` set to a
        ``clip_grad_norm_`` call's ``max_norm`` (one cached config per value: no validation per step)."""
        norm = measured.clip_norm
        if norm is None:
            return self.config
        config = self._clip_configs.get(norm)
        if config is None:
            config = self._clip_configs[norm] = dataclasses.replace(self.config, clip_grad_norm=norm)
        return config

    def params(self) -> list[torch.Tensor]:
        """The optimizer's parameters, in ``param_groups`` order: one list, made again only when the groups'
        ``params`` lists are other lists or of other lengths (``add_param_group``, a group's list replaced or
        grown); the lists are held, so a list's identity is never another's. Several calls a step: rebuilding
        it cost ~20 us each on GPT-2 350M's 292 parameters (the H200's host). Read it, never change it."""
        lists = [group["params"] for group in self.optimizer.param_groups]
        cached = self._params
        if (cached is None or len(lists) != len(cached[0])
                or any(a is not b or len(a) != n for a, (b, n) in zip(lists, cached[0]))):
            flat = [p for ps in lists for p in ps]
            self._params = cached = ([(ps, len(ps)) for ps in lists], flat)
        return cached[1]

    def params_graphable(self) -> bool:
        """Whether :attr:`param_graph` may replay a function of :meth:`params`: CUDA, the graph usable, and every
        parameter a plain ``Parameter`` (no DTensor shard, whose address is its local tensor's, no subclass),
        non-empty, on the guard's device (a capture is made there); checked again only when that list is made
        again. Their dtypes are in the graph's key (a parameter's dtype can change under it: ``model.to``)."""
        graph, params = self.param_graph, self.params()
        if not graph.enabled or graph.failed or not graph.capturable(self.device):
            return False
        cached = self._graphable
        if cached is None or cached[0] is not params:
            device = self.device
            ok = bool(params) and all(type(p) is torch.nn.Parameter and p.numel() > 0 and p.device == device
                                      for p in params)
            self._graphable = cached = (params, ok)
        return cached[1]

    def param_ids(self) -> frozenset[int]:
        """The ``id`` of every parameter of :meth:`params`, made again only when that list is made again: a
        ``clip_grad_norm_`` call compares the parameters it is given with them each step (a set of ~290 ids
        costs ~13 us on the 2-core CPU)."""
        params = self.params()
        cached = self._param_ids
        if cached is None or cached[0] is not params:
            self._param_ids = cached = (params, frozenset(map(id, params)))
        return cached[1]

    def fast_path(self, guard: object) -> bool:
        """Whether this step measures the still-scaled gradients: the fused fast path (a GradScaler,
        GradScaler's own unscaling, not a subclass's, with a fused optimizer of the current protocol)
        or, for a non-fused optimizer on the CPU, :attr:`norms_first`; on a local or torch.distributed
        backend with unsharded gradients, the fast path not switched off, and nobody has unscaled
        this iteration."""
        return ((self.fast_capable or self.norms_first or self.unfused_fast) and not self.backend.grads_sharded
                and self.adapter.fast_path_ok(guard, self.optimizer))  # type: ignore[union-attr]

    def measure(self, guard: object, *, fast: bool = False, sample: bool = False, decide: bool = False,
                loss: torch.Tensor | None = None, fp8: torch.Tensor | None = None,
                sentinel: torch.Tensor | None = None) -> Measured:
        """Unscale (adopting an ``unscale_`` already done this iteration), check and measure the
        gradients: one read. ``guard``: the guarded optimizer (GradScaler may know it by its id).
        ``fast`` (only from ``step()``, never from ``unscale_()``, whose caller wants unscaled
        gradients): take the fused fast path where :meth:`fast_path` allows it. ``sample``: a step
        sampled by ``GuardConfig.numerics_every``: also measure the zero fractions and headroom
        (:mod:`ampguard.numerics`) of the still-scaled gradients, before they are unscaled.

        ``decide`` (from ``step()``, where the step's local vector would hold nothing but ``loss``, the
        measurement, ``fp8``, ``sentinel`` and constants: fresh gradients, no parameter flag): on the fast
        path with the tensor decision, one rank and the local backend, go on to the local vector and the decision
        in the same execution, replayed as one CUDA graph (:meth:`_through_decision`), into
        :attr:`Measured.gathered` and :attr:`Measured.decided`; the same values as :meth:`gather` then
        :meth:`decide`. Without a GradScaler (bf16, fp32) the same from the gradients as they are. Elsewhere, or
        with ``AMPGUARD_STEP_GRAPH`` off, those stay None. ``fp8``: the fp8 monitor's non-finite flag
        (:meth:`ampguard.fp8.Fp8Monitor.nonfinite`; None: monitoring off) and ``sentinel``, the sentinel's value
        (:meth:`ampguard.forensics.sentinel.Sentinel.value`; None: no sentinel), each of which the step graph reads
        from its own buffer (:meth:`_hold`)."""
        if self.adapter is not None and self.adapter.shared:
            self.adapter.check_iteration()  # before anything changes: one step per guard and iteration
        if fast and self.fast_path(guard):
            # the tensor decision (a fused optimizer off the CPU): the measurement goes on to it
            through = (loss, fp8, sentinel) if decide and not sample and not self.host_decision \
                and self._decides_through(loss) \
                else None
            # a sampled step's numerics read the still-scaled gradients: unscaled after them, not with the norms
            measured = self._measure_scaled(norms_first=self.norms_first, through=through, unscale=not sample)
            if measured is not None:
                if sample:
                    measured.numerics = self.numerics.measure(measured.groups, self.optimizer.param_groups, None)
                if self.norms_first and measured.scaled:  # a non-fused optimizer steps on unscaled gradients
                    inv = self._host_scalar(self.adapter.inv_scale_host())  # type: ignore[union-attr]
                    for grads in measured.groups.tensors.values():
                        torch._foreach_mul_(grads, inv)
                    measured.scaled = False
                return measured
        if decide and not sample and self.adapter is None and not self.host_decision and self._decides_through(loss):
            measured = self._through_unscaled(loss, fp8, sentinel)  # bf16/fp32: nothing to unscale
            if measured is not None:
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
        if decide and numerics is None and self.host_decision and self.host_copies and self._decides_through(loss):
            measured = self._through_host_copy(found, found_inf, loss, fp8, sentinel)  # AMPGUARD_UNFUSED_HOST_DECISION
            if measured is not None:
                return measured
        groups, (norms, reductions) = self._sparse_tolerant(self._norms, grads_by_device_and_dtype(self.params()))
        return Measured(found, found_inf, groups, norms, numerics, reductions=reductions)

    def _norms(self, groups: GradGroups) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The gradients' per-tensor norms on the guard's device and, off the CPU,
        :attr:`Measured.reductions` (:meth:`_replayed`). No sync."""
        if self.device.type == "cpu":
            return per_tensor_norms(groups, self.device), None
        return self._replayed("norms", functools.partial(self._norms_of, groups), groups)  # type: ignore[no-any-return]

    def _norms_of(self, groups: GradGroups) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The kernels of :meth:`_norms` (and of the step graph's unscaled sides): the per-tensor norms and
        their reductions, eagerly or under a capture."""
        norms = per_tensor_norms(groups, self.device)
        return norms, total_and_nonfinite(norms)

    def _replayed(self, kind: Any, measure: Callable[[], Any], groups: GradGroups,
                  scale: torch.Tensor | None = None, graphs: MeasureGraph | None = None) -> Any:
        """``measure()``, replayed from :class:`~ampguard.decision_graph.MeasureGraph` (``graphs``; default
        :attr:`measure_graph`) where the gradients are one group of plain tensors on the guard's device (the usual
        case; with ``scale``, on its device too), eagerly otherwise."""
        if len(groups.tensors) == 1 and groups.own:
            ((dev, _), grads), = groups.tensors.items()
            if dev == self.device and (scale is None or scale.device == dev):
                return (self.measure_graph if graphs is None else graphs).run(kind, measure, grads, scale)
        return measure()

    def _decides_through(self, loss: torch.Tensor | None) -> bool:
        """Whether this step's measurement may go on through the step graph (:meth:`measure`'s ``decide``; each
        caller adds its own path: the fused fast path or no GradScaler with the tensor decision, or the host
        decision's copy made from device tensors): the step graph switched on, its capture not failed; not a
        non-fused CPU optimizer's norms-first measurement; a GradScaler, if any, that no other guard shares (the
        step writes its next scale, or copies its found_inf); the local backend (one rank: its gather is the vector
        itself); a loss the graph can read (a float32 0-d tensor on the guard's device, as
        :class:`~ampguard.stats.LossMeter` keeps it; copied into the graph's buffer: :meth:`_hold`); and not
        resting after :data:`STEP_GRAPH_MISSES` runs in a row without a replay (gradients that move every step: run
        eagerly it would cost more than the stages' own graphs, the measurement's and the decision's, which then
        take over: :meth:`_step_graph_due`)."""
        graphs = self.step_graph  # not taken where it failed, or while it rests: the stages' own graphs then
        return (graphs.enabled and not graphs.failed and not self.norms_first
                and (self.adapter is None or not self.adapter.shared)
                and getattr(self.backend, "name", None) == "local"
                and (loss is None or (loss.device == self.device and loss.dtype == torch.float32
                                      and loss.dim() == 0))
                and self._step_graph_due())

    def _step_graph_due(self) -> bool:
        """The last of :meth:`_decides_through`'s conditions (asked once a step, where every other holds): yes
        until :data:`STEP_GRAPH_MISSES` runs in a row missed (keys that do not repeat: gradients that move, or an
        allocator still settling in a run's first steps, fp16's overflowing ones among them); then no for
        :data:`STEP_GRAPH_REST` steps (the stages' own graphs), then :data:`STEP_GRAPH_PROBES` more tries: a key
        seen twice among them is captured and replayed, and the step graph is taken again. (Before stop 41 a guard
        gave it up for good: on an H100 the fp16 foreach step graph, whose first steps overflowed, never ran.)"""
        graphs = self.step_graph
        if graphs.misses < STEP_GRAPH_MISSES:
            return True
        self._step_graph_rested += 1
        if self._step_graph_rested < STEP_GRAPH_REST:
            return False
        self._step_graph_rested = 0
        graphs.try_again(STEP_GRAPH_PROBES, after=STEP_GRAPH_MISSES)
        return True

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

    def _measure_scaled(self, norms_first: bool = False, through: tuple[torch.Tensor | None, ...] | None = None,
                        unscale: bool = False) -> Measured | None:
        """The fused fast path's measurement: per-tensor norms of the still-scaled gradients (the
        one read), times ``1/scale`` on device: with a power-of-two scale that is exact, so the
        norms (and the total) are bitwise those of the unscaled gradients, barring float32 over-
        or underflow. A non-finite norm is GradScaler's ``found_inf``; so is a norm that
        overflows float32 on finite scaled values (conservative: the step is skipped and the
        scale backed off, where GradScaler's element check would have stepped; the norm kernels
        sum squares in float32, so any scaled norm above sqrt(float32 max) ~ 1.8e19, i.e. an
        unscaled norm above 1.8e19/scale: 2.8e14 at scale 65536). None (take
        today's path) where there is no gradient or a float16 gradient (GradScaler refuses to
        unscale those: today's path raises its error). ``norms_first`` (:attr:`norms_first`, a non-fused
        CPU optimizer, whose step the caller unscales next): also None where a gradient is not a float32
        CPU tensor, and where a scaled norm is not finite (before anything is recorded): GradScaler's
        element check then decides on today's path, as in the plain loop (a finite gradient whose squares
        overflow float32 is stepped on, as torch's ``test_grad_scale_will_not_overflow`` has it); that
        step reads the gradients twice. ``unscale`` (with ``norms_first`` and a ``1/scale`` of at most 1): unscale
        each gradient right after its norm is read (:func:`~ampguard.stats.cpu_norms`'s ``unscale_by``), the
        :class:`Measured` then not ``scaled``; a step whose norms are not all finite then takes GradScaler's element
        check on the unscaled gradients, which finds exactly what it finds on the scaled ones (a multiply by
        ``0 < 1/scale <= 1`` keeps a finite value finite and a non-finite one non-finite), recorded as its
        ``unscale_`` records it, and today's path adopts that record. ``through``: ``(loss, fp8, sentinel)``, go on
        to the decision (:meth:`measure`'s ``decide``, off the host decision only). No sync."""
        adapter = self.adapter
        assert adapter is not None  # internal: fast_path() checked
        groups = grads_by_device_and_dtype(self.params())
        if not groups.index or any(dtype == torch.float16 for _, dtype in groups.tensors):
            return None
        if norms_first and any(dev.type != "cpu" or dtype != torch.float32 for dev, dtype in groups.tensors):
            return None
        on_host = self.device.type == "cpu" and through is None  # through: the tensor decision (tests: on the CPU)
        decided = None
        inv_host = adapter.inv_scale_host() if on_host else 1.0
        # norms_first: every gradient a float32 CPU tensor, so one group; a sparse one goes to today's path (below)
        # with every gradient as it was: not unscaled as it goes
        unscaled = (on_host and norms_first and unscale and 0.0 < inv_host <= 1.0 and len(groups.tensors) == 1
                    and all_strided(next(iter(groups.tensors.values()))))
        try:
            if unscaled:
                (grads,) = groups.tensors.values()
                norms = cpu_norms(grads, unscale_by=self._host_scalar(inv_host))
            elif on_host:
                norms = per_tensor_norms(groups, self.device)
            elif through is not None:  # and the local vector and the decision: one replay from the gradients
                norms, found_inf, reductions, gathered, decided = self._through_decision(groups, adapter, *through)
            else:  # times 1/scale, found_inf and the reductions: one graph replay where the gradients lie
                norms, found_inf, reductions = self._scaled_norms(groups, adapter)
        except RuntimeError:
            if sparse_values(self.params()) is None:
                raise
            return None  # sparse gradients, which no fused kernel takes: today's path, and torch's own error
        if on_host:  # host floats: the same float32 values, no tensor op to make them
            norms = norms * inv_host
            bad = not math.isfinite(sum(norms.tolist()))  # a NaN or Inf makes the sum one (norms >= 0, no overflow)
            if norms_first:
                if bad:  # GradScaler's element check decides (today's path)
                    if unscaled:  # on the gradients unscaled already: its record, which today's path adopts
                        adapter.check_unscaled(self.optimizer)
                    return None
                found = adapter.record_unscaled(self.optimizer, torch.zeros(()))  # unscaled next, by the caller
            else:
                found = adapter.record_found_inf(self.optimizer, torch.full((), 1.0 if bad else 0.0))
        else:
            found = adapter.record_found_inf(self.optimizer, found_inf)
        (found_inf,) = found.values()
        if found_inf.device != self.device:
            found_inf = found_inf.to(self.device, non_blocking=True)
        measured = Measured(found, found_inf, groups, norms, scaled=not unscaled,
                            reductions=None if on_host else reductions)
        if decided is not None:
            measured.gathered, measured.decided = gathered, decided
        return measured

    def _scaled_norms(self, groups: GradGroups, adapter: GradScalerAdapter
                      ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Off the CPU: the still-scaled gradients' per-tensor norms times ``1/scale`` (GradScaler's
        reciprocal), ``found_inf`` (float32, 0-d, on the scale's device) := one of them is not finite, and
        :attr:`Measured.reductions` (the total norm, the count of non-finite norms: the local vector's ops;
        ``found_inf`` is that count > 0) (:meth:`_replayed`). No sync."""
        measure = functools.partial(self._scaled_norms_of, groups, adapter)
        return self._replayed("scaled", measure, groups, adapter.scale)  # type: ignore[no-any-return]

    def _scaled_norms_of(self, groups: GradGroups, adapter: GradScalerAdapter, inv: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The kernels of :meth:`_scaled_norms` (and of the step graph's fast path), eagerly or under a capture.
        ``inv``: ``adapter.inv_scale()``, made already (the step graph's, which a non-fused step also unscales by);
        None: made here."""
        device = self.device
        inv = adapter.inv_scale() if inv is None else inv
        norms = per_tensor_norms(groups, device) * inv.to(device, non_blocking=True)
        total, count = total_and_nonfinite(norms)
        # count > 0 as 0.0 or 1.0 (a count: an integer >= 0): one kernel where gt and a cast are two
        found = count.clamp(max=1.0).to(adapter.scale.device, non_blocking=True).reshape(())
        return norms, found, (total, count)

    def _host_scalar(self, value: float) -> torch.Tensor:
        """``value`` in a 0-d float32 CPU tensor the pipeline keeps (one fill a step): ``_foreach_mul_`` by a tensor
        is the same float32 multiply as by a Python float (the float is rounded to float32 first: ``value`` already is)
        and took 59 us where the float took 78 on mlp-small's 8 gradients on the 2-core CPU (the float is wrapped
        into a tensor once per gradient; stop 56, ``benchmarks/results/cpu_stop56/``). Used at once, by the caller's
        multiply: the next call refills it."""
        buf = self._scalar
        if buf is None:
            buf = self._scalar = torch.zeros((), dtype=torch.float32)
        return buf.fill_(value)

    def _hold(self, slot: str, value: torch.Tensor | None) -> torch.Tensor | None:
        """``value``, a float32 0-d tensor that somebody else allocates each step (the loss, which the user's forward
        makes; GradScaler's ``found_inf``, a new tensor each ``unscale_``; the fp8 monitor's flag), copied into the step
        graph's own buffer for ``slot``, which the graph reads: a graph keyed by such a tensor's address replays only
        where the allocator happens to give the same place back (stop 40: GradScaler's ``found_inf`` never did on CUDA,
        and the fp16 foreach step graph was never captured; stop 41: with the loss's address in the key, the step
        graph's keys cycled over more places than it keeps graphs). One small copy a step. None stays None."""
        if value is None:
            return None
        buf = self._held.get(slot)
        if buf is None or buf.device != value.device:
            buf = self._held[slot] = torch.zeros((), dtype=torch.float32, device=value.device)
        buf.copy_(value)
        return buf

    def _local_gathered(self, loss: torch.Tensor | None, norms: torch.Tensor, total: torch.Tensor,
                        count: torch.Tensor, found_inf: torch.Tensor | None,
                        fp8: torch.Tensor | None = None, sentinel: torch.Tensor | None = None) -> torch.Tensor:
        """Inside the step graph: the local vector of ``loss``, the measurement, ``fp8`` (the fp8 monitor's
        non-finite flag, held: None without fp8 monitoring) and ``sentinel`` (the sentinel's value, held: None
        without a sentinel), as :meth:`gather` makes it for a fresh step with no parameter flag, by device ops (as
        they are captured), and the local backend's gather of it (the vector as the one row)."""
        vec = local_vector(loss=loss, tensor_norms=norms, reductions=(total, count), found_inf=found_inf,
                           pre_reduction=self.backend.pre_reduction_flags(), device=self.device, host=False,
                           fp8=fp8, sentinel=sentinel)
        return self.backend.all_gather(vec).wait()  # type: ignore[no-any-return]

    def _replayed_step(self, kind: Any, measure: Callable[[GradGroups], Any],
                       scale: torch.Tensor | None = None) -> tuple[GradGroups, Any] | None:
        """The gradients, grouped, and ``measure()`` over them, replayed from :attr:`step_graph` (:meth:`_replayed`).
        None where there is nothing to measure or some gradient is sparse or sharded (no norm kernel takes it:
        :meth:`measure`'s own path). ``measure`` takes the groups."""
        groups = grads_by_device_and_dtype(self.params())
        if not groups.index or not groups.own:
            return None
        try:
            return groups, self._replayed(kind, lambda: measure(groups), groups, scale, self.step_graph)
        except RuntimeError:
            if sparse_values(self.params()) is None:
                raise
            return None  # sparse gradients: measure()'s own path, which measures their values

    def _through_decision(self, groups: GradGroups, adapter: GradScalerAdapter, loss: torch.Tensor | None,
                          fp8: torch.Tensor | None = None, sentinel: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor,
                                     Decision]:
        """:meth:`_scaled_norms`, then the local vector (:func:`~ampguard.stats.local_vector` of ``loss``, the
        measurement, ``fp8`` and ``sentinel``, as :meth:`gather` makes it for a fresh step with no parameter flag),
        the local backend's gather (the vector as the one row), the decision (:func:`decide`, as
        :meth:`decide` takes it) and the payload without its optional parts (:attr:`Decision.packed`): one
        execution, replayed from :attr:`step_graph` where the gradients and the scale lie where they lay (the loss
        copied into the graph's own buffer: :meth:`_hold`). The decision's constants are keyed too: the scaler's
        factors, as :class:`~ampguard.decision_graph.DecisionGraph` keys them. The carried state (spike averages, the
        overflow run) is written in place by each replay, as by the decision's own graph, and so are the next
        scale and growth tracker, into GradScaler's own tensors, after the step's ``grad_scale`` was taken
        (:attr:`Decision.grad_scale`). Returns ``(norms, found_inf, reductions, gathered, decision)``. No sync."""
        scale = adapter.scale
        view = adapter.view()
        growth_tracker = view.growth_tracker
        loss, fp8, sentinel = self._hold("loss", loss), self._hold("fp8", fp8), self._hold("sentinel", sentinel)
        config = self.config
        clipping, fused = uses_clipping(config), self.fused
        early, on_skip = self._early_flag()
        slot = None
        if early is not None:
            self._land_last()
            slot = self._landing_slot(len(groups.index))

        def measure() -> tuple[Any, ...]:
            inv = adapter.inv_scale()  # GradScaler's 1/scale at this scale: the norms', and a non-fused step's unscale
            norms, found, (total, count) = self._scaled_norms_of(groups, adapter, inv)
            gathered, vector, tracker, payload = self._decided(config, view, loss, norms, total, count, found, fp8,
                                                               sentinel, on_skip)
            if slot is not None:
                self._to_landing(slot, payload)
            # the step's grad_scale at this scale (a non-fused optimizer's: GradScaler's 1/scale, which unscales its
            # gradients: the one the norms were multiplied by, made before the scale is written), then the next scale
            # and tracker into GradScaler's own tensors
            if not fused:
                grad_scale = inv
            else:
                grad_scale = scale / vector[Dec.CLIP_COEF].to(scale.device) if clipping else scale.clone()
            assert tracker is not None  # internal: decided with a scaler
            scale.copy_(vector[Dec.NEXT_SCALE])
            growth_tracker.copy_(tracker)
            return norms, found, total, count, gathered, vector, payload, grad_scale

        kind = ("decision", view.growth_factor, view.backoff_factor, view.growth_interval,
                *_addresses(loss, fp8, sentinel))  # the loss and the flags held: their buffers (None: not given)
        norms, found, total, count, gathered, vector, payload, grad_scale = self._replayed(
            kind, measure, groups, scale, self.step_graph)
        decision = Decision(vector, growth_tracker, packed=Packed(payload, Layout.of(gathered, norms)),
                            grad_scale=grad_scale if fused else None, unscale_by=None if fused else grad_scale,
                            early=early, landing=self._landed(slot))
        return norms, found, (total, count), gathered, decision

    def _tail(self, config: GuardConfig, view: ScalerView | None, loss: torch.Tensor | None, norms: torch.Tensor,
              total: torch.Tensor, count: torch.Tensor, found: torch.Tensor | None, fp8: torch.Tensor | None,
              sentinel: torch.Tensor | None, on_skip: Callable[[torch.Tensor], None] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The step graph's part after the norms and their reductions (made before it: a reduction compiled would
        not keep ``clip_grad_norm_``'s bits): the local vector and the local backend's gather of it
        (:meth:`_local_gathered`), the decision (:func:`decide`, the carried state written in place) and the payload
        without its optional parts. Returns ``(gathered, vector, new_growth_tracker, payload)``. No sync."""
        gathered = self._local_gathered(loss, norms, total, count, found, fp8, sentinel)
        vector, tracker = decide(gathered, config=config, spikes=self.spikes, scale_state=self.scale_state,
                                 scaler=view, grads_sharded=False, on_skip=on_skip)
        return gathered, vector, tracker, pack(vector, gathered, norms).vector

    def _decided(self, config: GuardConfig, view: ScalerView | None, loss: torch.Tensor | None,
                 norms: torch.Tensor, total: torch.Tensor, count: torch.Tensor, found: torch.Tensor | None,
                 fp8: torch.Tensor | None, sentinel: torch.Tensor | None,
                 on_skip: Callable[[torch.Tensor], None] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """:meth:`_tail`, op by op or, with :attr:`fused_rule` (``AMPGUARD_FUSED_RULE=1``), on a
        device of :data:`FUSED_RULE_DEVICES` and no early flag (``on_skip``: its copy and event record sit inside the
        rule), compiled (:data:`FUSED_RULE_OPTIONS`) from the guard's own copy of the code (:func:`_own_code`): the
        first call compiles (a first sighting of a step graph's key runs eagerly), later ones run the compiled kernels,
        captured into the step graph. A capture never compiles: where it would, it takes the tail op by op. A compile
        that fails warns once and leaves the op by op tail for the guard's life."""
        if (on_skip is None and self.fused_rule and not self._compile_failed
                and norms.device.type in FUSED_RULE_DEVICES):
            if self._compiled_tail is None:
                # f32 rounds a Python float through struct, which dynamo cannot trace: a constant of the trace (marked
                # here, not where it is defined: marking imports torch._dynamo, which importing ampguard must not)
                torch.compiler.assume_constant_result(f32)
                self._compiled_tail = torch.compile(_own_code(StepPipeline._tail).__get__(self), fullgraph=True,
                                                    dynamic=False, options=FUSED_RULE_OPTIONS)
            in_capture = capturing(norms.device)
            try:
                # inside a capture, only what is compiled already: where the tail would compile there (its first
                # unforced run, or guards that miss, after earlier runs under forensics' force_eager stance), dynamo
                # raises before it launches anything, and the capture takes the tail op by op; the next eager run
                # compiles it
                with torch.compiler.set_stance("fail_on_recompile") if in_capture else contextlib.nullcontext():
                    return self._compiled_tail(config, view, loss, norms, total, count, found, fp8, sentinel)
            except Exception as exc:  # an optimisation: never fail a step over it
                if in_capture:  # a capture's miss: this capture op by op, below
                    self.fused_rule_capture_misses += 1
                else:
                    self._compile_failed = True
                    warnings.warn(f"ampguard: torch.compile of the step's decision failed ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''}); taking it op by op, as fast "
                                  "as before this optimisation, with the same bits (AMPGUARD_FUSED_RULE=0 silences "
                                  "this)", RuntimeWarning, stacklevel=2)
        return self._tail(config, view, loss, norms, total, count, found, fp8, sentinel, on_skip)

    def _early_flag(self) -> tuple[tuple[torch.Tensor, Any] | None, Callable[[torch.Tensor], None] | None]:
        """``(early, on_skip)`` for the step graph's decision: with :attr:`early_skip` on, the pinned flag and external
        event (:attr:`Decision.early`, made here on first use: never inside a capture) and the rule's ``on_skip``,
        which copies the skip into the flag (a device-to-host copy node) and records the event after it (an event
        record node: ``torch.cuda.Event(external=True)``); eagerly, the same copy and record on the current stream.
        ``(None, None)`` with it off."""
        if not self.early_skip:
            return None, None
        if self._early_pair is None:
            flag, event = early = self._new_flag()

            def on_skip(skip: torch.Tensor) -> None:
                flag.copy_(skip.reshape(1), non_blocking=True)
                event.record()

            self._early_pair = (early, on_skip)
        return self._early_pair

    @staticmethod
    def _new_flag() -> tuple[torch.Tensor, Any]:
        """A pinned one-byte bool buffer and an external event (a graph records an event record node for it)."""
        return torch.zeros(1, dtype=torch.bool, pin_memory=True), torch.cuda.Event(external=True)

    def _land_last(self) -> None:
        """The last run's landing filled, before the next run overwrites its pinned buffer."""
        if self._landing is not None:
            self._landing.synchronize()  # the previous graph's end: passed, on any step that launched work since
            self._landing = None

    def _landing_slot(self, norms: int) -> tuple[Any, ...]:
        """The pinned buffer and external event the step graph copies its payload into (:class:`Landing`), for a
        payload of ``norms`` per-tensor norms (one rank, no optional part: the count sizes it), made on the first
        run over those gradients, which is eager (:class:`~ampguard.decision_graph.MeasureGraph` captures a key the
        second time it sees it)."""
        slot = self._landing_slots.get(norms)
        if slot is None:
            slot = self._landing_slots[norms] = self._new_slot(Layout(1, norms).size)
        return slot

    @staticmethod
    def _new_slot(size: int) -> tuple[Any, ...]:
        """A pinned float32 buffer of ``size``, an external event (a graph records an event record node for it) and a
        ctypes view of the buffer (:func:`~ampguard.payload.pinned_view`: each landing's one-call fill)."""
        pinned = torch.empty(size, dtype=torch.float32, pin_memory=True)
        return pinned, torch.cuda.Event(external=True), pinned_view(pinned)

    @staticmethod
    def _to_landing(slot: tuple[Any, ...], payload: torch.Tensor) -> None:
        """The payload to the host by the graph itself, into ``slot``'s pinned buffer (a device-to-host copy node),
        then ``slot``'s event recorded (an external event record node); eagerly, the same on the current stream."""
        pinned, event = slot[:2]
        pinned.copy_(payload, non_blocking=True)
        event.record()

    def _landed(self, slot: tuple[Any, ...] | None) -> Landing | None:
        """This run's :class:`Landing` (None without a slot), remembered to be filled before the next run."""
        if slot is None:
            return None
        landing = self._landing = Landing(*slot)
        return landing

    def _through_unscaled(self, loss: torch.Tensor | None, fp8: torch.Tensor | None = None,
                          sentinel: torch.Tensor | None = None) -> Measured | None:
        """Without a GradScaler (bf16, fp32): the gradients' norms and their reductions (:meth:`_norms`), the local
        vector, the local backend's gather, the decision and the payload without its optional parts, in one
        execution replayed from :attr:`step_graph` where the gradients lie where they lay, the loss held
        (:meth:`_hold`) (the measurement :meth:`_through_decision` makes on the fast path, with no scale to read or
        write). None where some gradient is sparse (:meth:`_replayed_step`). No sync."""
        config = self.config
        loss, fp8, sentinel = self._hold("loss", loss), self._hold("fp8", fp8), self._hold("sentinel", sentinel)
        early, on_skip = self._early_flag()
        if early is not None:
            self._land_last()

        def measure(groups: GradGroups) -> tuple[Any, ...]:
            norms, (total, count) = self._norms_of(groups)
            gathered, vector, _, payload = self._decided(config, None, loss, norms, total, count, None, fp8, sentinel,
                                                         on_skip)
            if early is not None:
                self._to_landing(self._landing_slot(len(groups.index)), payload)
            return norms, total, count, gathered, vector, payload

        replayed = self._replayed_step(("decision, unscaled", *_addresses(loss, fp8, sentinel)), measure)
        if replayed is None:
            return None
        groups, (norms, total, count, gathered, vector, payload) = replayed
        slot = None if early is None else self._landing_slot(len(groups.index))
        decision = Decision(vector, None, packed=Packed(payload, Layout.of(gathered, norms)), early=early,
                            landing=self._landed(slot))
        return Measured({}, None, groups, norms, reductions=(total, count), gathered=gathered, decided=decision)

    def _through_host_copy(self, found: dict[torch.device, torch.Tensor], found_inf: torch.Tensor | None,
                           loss: torch.Tensor | None, fp8: torch.Tensor | None = None,
                           sentinel: torch.Tensor | None = None) -> Measured | None:
        """The host decision's side of the step graph (a non-fused optimizer off the CPU, after GradScaler's own
        unscale): the norms of the unscaled gradients and their reductions, the local vector, the local backend's gather
        and the host copy's vector (:meth:`ampguard.payload.HostCopy.flat`) in one execution, replayed from
        :attr:`step_graph` where the gradients and the scale lie where they lay (GradScaler's ``found_inf`` and the loss
        held: :meth:`_hold`; and ``fp8``, the fp8 monitor's flag, held). :meth:`decide` then brings that vector over in
        the step's one copy, as it would its own. None where some gradient is sparse (:meth:`_replayed_step`). No
        sync."""
        device = self.device
        view: ScalerView | None = self.adapter.view() if self.adapter is not None else None
        found_in, loss, fp8 = self._hold("found_inf", found_inf), self._hold("loss", loss), self._hold("fp8", fp8)
        sentinel = self._hold("sentinel", sentinel)

        def measure(groups: GradGroups) -> tuple[Any, ...]:
            norms, (total, count) = self._norms_of(groups)
            gathered = self._local_gathered(loss, norms, total, count, found_in, fp8, sentinel)
            return norms, total, count, gathered, HostCopy.flat(gathered, norms, None, view, device)

        kind = ("host copy", *_addresses(loss, found_in, fp8, sentinel))
        replayed = self._replayed_step(kind, measure, None if view is None else view.scale)
        if replayed is None:
            return None
        groups, (norms, total, count, gathered, flat) = replayed
        return Measured(found, found_inf, groups, norms, reductions=(total, count), gathered=gathered, host_flat=flat)

    def gather(self, measured: Measured, loss: torch.Tensor | None, *, no_grads: bool = False,
               sentinel: torch.Tensor | None = None, fp8: torch.Tensor | None = None,
               params_bad: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's statistics, all-gathered: ``[world_size, LOCAL_K]`` on device. collective:
        every rank gathers, also one whose backward reached no parameter (``no_grads``): the
        decision then skips the step on every rank. ``sentinel``:
        :meth:`ampguard.forensics.sentinel.Sentinel.value` (None: off). ``fp8``:
        :meth:`ampguard.fp8.Fp8Monitor.nonfinite` (None: off). ``params_bad``: the last checked update left this
        rank's parameters non-finite (None: not known)."""
        replicas = getattr(self.backend, "grad_replicas", 1) if self.backend.grads_sharded else 1
        vec = local_vector(loss=loss, tensor_norms=measured.norms, reductions=measured.reductions,
                           found_inf=measured.found_inf, host=not self.host_copies,
                           pre_reduction=self.backend.pre_reduction_flags(), device=self.device, no_grads=no_grads,
                           sentinel=sentinel, headroom=None if measured.numerics is None else measured.numerics[1],
                           fp8=fp8, params_bad=params_bad, norm_share=replicas**-0.5 if replicas > 1 else None)
        return self.backend.all_gather(vec).wait()  # type: ignore[no-any-return]

    def decide(self, gathered: torch.Tensor, measured: Measured) -> Decision:
        """The step's :class:`Decision`, on the path :attr:`host_decision` picks. ``measured``: the
        step's measurement, whose norms (and sampled numerics) the host decision copies to the
        host with the gathered matrix."""
        view: ScalerView | None = self.adapter.view() if self.adapter is not None else None
        config = self.config_for(measured)
        if self.host_decision:
            # off the CPU: the step's one sync
            if measured.host_flat is not None:  # made in the step graph's replay
                copied = HostCopy.of_flat(measured.host_flat.cpu(), gathered, measured.norms, None, view)
            else:
                copied = HostCopy.read(gathered, measured.norms, measured.numerics, view, self.device,
                                       copy=self.host_copies)
            values, tracker = decide_host(copied.gathered, config=config, spikes=self.spikes,
                                          scale_state=self.scale_state, scaler=copied.view,
                                          grads_sharded=self.backend.grads_sharded)
            return Decision(host_tensor(values), tracker, values, copied)

        def run(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return decide(g, config=config, spikes=self.spikes, scale_state=self.scale_state, scaler=view,
                          grads_sharded=self.backend.grads_sharded)

        # the clip norm is a constant of the captured rule: part of the graph's key
        key = (None if view is None else (view.growth_factor, view.backoff_factor, view.growth_interval),
               measured.clip_norm)
        return Decision(*self.graph.run(run, gathered, key))

    def payload(self, decision: Decision, gathered: torch.Tensor, measured: Measured,
                indicators: torch.Tensor | None = None, params: torch.Tensor | None = None,
                fp8: torch.Tensor | None = None) -> Packed | Unpacked:
        """The step's report payload (:func:`ampguard.payload.pack`); after a host decision, built
        on the host from the copy the decision read; on the CPU, already unpacked
        (:func:`ampguard.payload.unpacked_on_host`: every part is on the host, nothing to pack and read
        back). ``params``: a checked step's max|p| per parameter; ``fp8``: the fp8 monitor's ``[casts, 5]``
        rows (:meth:`ampguard.fp8.Fp8Monitor.collect`)."""
        if decision.host is not None and not self.host_copies:
            return unpacked_on_host(decision.vector, gathered, measured.norms, measured.numerics, indicators, params,
                                    fp8)
        if decision.packed is not None and measured.numerics is None and indicators is None and params is None \
                and fp8 is None:  # made in the step graph's replay, with the decision
            packed = decision.packed  # the graph's output, rewritten by its next replay: CUDA's reporter copies it
            if decision.packed_host is not None:  # already copied by the skip read: the reporter keeps it as it is
                return Packed(decision.packed_host, packed.layout)
            if decision.landing is not None:  # copied to the host by the graph itself: the reporter reads its floats
                return Packed(packed.vector, packed.layout, decision.landing)
            return packed if packed.vector.device.type != "cpu" else Packed(packed.vector.clone(), packed.layout)
        return pack(decision.vector, gathered, measured.norms, measured.numerics, indicators, params, fp8,
                    copied=decision.copied)

    def clip(self, measured: Measured, decision: Decision) -> None:
        if not uses_clipping(self.config_for(measured)) or measured.scaled or measured.clip_applied:
            return  # the fast path folds the coefficient into the fused optimizer's grad_scale
        host = decision.host
        if host is not None and host[Dec.CLIP_COEF] == 1.0:
            return  # a multiply by 1 changes no value: skip the pass over the gradients
        coef = decision.vector[Dec.CLIP_COEF]
        for grads in measured.groups.tensors.values():
            c, dev = coef, grads[0].device
            if c.device != dev:  # a host coefficient by a fill (the same float32 value): a copy would sync
                c = c.to(dev) if host is None else torch.full((), host[Dec.CLIP_COEF], dtype=c.dtype, device=dev)
            torch._foreach_mul_(grads, c)

    def inner_step(self, decision: Decision, measured: Measured) -> bool:
        """Step the inner optimizer unless the decision says skip. Returns whether the step's report may be decoded
        at once (the caller's fixed point then waits for nothing the optimizer queued): a host decision's step that
        synced, and a non-fused step whose skip read said skipped (its report, queued behind no optimizer kernel,
        names a non-finite step's cause in time for the next forward's hooks: docs/diagnosis.md)."""
        if not measured.groups.index:
            # No gradient on this rank: the decision skips everywhere (Loc.NO_GRADS), and there is
            # nothing to step here (GradScaler.step would refuse: it recorded no inf check).
            return False
        skip = decision.vector[Dec.SKIP]
        if measured.scaled:
            if self.fused:
                self._step_scaled(decision, skip, measured)
                return False
            return self._step_unscaling(decision, skip, measured)
        if decision.skipped is not None:
            return self._inner_step_host(decision.skipped, skip, measured)
        # The tensor decision: off the CPU (and on the CPU where tests turn host_decision off)
        inner = self.optimizer
        if self.fused:
            if self.adapter is not None:
                self.adapter.force_found_inf(measured.found_inf_per_device, skip)
                with self.backend.step_context(inner):
                    self.adapter.step(inner)  # the kernel reads found_inf on device
            else:
                self._step_fused(skip, None)
            return False
        # a non-fused optimizer: GradScaler.step's `if not found_inf.item(): step()`, the flag the decision's skip
        skipped = self._learn_skip(decision, skip, measured)
        if not skipped:
            with self.backend.step_context(inner):
                inner.step()
        return skipped  # a step taken: its report decoded later (Decision.learnt tells its skip meanwhile)

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

    def _step_scaled(self, decision: Decision, skip: torch.Tensor, measured: Measured) -> None:
        """The fast path's step: what GradScaler.step does for a fused optimizer whose gradients
        it did not unscale (``grad_scale = scale``, ``found_inf``), with the skip as ``found_inf``
        and the clip coefficient folded in: ``grad_scale = scale / clip_coef``. The kernel skips
        on device, or unscales, clips and updates in one pass. No sync."""
        adapter = self.adapter
        assert adapter is not None  # internal: measured.scaled
        adapter.force_found_inf(measured.found_inf_per_device, skip)  # GradScaler's record: the decision
        if decision.grad_scale is not None:  # the step graph's (the scale itself is the next one already)
            self._step_fused(skip, decision.grad_scale)
            return
        scale = adapter.scale
        grad_scale = scale
        if uses_clipping(self.config_for(measured)):
            host = decision.host
            if host is None or host[Dec.CLIP_COEF] != 1.0:
                grad_scale = scale / decision.vector[Dec.CLIP_COEF].to(scale.device, non_blocking=True)
        self._step_fused(skip, grad_scale)

    def _step_unscaling(self, decision: Decision, skip: torch.Tensor, measured: Measured) -> bool:
        """A non-fused optimizer's step on the fast path (:attr:`unfused_fast`): the skip read (the step's one sync,
        where the plain loop's GradScaler reads ``found_inf``), GradScaler's record set to it; the gradients unscaled
        by one ``_foreach_mul_`` by GradScaler's ``1/scale`` at the scale they were measured at (also on a skipped
        step: ``.grad`` as the plain loop's ``unscale_`` leaves it), then, on a step taken, clipped by a second
        (the coefficient ``clip_grad_norm_`` computes, from the same norms: its values) and stepped. The multiplies
        are queued after the read, so the host waits for the measurement and the decision only. Returns whether it
        skipped (:meth:`inner_step`'s answer)."""
        adapter = self.adapter
        assert adapter is not None  # internal: unfused_fast needs a GradScaler
        skipped = self._learn_skip(decision, skip, measured)
        inv = decision.unscale_by if decision.unscale_by is not None else adapter.inv_scale()
        coef = None if skipped or not uses_clipping(self.config_for(measured)) else decision.vector[Dec.CLIP_COEF]
        for grads in measured.groups.tensors.values():
            dev = grads[0].device
            torch._foreach_mul_(grads, inv if inv.device == dev else inv.to(dev, non_blocking=True))
            if coef is not None:
                torch._foreach_mul_(grads, coef if coef.device == dev else coef.to(dev, non_blocking=True))
        measured.scaled = False
        if not skipped:
            inner = self.optimizer
            with self.backend.step_context(inner):
                inner.step()
        return skipped

    def _learn_skip(self, decision: Decision, skip: torch.Tensor, measured: Measured) -> bool:
        """A non-fused optimizer's step on the tensor decision: the skip flag read (the step's one sync, where the
        plain loop's GradScaler reads ``found_inf``) into :attr:`Decision.learnt`, and GradScaler's record set to it
        (a fill: no copy). Returns it. Where the step graph made the payload (:attr:`Decision.packed`), the read
        copies the whole payload, whose first floats are the decision (:attr:`Decision.packed_host`): one copy and
        one wait, as for the flag alone, and the reporter's own copy of it, queued after the optimizer's kernels,
        is not made."""
        packed = decision.packed
        if decision.early is not None:  # SYNC: the flag the replay copied as soon as it was made (the graph goes on)
            flag, event = decision.early
            event.synchronize()
            # the byte read in place: no tensor op (stop 59: inside a step each costs the host several µs)
            skipped = decision.learnt = ctypes.c_bool.from_address(flag.data_ptr()).value
        elif packed is not None:  # SYNC: the payload's copy, the decision at its head
            host = decision.packed_host = packed.vector.to("cpu", copy=True)
            skipped = decision.learnt = bool(host[Dec.SKIP])
        else:
            skipped = decision.learnt = bool(skip.item())  # SYNC: what a non-fused optimizer needs to skip
        if self.adapter is not None:
            self.adapter.force_found_inf(measured.found_inf_per_device, skipped)
        return skipped

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

    def update_scale(self, decision: Decision) -> None:
        """The next scale; on a GradScaler several guards share, this step's overflow and skip join
        the iteration's one update instead (:class:`~ampguard.scaling.SharedScaler`)."""
        adapter = self.adapter
        if adapter is None:
            return
        d = decision.vector if decision.host is None else decision.host
        if adapter.shared:
            adapter.contribute(d[Dec.GRAD_NONFINITE] > 0, d[Dec.SKIP] > 0)
        elif decision.wrote_scale:  # the step graph wrote the scale and tracker
            adapter.updated_in_place()
        else:
            adapter.update(d[Dec.NEXT_SCALE], decision.tracker)


def _addresses(*held: torch.Tensor | None) -> tuple[int | None, ...]:
    """The addresses of the step graph's held buffers (:meth:`StepPipeline._hold`), None for one not held: part of a
    graph's key."""
    return tuple(None if t is None else t.data_ptr() for t in held)


STEP_GRAPH_MISSES = 16
"""Runs of the step graph in a row without a replay after which a guard stops taking it for a while (its keys do
not repeat: :meth:`StepPipeline._step_graph_due`). A run's first steps move the gradients for a while: on an H100
(stop 42, ``benchmarks/gpu_graph_keys.py``) fp16 foreach AdamW from a scale that overflows put them in 8 new places
in its first 8 steps (5 overflowing steps, forensics armed by them, AdamW's state made at its first taken step),
then in 2 by turns; with 8 here that guard rested from step 8 on and missed the steady loop's start."""

FUSED_RULE_OPTIONS: dict[str, Any] = {"eager_numerics.division_rounding": True,
                                      "emulate_precision_casts": True}
"""Inductor's options for the fused rule (``AMPGUARD_FUSED_RULE``): ``/`` as IEEE division rounded to nearest (Triton's
own is approximate) and no fp fusion (a multiply-add contracted into one rounding): the op-by-op rule's bits."""

FUSED_RULE_DEVICES: tuple[str, ...] = ("cuda",)
"""Devices whose step graph runs the fused rule (``AMPGUARD_FUSED_RULE``): CUDA, where Triton's kernels were checked
bit for bit against the op-by-op rule (stop 64: 0 of 360 random decisions differ). Not the CPU, whose eager ``sqrt``
of a 0-d float32 is not correctly rounded (inductor's C++ is: ZClip's and the z-score detector's bits would differ)
and whose first step would wait seconds on a C++ compile; the CPU's tests add it (tests/unit/test_fused_rule.py)."""

STEP_GRAPH_REST = 50
"""Steps a guard that stopped taking the step graph runs the stages apart before it tries again."""

STEP_GRAPH_PROBES = 4
"""Tries after a rest: enough for a key to come back in a loop whose gradients take two or three places in turn."""

_FAST_BACKENDS = ("local", "torch.distributed")
"""Backends the fast path is taken on (Horovod: today's path; untested there)."""


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` on a copy of its code object. Dynamo keeps its compiled entries, and counts its recompile limit (8), per
    code object: the fused rule compiled from one shared ``_tail`` took a second entry for each guard whose decision
    constants differ (another ``clip_grad_norm``, another detector), and the ninth such guard in a process failed
    (``FailOnRecompileLimitHit``; stop 64, ``tests/gpu`` with the rule on). Each guard's own copy keeps its own
    entries, which go with the guard."""
    assert isinstance(fn, types.FunctionType)  # internal: a plain function
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """GradScaler.step's own test, made once: does ``step`` take a ``grad_scaler`` argument?"""
    try:
        return "grad_scaler" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):  # no signature: let GradScaler decide, every step
        return True


_ref = weakref.ref


def grad_marks(params: Sequence[torch.Tensor]) -> list[Any]:
    """Which gradient tensors exist, and their autograd version counters: a backward that adds
    to a gradient, or replaces it, changes this. One attribute read per parameter, no sync.

    A mark is ``(id(g), g._version)``: plain ints (a weak reference a gradient was tried: in the
    H100's profile the marks of GPT-2 350M's 292 gradients took 5.1x the time of the grouping's
    ``.grad`` reads, 1.25x with ints on the H200 at stop 38; +23 % on the 2-core CPU,
    ``benchmarks/results/cpu_stop40/marks_cost.py``). An ``id()`` can name another
    tensor: a gradient freed by ``model.zero_grad()`` and the one the next backward makes often
    share an address, and both have version 0 when the step did not write them (a fused
    optimizer). :func:`first_ref` and :func:`marks_changed` tell those apart."""
    return [None if (g := p.grad) is None else (id(g), g._version) for p in params]


def first_ref(params: Sequence[torch.Tensor]) -> Any:
    """A weak reference to the first parameter's gradient that exists (None: none does), kept beside the marks
    (one object a step): dead once that gradient is freed."""
    for p in params:
        g = p.grad
        if g is not None:
            return _ref(g)
    return None


def marks_changed(params: Sequence[torch.Tensor], marks: Sequence[Any], first: Any = None) -> bool:
    """Whether any parameter's gradient differs from its mark (another tensor, another version,
    made or cleared): stops at the first difference, so a step after a backward reads one or two
    ``.grad`` in the common case, and all of them only when nothing seems changed. Then ``first``
    (:func:`first_ref` of the marked gradients) decides: dead, the gradient the first mark named was
    freed and the tensor now at its ``id`` is another, made since (the ``model.zero_grad()`` loop
    above: a false "no backward" on a one-parameter model, before). Not told apart: a gradient
    replaced by hand while the first is kept, whose successor takes its ``id`` and version."""
    for p, m in zip(params, marks):
        g = p.grad
        if g is None:
            if m is not None:
                return True
        elif m is None or m[0] != id(g) or m[1] != g._version:
            return True
    return first is not None and first() is None


def marks_after_step(groups: GradGroups, params: Sequence[torch.Tensor]) -> list[Any]:
    """:func:`grad_marks` as a step leaves the gradients, from the step's own grouping of them
    (``groups``, the ``.grad`` objects it measured): no ``.grad`` read per parameter, which is most
    of :func:`grad_marks`' cost. Where the groups hold other tensors (a shard's local tensor, a
    sparse gradient's values), :func:`grad_marks` itself."""
    if not groups.own:
        return grad_marks(params)
    marks: list[Any] = [None] * len(params)
    k = 0
    for grads in groups.tensors.values():
        for g in grads:
            marks[groups.index[k]] = (id(g), g._version)
            k += 1
    return marks
