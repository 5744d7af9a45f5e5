"""Fault injection: put NaN / +inf / -inf into the loss, a gradient or a module's output,
at chosen steps and ranks. For ampguard's own tests and for yours.

>>> from ampguard import faults
>>> injection = faults.inject(opt, model,
...     faults.loss("nan", steps=[5]),
...     faults.grad("fc1.weight", "inf", steps=range(10, 13), ranks=[1]),
...     faults.output("blocks.2.mlp", "nan", steps=[20]))
>>> ...                 # train as usual
>>> injection.fired     # [(step, rank, fault), ...] what was injected, when
>>> injection.remove()  # or use it as a context manager

Steps are the guarded optimizer's step numbers (``opt.step_count`` while the step is being
computed). Ranks default to every rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Fault", "Injection", "backward", "grad", "inject", "loss", "output"]

_VALUES = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf}


@dataclasses.dataclass(frozen=True)
class Fault:
    """One scheduled fault. Build it with :func:`loss`, :func:`grad` or :func:`output`."""

    where: str
    """"loss" | "grad" | "output" | "backward"."""
    value: float
    """The injected value: NaN, inf or -inf (or any float, e.g. 1e6 to force an fp16 overflow)."""
    steps: frozenset[int] | None
    """Steps at which it fires (None: every step)."""
    ranks: frozenset[int] | None = None
    """Ranks on which it fires (None: every rank)."""
    target: str | None = None
    """Parameter name (grad) or module name (output), as in ``named_parameters``/``named_modules``."""
    after_reduction: bool = False
    """grad only: corrupt the gradient after the ranks reduced it (at the start of ``step()``),
    rather than in backward, before reduction."""
    mode: str = "add"
    """loss only: "add" puts the value into the loss alone (gradients stay finite); "mul" multiplies
    the loss by it, so the gradients become non-finite too."""
    transient: bool = False
    """Fire at most once per step: a replay of the same step (``opt.step(closure, replay=True)``) is clean, as
    with a hardware glitch or a race."""

    def active(self, step: int, rank: int) -> bool:
        return (self.steps is None or step in self.steps) and (self.ranks is None or rank in self.ranks)


def _value(value: float | str) -> float:
    if isinstance(value, str):
        if value.lower() not in _VALUES:
            raise ValueError(f"fault value {value!r}; allowed: 'nan', 'inf', '-inf' or a float")
        return _VALUES[value.lower()]
    return float(value)


def _poke(t: torch.Tensor, value: float) -> None:
    """Write ``value`` into the first element of ``t`` in place, whatever its strides."""
    t[(0,) * t.dim()] = value


def _set(values: Iterable[int] | int | None) -> frozenset[int] | None:
    if values is None:
        return None
    if isinstance(values, int):
        return frozenset([values])
    return frozenset(int(v) for v in values)


def loss(value: float | str = "nan", *, steps: Iterable[int] | int | None, ranks: Iterable[int] | int | None = None,
         mode: str = "add", transient: bool = False) -> Fault:
    """Make the loss non-finite at ``steps`` (see :attr:`Fault.mode`)."""
    if mode not in ("add", "mul"):
        raise ValueError(f"mode={mode!r}; allowed: 'add' | 'mul'")
    return Fault("loss", _value(value), _set(steps), _set(ranks), mode=mode, transient=transient)


def grad(param: str, value: float | str = "nan", *, steps: Iterable[int] | int | None,
         ranks: Iterable[int] | int | None = None, after_reduction: bool = False, transient: bool = False) -> Fault:
    """Put ``value`` into the first element of parameter ``param``'s gradient at ``steps``."""
    return Fault("grad", _value(value), _set(steps), _set(ranks), target=param, after_reduction=after_reduction,
                 transient=transient)


def output(module: str, value: float | str = "nan", *, steps: Iterable[int] | int | None,
           ranks: Iterable[int] | int | None = None, transient: bool = False) -> Fault:
    """Put ``value`` into the first element of module ``module``'s forward output at ``steps``.
    A large finite value (e.g. ``1e5``) overflows fp16 downstream: a realistic overflow."""
    return Fault("output", _value(value), _set(steps), _set(ranks), target=module, transient=transient)


def backward(module: str, value: float | str = "nan", *, steps: Iterable[int] | int | None,
             ranks: Iterable[int] | int | None = None, transient: bool = False) -> Fault:
    """Put ``value`` into the gradient that module ``module``'s backward produces (the gradient
    with respect to its first input), at ``steps``: a fault *in* that module's backward pass."""
    return Fault("backward", _value(value), _set(steps), _set(ranks), target=module, transient=transient)


class _CorruptGrad(torch.autograd.Function):
    """Identity forward; backward puts ``value`` into the first element of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, value: float) -> torch.Tensor:  # type: ignore[override]
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        g = g.clone()
        _poke(g, ctx.value)
        return g, None


class Injection:
    """Active faults; remove them with :meth:`remove` (or leave the ``with`` block)."""

    def __init__(self, opt: Any, model: torch.nn.Module | None, faults: Iterable[Fault]) -> None:
        self.opt = opt
        self.faults = list(faults)
        self.fired: list[tuple[int, int, Fault]] = []
        self._fired_once: set[tuple[int, int]] = set()
        self._handles: list[Any] = []

        model = model if model is not None else getattr(opt, "model", None)
        module_root = getattr(model, "module", model)
        self.rank = int(getattr(getattr(opt, "backend", None), "rank", 0))
        for f in self.faults:
            if not isinstance(f, Fault):
                raise TypeError(f"inject() takes Fault objects (faults.loss/grad/output), got {type(f).__name__}")
            if f.where == "loss":
                self._handles.append(opt.register_loss_hook(self._loss_transform(f)))
            elif f.where == "grad":
                param = self._find(module_root, f.target, "parameter")
                if f.after_reduction:
                    self._handles.append(opt.register_pre_unscale_hook(self._after_reduction(f, param)))
                else:
                    self._handles.append(param.register_hook(self._grad_hook(f)))
            elif f.where == "output":
                module = self._find(module_root, f.target, "module")
                self._handles.append(module.register_forward_hook(self._output_hook(f)))
            elif f.where == "backward":
                module = self._find(module_root, f.target, "module")
                self._handles.append(module.register_forward_pre_hook(self._backward_hook(f)))
            else:
                raise ValueError(f"unknown fault location {f.where!r}")

    def _find(self, root: torch.nn.Module | None, name: str | None, what: str) -> Any:
        if root is None:
            raise ValueError(f"a {what} fault needs the model: pass it to inject() or to ampguard.wrap(model=...)")
        table = dict(root.named_parameters()) if what == "parameter" else dict(root.named_modules())
        if name not in table:
            raise ValueError(f"no {what} named {name!r}; known: {', '.join(list(table)[:20])}")
        return table[name]

    def _fires(self, f: Fault) -> bool:
        step = self.opt.step_count
        if f.transient and (step, id(f)) in self._fired_once:
            return False
        if f.active(step, self.rank):
            self._fired_once.add((step, id(f)))
            self.fired.append((step, self.rank, f))
            return True
        return False

    def _loss_transform(self, f: Fault) -> Any:
        def transform(value: torch.Tensor, step: int) -> torch.Tensor:
            if not self._fires(f):
                return value
            return value * f.value if f.mode == "mul" else value + f.value

        return transform

    def _grad_hook(self, f: Fault) -> Any:
        def hook(g: torch.Tensor) -> torch.Tensor | None:
            if not self._fires(f):
                return None
            g = g.clone()
            _poke(g, f.value)
            return g

        return hook

    def _after_reduction(self, f: Fault, param: torch.Tensor) -> Any:
        def callback(step: int) -> None:
            if param.grad is not None and self._fires(f):
                g = param.grad
                # A sharded (FSDP2 DTensor) gradient: write this rank's shard, locally. Writing
                # through the DTensor would start a collective on this rank alone.
                to_local = getattr(g, "to_local", None)
                local = to_local() if callable(to_local) else g
                with torch.no_grad():
                    _poke(local, f.value)

        return callback

    def _output_hook(self, f: Fault) -> Any:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
            if not torch.is_grad_enabled() or not self._fires(f):
                return None
            t = out[0] if isinstance(out, (tuple, list)) else out
            if not isinstance(t, torch.Tensor):
                return None
            mask = torch.zeros(t.shape, dtype=torch.bool, device=t.device)
            _poke(mask, True)
            t2 = torch.where(mask, torch.full_like(t, f.value), t)
            if isinstance(out, tuple):
                return (t2, *out[1:])
            if isinstance(out, list):
                return [t2, *out[1:]]
            return t2

        return hook

    def _backward_hook(self, f: Fault) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
            if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
                return None
            if not args[0].requires_grad or not self._fires(f):
                return None
            return (_CorruptGrad.apply(args[0], f.value), *args[1:])

        return hook

    def remove(self) -> None:
        """Remove every hook and callback this injection installed. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> Injection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def inject(opt: Any, model: torch.nn.Module | Fault | None = None, *faults: Fault) -> Injection:
    """Install ``faults`` on a guarded optimizer (and its model: by default ``wrap(model=...)``'s).
    Returns the :class:`Injection`."""
    if not hasattr(opt, "register_loss_hook"):
        raise TypeError("inject() needs the optimizer returned by ampguard.wrap()")
    if isinstance(model, Fault):
        faults = (model, *faults)
        model = None
    return Injection(opt, model, faults)
