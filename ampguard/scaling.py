"""Loss scaling: the one adapter to ``torch.amp.GradScaler``, and the scale rule on device.

:class:`GradScalerAdapter` is the only place in ampguard that touches GradScaler's private
state (``_scale``, ``_growth_tracker``, ``_per_optimizer_states``, ``_device``,
``_lazy_init_scale_growth_tracker``): a torch upgrade that moves them breaks here, and only
here. It also decides what the *public* GradScaler calls mean on a guarded optimizer
(``scaler.step(opt)``, ``scaler.unscale_(opt)``, ``scaler.update()``): see :meth:`attach`.

GradScaler's own rule (``torch._amp_update_scale_``) backs off on every overflowing step and
grows after ``growth_interval`` clean ones. :func:`next_scale` computes the same rule with
plain tensor ops, plus hysteresis (an allowance of ``hysteresis - 1`` overflows that do not back
off, refilled only when the scale grows, as DeepSpeed and Megatron-LM refill theirs) and a
[min, max] clamp, and hands the result to ``GradScaler.update(new_scale=...)``. With
hysteresis 1 and a scale inside [min, max] the result is bitwise GradScaler's.
:func:`next_scale_host` is the same rule on host floats (the CPU decision), float32 op for op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import struct
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from .errors import GuardStateError

if TYPE_CHECKING:
    from .config import GuardConfig

__all__ = ["GradScalerAdapter", "ScaleState", "ScalerView", "SharedScaler", "clamp_f32", "f32", "next_scale",
           "next_scale_host"]

# GradScaler's per-optimizer stages (torch.amp.grad_scaler.OptState), compared by name so a
# torch that moves the enum keeps working.
_READY, _UNSCALED = "READY", "UNSCALED"


@dataclasses.dataclass(slots=True)
class ScalerView:
    """What the decision needs of a GradScaler (None when there is no loss scaling)."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    growth_factor: float
    backoff_factor: float
    growth_interval: int


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
      steps itself: the habit from the plain loop is a mistake), unless :attr:`route_steps` is set
      (framework integrations, whose own code calls ``scaler.step``): then it is ``opt.step()``.
    - ``scaler.update()`` after a guarded step: the guard already updated the scale; refused, or a
      no-op with :attr:`route_steps`. With several guards on the scaler, an iteration in which not
      all of them stepped is ended by it (:class:`SharedScaler`).
    - ``scaler.step(other)`` / ``scaler.unscale_(other)`` for an optimizer no guard wraps: refused
      before anything changes (its overflows would never reach the guarded scale update): guard it
      too, on the same scaler.
    - ``scaler.scale(loss)``: noted, so that a step whose gradients were never scaled by this scaler
      is caught (see :attr:`scaled_since_step`).
    - ``pickle``/``copy``: the scaler's own state, without these patches (a plain GradScaler).
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self.route_steps = False
        """Framework integrations set this: ``scaler.step(opt)`` runs the guarded step."""
        self.scaled_since_step = False
        """``scaler.scale()`` ran since the last guarded step (fp16: the gradients are scaled)."""
        self._targets: tuple[int, ...] = ()
        self._hub: SharedScaler | None = None
        self.guard: Any = None
        """The guarded optimizer, once attached."""
        self.config: GuardConfig | None = None

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

    def attach(self, guard: Any) -> None:
        """Make ``scaler.step/unscale_/update/scale`` guard-aware on this instance (see the class
        docstring), joining the guards already on it (:class:`SharedScaler`)."""
        if self._hub is not None:
            return
        self._targets = (id(guard), id(guard.optimizer))
        self.guard, self.config = guard, guard.config
        hub = SharedScaler.of(self.scaler) or SharedScaler(self.scaler)
        hub.join(self)
        self._hub = hub

    def detach(self) -> None:
        """Undo :meth:`attach`: the last guard to leave gives the scaler back its own methods."""
        if self._hub is not None:
            self._hub.leave(self)
        self._hub = None
        self._targets = ()


_PATCHED = ("step", "unscale_", "update", "scale", "__getstate__")
"""The GradScaler methods the guards patch onto a scaler instance (nothing global)."""


class SharedScaler:
    """The guards on one ``GradScaler``, and the scaler's public calls while any is on it.

    Patched onto the scaler instance as bound methods of this object (``scaler.step`` is
    :meth:`step`, ...); ``scaler.__getstate__`` hands pickle and ``copy`` the scaler's own state
    without them, so a copy is a plain GradScaler, as the scaler was before the guard.

    Several guards on one scaler (torch's ``scaler.step(opt0); scaler.step(opt1); scaler.update()``):
    each decides, and skips, on its own gradients, unscaled with the iteration's scale; the scale
    is updated once per iteration, after every guard on the scaler stepped: backed off when any of
    them overflowed, grown by GradScaler's timer otherwise (held when one skipped for another
    reason), within [min_scale, max_scale]. An iteration in which not every guard steps is ended by
    ``scaler.update()``; a guard that steps twice in one iteration is refused.
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self.members: list[GradScalerAdapter] = []
        self.pending: dict[int, tuple[torch.Tensor | bool, torch.Tensor | bool]] = {}
        """This iteration's (overflow, skip) of each member that stepped, by ``id(member)``."""
        self.updated = False
        """The guards updated the scale since the last ``scaler.update()`` call."""
        self.saved: dict[str, Any] = {name: scaler.__dict__.get(name) for name in _PATCHED}
        patches = {"step": self.step, "unscale_": self.unscale_, "update": self.update, "scale": self.scale,
                   "__getstate__": self._getstate}
        for name in _PATCHED:
            setattr(scaler, name, patches[name])

    @staticmethod
    def of(scaler: torch.amp.GradScaler) -> SharedScaler | None:
        """The hub the guards on ``scaler`` share (None: no guard on it)."""
        owner = getattr(scaler.__dict__.get("__getstate__"), "__self__", None)
        return owner if isinstance(owner, SharedScaler) else None

    @staticmethod
    def check_join(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, config: GuardConfig) -> None:
        """Before a guard is built on ``scaler``: may it join the guards already there? Raises
        ``GuardStateError``/``ValueError`` naming the fix; changes nothing."""
        hub = SharedScaler.of(scaler)
        if hub is None or not hub.members:
            return
        if any(id(optimizer) in m._targets for m in hub.members):
            raise GuardStateError("this optimizer is already guarded on this GradScaler; wrap each optimizer once "
                                  "(opt.optimizer is the inner one). Nothing was changed.")
        configs = [config, *(m.config for m in hub.members if m.config is not None)]
        odd = [f"{name}={[getattr(c, name) for c in configs]}" for name in ("min_scale", "max_scale")
               if len({getattr(c, name) for c in configs}) > 1]
        if any(c.hysteresis != 1 for c in configs):
            odd.append(f"hysteresis={[c.hysteresis for c in configs]} (allowed: 1)")
        if any(c.scale_policy != "default" for c in configs):
            odd.append(f"scale_policy={[c.scale_policy for c in configs]} (allowed: 'default')")
        if odd:
            raise ValueError(
                f"this GradScaler is already shared by {len(hub.members)} guard(s), and guards on one scaler update "
                "its scale once per iteration with one rule: GradScaler's, within one [min_scale, max_scale]. Their "
                f"configs disagree or need a scale of their own: {'; '.join(odd)}. Give every guard on the scaler "
                "the same min_scale/max_scale with hysteresis=1 and scale_policy='default', or give this optimizer "
                "a GradScaler of its own (scaler=torch.amp.GradScaler(...)). Nothing was changed.")

    def join(self, member: GradScalerAdapter) -> None:
        self.members.append(member)

    def leave(self, member: GradScalerAdapter) -> None:
        """A guard closes: the last one restores the scaler's methods; otherwise an iteration that
        only waited for it is complete now."""
        if member in self.members:
            self.members.remove(member)
        if not self.members:
            self.pending.clear()
            for name, previous in self.saved.items():
                if previous is None:
                    self.scaler.__dict__.pop(name, None)
                else:
                    setattr(self.scaler, name, previous)
        elif self.pending and all(id(m) in self.pending for m in self.members):
            self.flush()

    def _member(self, optimizer: Any) -> GradScalerAdapter | None:
        return next((m for m in self.members if id(optimizer) in m._targets), None)

    def _own(self, name: str) -> Callable[..., Any]:
        """The scaler's own method ``name`` (or the instance patch that was there before the guards)."""
        return self.saved.get(name) or getattr(type(self.scaler), name).__get__(self.scaler)

    def _refuse_unguarded(self, call: str) -> GuardStateError:
        return GuardStateError(
            f"scaler.{call}(optimizer) on an optimizer no guard wraps, with a GradScaler a guard shares: the guarded "
            "steps update this scaler's scale, so this optimizer's overflows would never back it off. Guard it too, "
            "on the same scaler: `opt1 = ampguard.wrap(opt1, scaler=scaler)` and call opt1.step() (the guards on one "
            "GradScaler update its scale once per iteration, after the last of them). Nothing was changed.")

    # the scaler's public calls, while guards are on it
    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        member = self._member(optimizer)
        if member is None:
            raise self._refuse_unguarded("step")
        if member.route_steps:
            return member.guard.step(*args, **kwargs)
        member.forget(optimizer)
        raise GuardStateError(
            "scaler.step(opt) was called on a guarded optimizer: the guard already unscales, checks and "
            "steps. Replace `scaler.step(opt); scaler.update()` with `opt.step()`. Nothing was changed."
        )

    def unscale_(self, optimizer: Any) -> None:
        member = self._member(optimizer)
        if member is None:
            raise self._refuse_unguarded("unscale_")
        member.guard.unscale_()

    def update(self, new_scale: Any = None) -> None:
        if new_scale is None and self.pending:  # ends an iteration in which not every guard stepped
            self.flush()
            self.updated = False
            return None
        if self.updated and new_scale is None:
            if any(m.route_steps for m in self.members):
                self.updated = False
                return None
            raise GuardStateError(
                "scaler.update() after opt.step(): the guarded step already updated the loss scale (guards sharing "
                "a GradScaler update it once per iteration, after the last of them). Remove the scaler.update() "
                "call. Nothing was changed."
            )
        return self._own("update")(new_scale)  # type: ignore[no-any-return]

    def scale(self, outputs: Any) -> Any:
        for m in self.members:
            m.scaled_since_step = True
        return self._own("scale")(outputs)

    def _getstate(self) -> dict[str, Any]:
        """``scaler.__getstate__``: the scaler's own state, without the guards' patches."""
        state: dict[str, Any] = self._own("__getstate__")()
        for name, previous in self.saved.items():
            if previous is None:
                state.pop(name, None)
            else:
                state[name] = previous
        return state

    # one scale update per iteration
    def check_iteration(self, member: GradScalerAdapter) -> None:
        if id(member) in self.pending:
            raise GuardStateError(
                f"this guard already stepped in this iteration of a GradScaler shared by {len(self.members)} guards, "
                "whose scale is updated after every one of them stepped. Where only some of them step in an "
                "iteration, end it with scaler.update() after their steps (before the next backward). Nothing "
                "was changed.")

    def contribute(self, member: GradScalerAdapter, overflow: torch.Tensor | bool, skip: torch.Tensor | bool) -> None:
        self.pending[id(member)] = (overflow, skip)
        if all(id(m) in self.pending for m in self.members):
            self.flush()

    def flush(self) -> None:
        """The iteration's one scale update: GradScaler's rule on the flags of the guards that stepped
        (overflow: any; held: a skip without overflow), within the guards' [min_scale, max_scale]."""
        flags = list(self.pending.values())
        self.pending.clear()
        first = self.members[0]
        view, config = first.view(), first.config
        assert config is not None  # internal: members are attached
        if all(isinstance(o, bool) and isinstance(s, bool) for o, s in flags):
            overflow = any(o for o, _ in flags)
            held = not overflow and any(s for _, s in flags)
            scale = f32(float(view.scale.item()))
            new_host, tracker_host, *_ = next_scale_host(scale, int(view.growth_tracker.item()), overflow, held, 0,
                                                         scaler=view, config=config)
            first._apply(new_host, tracker_host)
        else:
            dev = view.scale.device
            o = torch.stack([_on(f, dev) for f, _ in flags]).any()
            s = torch.stack([_on(f, dev) for _, f in flags]).any()
            new, tracker, *_ = next_scale(
                scale=view.scale, growth_tracker=view.growth_tracker, overflow=o, held=s & ~o,
                state=ScaleState.fresh(dev), growth_factor=view.growth_factor, backoff_factor=view.backoff_factor,
                growth_interval=view.growth_interval, hysteresis=1, min_scale=config.min_scale,
                max_scale=config.max_scale)
            first._apply(new, tracker)
        self.updated = True


def _on(flag: torch.Tensor | bool, device: torch.device) -> torch.Tensor:
    """A skip/overflow flag as a 0-d bool tensor on ``device`` (a host bool by a fill: no copy, no sync)."""
    if isinstance(flag, bool):
        return torch.full((), flag, dtype=torch.bool, device=device)
    return flag.to(device, non_blocking=True).reshape(()).bool()


def _unscales_as_grad_scaler(cls: type) -> bool:
    """``cls`` (a GradScaler class) checks and unscales gradients with GradScaler's own code."""
    base = torch.amp.GradScaler
    return all(getattr(cls, name, None) is getattr(base, name) for name in ("unscale_", "_unscale_grads_"))


@dataclasses.dataclass(slots=True)
class ScaleState:
    """Device tensors the scale rule carries from step to step."""

    overflow_run: torch.Tensor
    """int32: overflowing steps since the scale last grew (or since the start), at most
    ``hysteresis``: the hysteresis allowance spent (Megatron-LM's ``hysteresis_tracker`` is
    ``hysteresis - overflow_run``). An overflow backs off once it reaches ``hysteresis``; only a
    growth of the scale sets it back to 0."""

    @classmethod
    def fresh(cls, device: torch.device) -> ScaleState:
        return cls(overflow_run=torch.zeros((), dtype=torch.int32, device=device))


HEADROOM_MAX_SCALE = 2.0**24
"""The headroom policy's ceiling when ``GuardConfig.max_scale`` is None."""


_SHIFT_MAX = 126.0
"""The policy's largest step, in doublings (headroom of a tiny gradient can exceed float32's range)."""


def next_scale(
    *,
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    overflow: torch.Tensor,
    held: torch.Tensor,
    state: ScaleState,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float | None,
    headroom: torch.Tensor | None = None,
    margin: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scale for the next step, without a host sync.

    Hysteresis: an overflow backs the scale off when it brings the overflows counted since the
    scale last grew (``state.overflow_run``, capped at ``hysteresis``) to ``hysteresis``; clean
    steps do not refill the allowance, a growth does. So the first ``hysteresis - 1`` overflows
    after a growth are skipped without a backoff and every later one backs off (DeepSpeed's
    ``DynamicLossScaler`` with ``consecutive_hysteresis=False``, Megatron-LM's
    ``DynamicGradScaler``); intermittent overflows back the scale off as consecutive ones do.
    With ``hysteresis=1`` every overflow backs off: GradScaler's rule.

    ``overflow`` (bool, 0-d): the gradients were non-finite on some rank. ``held`` (bool): the
    step was skipped for another reason (a spike, a non-finite loss with finite gradients):
    the scale and the growth count stay as they are. Updates ``state`` in place; ``growth_tracker``
    is only read (the new tracker is returned). Returns ``(new_scale, new_tracker, backoff, growth,
    floor_hit)``; the last three are bool tensors for the report.

    ``headroom`` (the headroom scale policy, ``GuardConfig.scale_policy="headroom"``): the headroom
    agreed across ranks (NaN on a step not sampled). The growth timer is then off (tracker 0, no
    growth by it); on a sampled step that was taken the scale becomes ``scale * 2**(floor(headroom)
    - margin)`` (:func:`headroom_target_host`). Overflows back off as without it. ``backoff`` and
    ``growth`` then also say which way the policy moved the scale.
    """
    run = torch.where(overflow, torch.clamp(state.overflow_run + 1, max=hysteresis), state.overflow_run)
    backoff = overflow & (run >= hysteresis)
    backed = scale * backoff_factor
    floor_hit = backoff & (backed <= min_scale)
    if headroom is not None:  # the headroom policy: no growth timer; a taken sampled step sets the scale
        apply = torch.isfinite(headroom) & ~overflow & ~held
        shift = torch.clamp(torch.floor(headroom) - margin, min=-_SHIFT_MAX, max=_SHIFT_MAX)
        target = torch.clamp(scale * torch.exp2(shift), min=min_scale,
                             max=HEADROOM_MAX_SCALE if max_scale is None else max_scale)
        new = torch.clamp(torch.where(backoff, backed, torch.where(apply, target, scale)), min=min_scale, max=max_scale)
        moved_down, moved_up = apply & (new < scale), apply & (new > scale)
        state.overflow_run.copy_(torch.where(moved_up, torch.zeros_like(run), run))  # growth refills
        return new, torch.zeros_like(growth_tracker), backoff | moved_down, moved_up, floor_hit

    tracker = torch.where(
        overflow,
        torch.zeros_like(growth_tracker),
        torch.where(held, growth_tracker, growth_tracker + 1),
    )
    grown = scale * growth_factor
    reached = (tracker >= growth_interval) & ~overflow & ~held
    growth = reached & torch.isfinite(grown)
    tracker = torch.where(reached, torch.zeros_like(tracker), tracker)

    new = torch.where(backoff, backed, torch.where(growth, grown, scale))
    new = torch.clamp(new, min=min_scale, max=max_scale)
    if max_scale is not None:
        growth = growth & (grown <= max_scale)
    state.overflow_run.copy_(torch.where(growth, torch.zeros_like(run), run))  # only a growth refills
    return new, tracker, backoff, growth, floor_hit


def headroom_target_host(scale: float, headroom: float, margin: int, min_scale: float,
                         max_scale: float | None) -> float:
    """The headroom policy's next scale on host values (``scale``, ``headroom`` float32 values):
    ``scale * 2**(floor(headroom) - margin)`` (the step bounded to +-126 doublings), clamped to
    [min_scale, max_scale] (None: ``HEADROOM_MAX_SCALE``). Exact: a power-of-two step."""
    shift = min(max(float(math.floor(headroom) - margin), -_SHIFT_MAX), _SHIFT_MAX)
    return clamp_f32(f32(scale * 2.0**shift), min_scale, HEADROOM_MAX_SCALE if max_scale is None else max_scale)


_F32 = struct.Struct("f")


def f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest, ties to even; overflow to inf; NaN stays NaN), as a
    Python float. One float32 operation is the exact result of its float32 operands rounded
    once (53 >= 2*24 + 2 bits: computing it in double first does not change the rounding)."""
    return _F32.unpack(_F32.pack(x))[0]  # type: ignore[no-any-return]


def clamp_f32(x: float, lo: float | None, hi: float | None) -> float:
    """``torch.clamp`` of a float32 value with Python-scalar bounds: the bounds are rounded to
    float32, ``min`` is applied before ``max``, NaN propagates (both comparisons are false)."""
    if lo is not None and x < f32(lo):
        x = f32(lo)
    if hi is not None and x > f32(hi):
        x = f32(hi)
    return x


def next_scale_host(scale: float, growth_tracker: int, overflow: bool, held: bool, overflow_run: int, *,
                    scaler: ScalerView, config: GuardConfig,
                    headroom: float | None = None) -> tuple[float, int, bool, bool, bool, int]:
    """:func:`next_scale` on host values (``scale`` a float32 value), with the scaler's factors
    and interval and the config's hysteresis, floor and ceiling: the same rule, float32 op for op.
    ``headroom``: as for :func:`next_scale` (the headroom policy; None: off).
    Returns ``(new_scale, new_tracker, backoff, growth, floor_hit, new_overflow_run)``."""
    min_scale, max_scale = config.min_scale, config.max_scale
    run = min(overflow_run + 1, config.hysteresis) if overflow else overflow_run
    backoff = overflow and run >= config.hysteresis
    backed = f32(scale * f32(scaler.backoff_factor))
    floor_hit = backoff and backed <= f32(min_scale)
    if headroom is not None:
        apply = math.isfinite(headroom) and not overflow and not held
        new = backed if backoff else (
            headroom_target_host(scale, headroom, config.headroom_margin_log2, min_scale, max_scale) if apply
            else scale)
        new = clamp_f32(new, min_scale, max_scale)
        up = apply and new > scale
        return new, 0, backoff or (apply and new < scale), up, floor_hit, 0 if up else run

    tracker = 0 if overflow else growth_tracker if held else growth_tracker + 1
    grown = f32(scale * f32(scaler.growth_factor))
    reached = tracker >= scaler.growth_interval and not overflow and not held
    growth = reached and math.isfinite(grown)
    if reached:
        tracker = 0

    new = backed if backoff else grown if growth else scale
    new = clamp_f32(new, min_scale, max_scale)
    if max_scale is not None:
        growth = growth and grown <= f32(max_scale)
    return new, tracker, backoff, growth, floor_hit, 0 if growth else run
