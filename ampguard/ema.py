"""Weight EMA, updated only on the steps the guard takes, with no host sync.

:class:`EMA` is updated inside ``step()``, right after the inner step, on device:
``torch.where`` on the decision's skip flag keeps the average of a skipped step. See
``docs/schedules.md``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["EMA"]


class EMA:
    """An exponential moving average of a model's floating-point parameters, updated only on
    the steps the guard takes: ``ema = ema + (1 - decay) * (param - ema)`` (``torch.lerp``,
    the formula of ``torch.optim.swa_utils.get_ema_multi_avg_fn``), starting from the weights
    at construction.

    Register it with ``opt.track_ema(ema)``: ``step()`` updates it right after the inner step,
    gated on device by the decision's skip flag (``torch.where``), with no host sync. Kept in
    each parameter's own dtype and device. Buffers (BatchNorm statistics) are not averaged.

    Without a guard, :meth:`update` takes the skip flag itself.
    """

    def __init__(self, model: torch.nn.Module, decay: float = 0.999) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay={decay!r}; expected a number in [0, 1]")
        self.decay = float(decay)
        named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
        self.names: tuple[str, ...] = tuple(n for n, _ in named)
        self._params: list[torch.Tensor] = [p for _, p in named]
        with torch.no_grad():
            self._shadow: list[torch.Tensor] = [p.detach().clone() for p in self._params]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self._params):
            groups.setdefault((p.device, p.dtype), []).append(i)
        self._groups = list(groups.items())
        """(device, dtype) -> indices: one foreach call per group."""

    @property
    def averaged(self) -> dict[str, torch.Tensor]:
        """The averaged parameters by name (the EMA's own tensors: do not modify)."""
        return dict(zip(self.names, self._shadow))

    @torch.no_grad()
    def update(self, skip: torch.Tensor | bool | None = None) -> None:
        """Fold the current parameters into the average, unless ``skip``. ``skip``: a 0-d tensor
        (> 0: skipped; read on device with ``torch.where``, no sync), a host bool, or None (update)."""
        weight = 1.0 - self.decay
        if skip is None or isinstance(skip, bool):
            if skip:
                return
            for _, idx in self._groups:
                torch._foreach_lerp_([self._shadow[i] for i in idx], [self._params[i].detach() for i in idx], weight)
            return
        for (device, _), idx in self._groups:
            keep = (skip > 0).to(device, non_blocking=True)
            shadow = [self._shadow[i] for i in idx]
            new = torch._foreach_lerp(shadow, [self._params[i].detach() for i in idx], weight)
            for s, n in zip(shadow, new):
                torch.where(keep, s, n, out=s)  # bitwise: the old average, or the eager update

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module | None = None) -> None:
        """Write the averaged weights into ``model``'s parameters (default: the averaged model's)."""
        for p, s in zip(self._targets(model), self._shadow):
            p.copy_(s)

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module | None = None) -> Iterator[None]:
        """``with ema.applied():`` the model holds the averaged weights (for eval); its own
        weights come back on exit (kept aside in a copy meanwhile)."""
        targets = self._targets(model)
        with torch.no_grad():
            saved = [p.detach().clone() for p in targets]
            for p, s in zip(targets, self._shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(targets, saved):
                    p.copy_(b)

    def state_dict(self) -> dict[str, Any]:
        """``{"decay": float, "averaged": {name: tensor}}`` (the EMA's own tensors, as
        ``nn.Module.state_dict`` returns its own)."""
        return {"decay": self.decay, "averaged": OrderedDict(zip(self.names, self._shadow))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (copied into this EMA's tensors). Checked first:
        a failed load changes nothing."""
        if not isinstance(state_dict, dict) or "averaged" not in state_dict or "decay" not in state_dict:
            raise ValueError("EMA.load_state_dict() expects a dict made by EMA.state_dict() ('decay', 'averaged')")
        averaged = state_dict["averaged"]
        if not isinstance(averaged, dict) or set(averaged) != set(self.names):
            got = sorted(averaged) if isinstance(averaged, dict) else type(averaged).__name__
            raise ValueError(f"EMA state holds parameters {got!s:.200}; this EMA averages {sorted(self.names)!s:.200}")
        for name, s in zip(self.names, self._shadow):
            t = averaged[name]
            if not isinstance(t, torch.Tensor) or t.shape != s.shape:
                raise ValueError(f"EMA state for {name!r} has shape {getattr(t, 'shape', None)}; expected {s.shape}")
        decay = state_dict["decay"]
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA state decay={decay!r}; expected a number in [0, 1]")
        with torch.no_grad():
            for name, s in zip(self.names, self._shadow):
                s.copy_(averaged[name])
        self.decay = float(decay)

    def _targets(self, model: torch.nn.Module | None) -> list[torch.Tensor]:
        if model is None:
            return self._params
        params = dict(model.named_parameters())
        missing = [n for n in self.names if n not in params]
        if missing:
            raise ValueError(f"the model has no parameter(s) {missing[:5]}: not the architecture this EMA averages")
        return [params[n] for n in self.names]

    def __repr__(self) -> str:
        return f"EMA(decay={self.decay}, parameters={len(self.names)})"
