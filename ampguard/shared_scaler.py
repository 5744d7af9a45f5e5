"""Several guards on one ``torch.amp.GradScaler``: the scaler's public calls while any guard is
on it, and the iteration's one scale update (:class:`SharedScaler`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .errors import GuardStateError
from .ops import HOST, Ops, TensorOps
from .scale_rule import ScalerView, next_scale

if TYPE_CHECKING:
    from .config import GuardConfig

__all__ = ["SharedScaler"]


class Guard(Protocol):
    """What the scaler's patched calls need of a guard."""

    config: GuardConfig
    optimizer: torch.optim.Optimizer

    def unscale_(self) -> None: ...


class Member(Protocol):
    """What the shared scaler needs of each guard's scaler adapter (:class:`~ampguard.scaling.GradScalerAdapter`)."""

    config: GuardConfig | None
    scaled_since_step: bool

    @property
    def guard(self) -> Guard | None: ...
    _targets: tuple[int, ...]

    def forget(self, optimizer: object) -> None: ...

    def view(self) -> ScalerView: ...

    def _apply(self, new_scale: torch.Tensor | float, tracker: torch.Tensor | int | None) -> None: ...

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
        self.members: list[Member] = []
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

    def join(self, member: Member) -> None:
        self.members.append(member)

    def leave(self, member: Member) -> None:
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

    def _member(self, optimizer: torch.optim.Optimizer) -> Member | None:
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
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        member = self._member(optimizer)
        if member is None:
            raise self._refuse_unguarded("step")
        member.forget(optimizer)
        raise GuardStateError(
            "scaler.step(opt) was called on a guarded optimizer: the guard already unscales, checks and "
            "steps. Replace `scaler.step(opt); scaler.update()` with `opt.step()`. Nothing was changed."
        )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        member = self._member(optimizer)
        if member is None:
            raise self._refuse_unguarded("unscale_")
        assert member.guard is not None  # internal: members are attached
        member.guard.unscale_()

    def update(self, new_scale: Any = None) -> None:
        if new_scale is None and self.pending:  # ends an iteration in which not every guard stepped
            self.flush()
            self.updated = False
            return None
        if self.updated and new_scale is None:
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
    def check_iteration(self, member: Member) -> None:
        if id(member) in self.pending:
            raise GuardStateError(
                f"this guard already stepped in this iteration of a GradScaler shared by {len(self.members)} guards, "
                "whose scale is updated after every one of them stepped. Where only some of them step in an "
                "iteration, end it with scaler.update() after their steps (before the next backward). Nothing "
                "was changed.")

    def contribute(self, member: Member, overflow: torch.Tensor | bool, skip: torch.Tensor | bool) -> None:
        self.pending[id(member)] = (overflow, skip)
        if all(id(m) in self.pending for m in self.members):
            self.flush()

    def flush(self) -> None:
        """The iteration's one scale update: GradScaler's rule (:func:`~ampguard.scale_rule.next_scale`
        with hysteresis 1) on the flags of the guards that stepped (overflow: any; held: a skip
        without overflow), within the guards' [min_scale, max_scale]. It runs where the scale lives:
        on host values for a CPU scaler, on device tensors otherwise (host flags by a fill: no sync)."""
        flags = list(self.pending.values())
        self.pending.clear()
        first = self.members[0]
        view, config = first.view(), first.config
        assert config is not None  # internal: members are attached
        dev = view.scale.device
        o: Ops
        run: Any
        if dev.type == "cpu":
            o, run = HOST, 0
            overflow: Any = any(bool(f) for f, _ in flags)
            held: Any = not overflow and any(bool(f) for _, f in flags)
        else:
            o, run = TensorOps(dev), torch.zeros((), dtype=torch.int32, device=dev)
            overflow = torch.stack([_on(f, dev) for f, _ in flags]).any()
            held = torch.stack([_on(f, dev) for _, f in flags]).any() & ~overflow
        new, tracker, *_ = next_scale(
            o, scale=o.value(view.scale), growth_tracker=o.value(view.growth_tracker), overflow=overflow, held=held,
            overflow_run=run, growth_factor=view.growth_factor, backoff_factor=view.backoff_factor,
            growth_interval=view.growth_interval, hysteresis=1, min_scale=config.min_scale,
            max_scale=config.max_scale)
        first._apply(new, tracker)
        self.updated = True


def _on(flag: torch.Tensor | bool, device: torch.device) -> torch.Tensor:
    """A skip/overflow flag as a 0-d bool tensor on ``device`` (a host bool by a fill: no copy, no sync)."""
    if isinstance(flag, bool):
        return torch.full((), flag, dtype=torch.bool, device=device)
    return flag.to(device, non_blocking=True).reshape(()).bool()
