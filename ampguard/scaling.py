"""Loss scaling: the one adapter to ``torch.amp.GradScaler``.

:class:`GradScalerAdapter` is the only place in ampguard that touches GradScaler's private
state (``_scale``, ``_growth_tracker``, ``_per_optimizer_states``, ``_device``,
``_lazy_init_scale_growth_tracker``): a torch upgrade that moves them breaks here, and only
here. It also decides what the *public* GradScaler calls mean on a guarded optimizer
(``scaler.step(opt)``, ``scaler.unscale_(opt)``, ``scaler.update()``): see :meth:`attach`, and
:mod:`ampguard.shared_scaler` for several guards on one scaler.

The scale rule (GradScaler's, with hysteresis, floor, ceiling and the headroom policy) is
:func:`ampguard.scale_rule.next_scale`; the adapter only reads the scaler for it
(:meth:`GradScalerAdapter.view`) and writes its result (:meth:`GradScalerAdapter.update`).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .errors import GuardStateError
from .ops import f32
from .scale_rule import ScalerView, ScaleState
from .shared_scaler import Guard, SharedScaler

if TYPE_CHECKING:
    from .config import GuardConfig

__all__ = ["GradScalerAdapter", "ScaleState", "ScalerView", "SharedScaler", "f32"]

# GradScaler's per-optimizer stages (torch.amp.grad_scaler.OptState), compared by name so a
# torch that moves the enum keeps working.
_READY, _UNSCALED = "READY", "UNSCALED"


class GradScalerAdapter:
    """The guard's view of, and hold on, one ``torch.amp.GradScaler``.

    Reads: :attr:`scale` (the device tensor), :meth:`view`, :meth:`inv_scale`,
    :meth:`fast_path_capable`, :meth:`fast_path_ok`.
    Writes: :meth:`unscale` (adopting an ``unscale_`` already done this iteration),
    :meth:`record_found_inf` (the fused fast path's inf check), :meth:`force_found_inf`, :meth:`update` (new scale
    and growth tracker), :meth:`at_scale` (run at a given scale, for a replay).

    :meth:`attach` makes the scaler's own public methods guard-aware, on this scaler instance
    only (nothing global; :meth:`detach` undoes it):

    - ``scaler.unscale_(opt)`` (or of ``opt.optimizer``): the guard's :meth:`GuardedOptimizer.unscale_`,
      which unscales once and measures the gradients before the caller clips them.
    - ``scaler.step(opt)``: refused with :class:`GuardStateError` before anything changes (the guard
      steps itself: the habit from the plain loop is a mistake).
    - ``scaler.update()`` after a guarded step: the guard already updated the scale; refused. With
      several guards on the scaler, an iteration in which not all of them stepped is ended by it
      (:class:`SharedScaler`).
    - ``scaler.step(other)`` / ``scaler.unscale_(other)`` for an optimizer no guard wraps: refused
      before anything changes (its overflows would never reach the guarded scale update): guard it
      too, on the same scaler.
    - ``scaler.scale(loss)``: noted, so that a step whose gradients were never scaled by this scaler
      is caught (see :attr:`scaled_since_step`).
    - ``pickle``/``copy``: the scaler's own state, without these patches (a plain GradScaler).
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self.scaled_since_step = False
        """``scaler.scale()`` ran since the last guarded step (fp16: the gradients are scaled)."""
        self._targets: tuple[int, ...] = ()
        self._hub: SharedScaler | None = None
        self._guard: weakref.ref[Guard] | None = None
        self.config: GuardConfig | None = None

    @property
    def guard(self) -> Guard | None:
        """The guarded optimizer, once attached (None after it is collected). Held weakly: the scaler holds its hub
        and the hub this adapter, so a strong reference kept a guard dropped without ``close()`` alive for as long as
        the user's scaler, counted as a guard sharing it (the guard's finalizer detaches the adapter)."""
        return self._guard() if self._guard is not None else None

    # ------------------------------------------------------------------ reads
    @property
    def device_type(self) -> str:
        """The device type the scaler was built for ("cuda", "cpu", ...)."""
        return str(self.scaler._device)

    def ensure_initialized(self, device: torch.device) -> None:
        """Create the scale and growth tracker now (GradScaler does it lazily on first ``scale()``),
        so the state is complete before step 0. No-op when they exist."""
        if self.scaler._scale is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.scaler._lazy_init_scale_growth_tracker(device)

    @property
    def scale(self) -> torch.Tensor:
        """The loss scale, a 1-element device tensor (no sync)."""
        scale = self.scaler._scale
        if scale is None:  # pragma: no cover - ensure_initialized() runs at wrap()
            raise GuardStateError("the GradScaler has no scale yet")
        return scale

    def view(self) -> ScalerView:
        return ScalerView(
            scale=self.scale,
            growth_tracker=self.scaler._growth_tracker,  # type: ignore[arg-type]
            growth_factor=self.scaler.get_growth_factor(),
            backoff_factor=self.scaler.get_backoff_factor(),
            growth_interval=self.scaler.get_growth_interval(),
        )

    # ------------------------------------------------------------------ writes
    def unscale(self, guard: object, inner: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Unscale ``inner``'s gradients unless that was done this iteration (also when someone
        called ``scaler.unscale_`` on the guard itself before :meth:`attach`), and return
        GradScaler's ``found_inf`` per device. No sync."""
        states = self.scaler._per_optimizer_states
        mine = states.get(id(guard))
        if mine is not None and mine["stage"].name == _UNSCALED:
            states[id(inner)] = states.pop(id(guard))
        elif states[id(inner)]["stage"].name == _READY:
            self._call("unscale_", inner)
        return states[id(inner)]["found_inf_per_device"]

    def unscaled(self, inner: torch.optim.Optimizer) -> bool:
        """Whether ``inner``'s gradients were unscaled this iteration."""
        state = self.scaler._per_optimizer_states.get(id(inner))
        return state is not None and state["stage"].name == _UNSCALED

    def fast_path_capable(self) -> bool:
        """Whether the scaler allows the fused fast path at all (fixed for its life: asked once):
        it is enabled and is GradScaler itself, not a subclass that unscales its own way, such as
        FSDP's ShardedGradScaler."""
        return self.scaler.is_enabled() and _unscales_as_grad_scaler(type(self.scaler))

    def fast_path_ok(self, guard: object, inner: torch.optim.Optimizer) -> bool:
        """Whether, this iteration, the fused fast path may measure ``inner``'s gradients still
        scaled (given :meth:`fast_path_capable`): nobody unscaled them (``scaler.unscale_`` on the
        guard or the inner optimizer: the gradients are unscaled already, today's path adopts that)."""
        states = self.scaler._per_optimizer_states
        for key in (id(guard), id(inner)):
            state = states.get(key)
            if state is not None and state["stage"].name != _READY:
                return False
        return True

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as GradScaler's ``unscale_`` computes it (the reciprocal in float64,
        rounded to float32), on the scale's device. No sync."""
        scale = self.scale
        return scale.reciprocal() if scale.device.type == "mps" else scale.double().reciprocal().float()

    def inv_scale_host(self) -> float:
        """:meth:`inv_scale` as a host float (the same float32 value: the reciprocal in float64,
        rounded to float32). Reads the scale: for CPU scalers (free there)."""
        return f32(1.0 / float(self.scale.item()))

    def record_found_inf(self, inner: torch.optim.Optimizer,
                         found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """The fast path's inf check, recorded as GradScaler's own for ``inner`` (what its
        ``_check_inf_per_device`` records before a fused step), so its bookkeeping stays whole:
        ``found_inf`` (0-d float32) is moved to the scale's device. Returns the per-device dict
        (one entry), which :meth:`force_found_inf` then sets to the decision. No sync."""
        t = found_inf
        if t.device != self.scale.device or t.dtype != torch.float32 or t.dim() != 0:
            t = t.to(self.scale.device, dtype=torch.float32, non_blocking=True).reshape(())
        found = {t.device: t}
        self.scaler._per_optimizer_states[id(inner)]["found_inf_per_device"] = found
        return found

    def record_unscaled(self, inner: torch.optim.Optimizer,
                        found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """:meth:`record_found_inf`, for gradients the guard has unscaled itself (a non-fused CPU
        optimizer, ``StepPipeline.norms_first``): GradScaler's record is then what its ``unscale_``
        leaves (stage UNSCALED), so its own ``step`` does not unscale them again. No sync."""
        found = self.record_found_inf(inner, found_inf)
        self._mark_unscaled(inner)
        return found

    def check_unscaled(self, inner: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """GradScaler's element check (its ``_unscale_grads_``, by 1) on ``inner``'s gradients, which the guard has
        unscaled already (``StepPipeline.norms_first``, a step whose norms are not all finite), recorded as its
        ``unscale_`` records it (stage UNSCALED): today's path then adopts the record (:meth:`unscale`). With a
        ``1/scale`` of at most 1 it finds what the check before the multiply would have. No sync."""
        scale = self.scale
        found = self.scaler._unscale_grads_(inner, torch.ones((), dtype=torch.float32, device=scale.device),
                                            torch.zeros((), dtype=torch.float32, device=scale.device), False)
        self.scaler._per_optimizer_states[id(inner)]["found_inf_per_device"] = found
        self._mark_unscaled(inner)
        return found

    def _mark_unscaled(self, inner: torch.optim.Optimizer) -> None:
        """GradScaler's stage for ``inner``: UNSCALED, as its ``unscale_`` leaves it (its own ``step`` then unscales
        nothing)."""
        state = self.scaler._per_optimizer_states[id(inner)]
        state["stage"] = type(state["stage"])[_UNSCALED]  # GradScaler's OptState, by name

    @staticmethod
    def force_found_inf(found_inf_per_device: dict[torch.device, torch.Tensor], skip: torch.Tensor | bool) -> None:
        """Make GradScaler skip exactly when the guard decided to: ``found_inf := skip`` in place;
        a host decision's bool is filled in (no host-to-device copy, so no sync).
        (ShardedGradScaler's found_inf has shape [1]; fused optimizers' kernels need 0-d.)"""
        for dev, t in found_inf_per_device.items():
            if isinstance(skip, bool):
                t.fill_(1.0 if skip else 0.0)
            else:
                t.copy_(skip)
            found_inf_per_device[dev] = t.reshape(())

    def step(self, inner: torch.optim.Optimizer) -> None:
        """GradScaler's own step of the inner optimizer (non-fused: its ``found_inf.item()``)."""
        self._call("step", inner)

    def update(self, new_scale: torch.Tensor | float, tracker: torch.Tensor | int | None) -> None:
        """Set the next scale and growth tracker (device tensors: no sync; or host values, CPU)."""
        self._apply(new_scale, tracker)
        if self._hub is not None:
            self._hub.updated = True
        self.scaled_since_step = False

    def updated_in_place(self) -> None:
        """The next scale and growth tracker were written into GradScaler's own tensors on device (the step
        graph: ``StepPipeline._through_decision``): the rest of what :meth:`update` does, GradScaler's
        ``update``'s clearing of its per-iteration records, with no copy."""
        states = self.scaler._per_optimizer_states
        factory = states.default_factory  # type: ignore[attr-defined]  # a defaultdict: GradScaler.update's last line
        self.scaler._per_optimizer_states = type(states)(factory)  # type: ignore[call-arg]
        if self._hub is not None:
            self._hub.updated = True
        self.scaled_since_step = False

    def _apply(self, new_scale: torch.Tensor | float, tracker: torch.Tensor | int | None) -> None:
        self._call("update", new_scale=new_scale)
        if isinstance(tracker, int):
            self.scaler._growth_tracker.fill_(tracker)  # type: ignore[union-attr]
        elif tracker is not None:
            self.scaler._growth_tracker.copy_(tracker)  # type: ignore[union-attr]

    @contextlib.contextmanager
    def at_scale(self, scale: torch.Tensor) -> Iterator[None]:
        """Run the block with the loss scale set to ``scale``, then restore the current one."""
        saved = self.scale.clone()
        self.scale.copy_(scale)
        try:
            yield
        finally:
            self.scale.copy_(saved)

    def forget(self, optimizer: object) -> None:
        """Drop GradScaler's per-iteration record of ``optimizer`` (after a refused call)."""
        self.scaler._per_optimizer_states.pop(id(optimizer), None)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """GradScaler's own method, bypassing what :meth:`attach` put on the instance."""
        hub = self._hub or SharedScaler.of(self.scaler)
        original = hub._own(name) if hub is not None else getattr(type(self.scaler), name).__get__(self.scaler)
        return original(*args, **kwargs)

    # ------------------------------------------------------------------ the scaler's public calls
    @property
    def shared(self) -> bool:
        """Several guards share this GradScaler: the scale is updated once per iteration, after
        the last of them steps (:class:`SharedScaler`)."""
        hub = self._hub
        return hub is not None and len(hub.members) > 1

    def contribute(self, overflow: torch.Tensor | bool, skip: torch.Tensor | bool) -> None:
        """A guard on a shared scaler stepped (or skipped): its overflow and skip flags (host bools
        or 0-d bool device tensors) join this iteration's one scale update, made after the last guard."""
        assert self._hub is not None  # internal: shared
        self._hub.contribute(self, overflow, skip)
        self.scaled_since_step = False

    def check_iteration(self) -> None:
        """Before a guard on a shared scaler unscales: refuse a second step in one iteration."""
        assert self._hub is not None  # internal: shared
        self._hub.check_iteration(self)

    def attach(self, guard: Guard) -> None:
        """Make ``scaler.step/unscale_/update/scale`` guard-aware on this instance (see the class
        docstring), joining the guards already on it (:class:`SharedScaler`)."""
        if self._hub is not None:
            return
        self._targets = (id(guard), id(guard.optimizer))
        self._guard, self.config = weakref.ref(guard), guard.config
        hub = SharedScaler.of(self.scaler) or SharedScaler(self.scaler)
        hub.join(self)
        self._hub = hub

    def detach(self) -> None:
        """Undo :meth:`attach`: the last guard to leave gives the scaler back its own methods."""
        if self._hub is not None:
            self._hub.leave(self)
        self._hub = None
        self._targets = ()
        self._guard = None


def _unscales_as_grad_scaler(cls: type) -> bool:
    """``cls`` (a GradScaler class) checks and unscales gradients with GradScaler's own code."""
    base = torch.amp.GradScaler
    return all(getattr(cls, name, None) is getattr(base, name) for name in ("unscale_", "_unscale_grads_"))
