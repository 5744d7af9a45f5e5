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

With ``torch.compile``: names are as the user wrote them (no ``_orig_mod.``), for the compiled
module or the original. Output and backward faults are traced into the compiled graph (fullgraph
too): there a device flag that the host sets after each ``step()`` decides, so the step number
never enters the graph and nothing recompiles per step; ``fired`` is read back in ``step()``.
``inject()`` marks the target module (a subclass of its class that adds nothing) so that code
compiled before, or on another instance of the same class, is traced again with the hook (one
recompile; ``remove()`` puts the class back). Gradient hooks run in the autograd engine, outside
the graph; loss faults in ``opt.backward``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from .forensics.compile import Retrace, compile_safe, named_user_modules, retrace, user_module, user_name

if TYPE_CHECKING:
    from .guard import GuardedOptimizer

__all__ = ["Fault", "Injection", "backward", "grad", "inject", "loss", "output"]

_VALUES = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf}


@dataclasses.dataclass(frozen=True)
class Fault:
    """One scheduled fault. Build it with :func:`loss`, :func:`grad` or :func:`output`."""

    where: str
    """"loss" | "grad" | "output" | "backward"."""
    value: float
    """The injected value: NaN, inf or -inf, or any float that fits the target tensor's dtype (a
    larger one raises ``ValueError`` naming the dtype's largest value when the fault fires)."""
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


def _check_fits(f: Fault, dtype: torch.dtype) -> None:
    """A finite value beyond ``dtype``'s range cannot be written into a tensor of it (torch refuses):
    say so, naming the fault, the dtype and its largest finite value. NaN and +-inf always fit."""
    if math.isfinite(f.value) and dtype.is_floating_point and abs(f.value) > torch.finfo(dtype).max:
        largest = torch.finfo(dtype).max
        tensor = "output" if f.where == "output" else "gradient"
        raise ValueError(
            f"faults.{f.where}({f.target!r}, {f.value:g}): {f.value:g} does not fit the {tensor}'s dtype {dtype} "
            f"(largest finite value {largest:g}); inject a finite value within +-{largest:g} (a huge one still "
            "overflows what comes after it) or 'inf'/'nan'"
        )


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
    A large finite value that fits the output's dtype (e.g. ``6e4`` under fp16 autocast, whose
    largest value is 65504) overflows fp16 downstream: a realistic overflow. One that does not fit
    (``1e5`` in an fp16 output) raises ``ValueError`` naming the dtype and its largest value when the
    fault fires."""
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


def _first_element(t: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(t.shape, dtype=torch.bool, device=t.device)
    _poke(mask, True)
    return mask


class _CorruptGradIf(torch.autograd.Function):
    """:class:`_CorruptGrad` where the device flag ``on`` says so (traceable: no host decision)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, on: torch.Tensor, value: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(on)
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (on,) = ctx.saved_tensors
        return torch.where(_first_element(g) & on.to(g.device), torch.full_like(g, ctx.value), g), None, None


class _Switch:
    """A module fault's state on device, for when torch.compile traces its hook: the compiled code
    reads ``on`` (does it fire on this step?) and counts in ``hits``, so the step number never
    enters the graph. ``due`` mirrors ``on`` on the host."""

    def __init__(self, device: torch.device) -> None:
        self.on = torch.zeros((), dtype=torch.bool, device=device)
        self.hits = torch.zeros((), dtype=torch.int32, device=device)
        self.due = False

    def fire(self, device: torch.device) -> torch.Tensor:
        """In traced code: the flag, counted as a hit when set."""
        self.hits.add_(self.on.to(self.hits.dtype))
        return self.on.to(device)


def _device_of(*modules: torch.nn.Module | None) -> torch.device:
    for m in modules:
        if m is not None:
            for t in (*m.parameters(), *m.buffers()):
                return t.device
    return torch.device("cpu")


class Injection:
    """Active faults; remove them with :meth:`remove` (or leave the ``with`` block)."""

    def __init__(self, opt: GuardedOptimizer, model: torch.nn.Module | None, faults: Iterable[Fault]) -> None:
        self.opt = opt
        self.faults = list(faults)
        self.fired: list[tuple[int, int, Fault]] = []
        self._fired_once: set[tuple[int, int]] = set()
        self._handles: list[Any] = []
        self._marks: list[Retrace] = []
        self._switches: list[tuple[Fault, _Switch]] = []

        model = model if model is not None else getattr(opt, "model", None)
        module_root = user_module(model) if model is not None else None
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
                    self._handles.append(param.register_hook(compile_safe(self._grad_hook(f))))
            elif f.where in ("output", "backward"):
                module = self._find(module_root, f.target, "module")
                switch = _Switch(_device_of(module, module_root))
                self._switches.append((f, switch))
                if f.where == "output":
                    self._handles.append(module.register_forward_hook(self._output_hook(f, switch)))
                else:
                    self._handles.append(module.register_forward_pre_hook(self._backward_hook(f, switch)))
                self._marks.append(retrace(module))
            else:
                raise ValueError(f"unknown fault location {f.where!r}")
        if self._switches:
            self._handles.append(opt.register_pre_unscale_hook(self._settle))
            self._handles.append(opt.register_step_post_hook(lambda *_: self._arm(opt.step_count)))
            self._arm(opt.step_count)

    def _find(self, root: torch.nn.Module | None, name: str | None, what: str) -> Any:
        if root is None:
            raise ValueError(f"a {what} fault needs the model: pass it to inject() or to ampguard.wrap(model=...)")
        table = ({user_name(n): p for n, p in root.named_parameters()} if what == "parameter"
                 else dict(named_user_modules(root)))
        if name is None or name not in table:
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

    # Module faults under torch.compile (the hook traced into the graph): the host sets each switch
    # for the coming step after every step(); step() reads the hits back (one sync, steps where a
    # switch is on only) and records them in ``fired``, before a replay.
    def _arm(self, step: int) -> None:
        self._settle(step - 1)  # hits a step() did not settle (a rollback consumed it)
        for f, switch in self._switches:
            due = f.active(step, self.rank) and not (f.transient and (step, id(f)) in self._fired_once)
            if due != switch.due:
                switch.on.fill_(due)
                switch.due = due

    def _settle(self, step: int) -> None:
        for f, switch in self._switches:
            if not switch.due:
                continue
            hits = int(switch.hits)  # SYNC (steps where the fault is due only)
            if not hits:
                continue
            switch.hits.zero_()
            self._fired_once.add((step, id(f)))
            self.fired.extend([(step, self.rank, f)] * hits)
            if f.transient:  # the replay of this step is clean
                switch.on.fill_(False)
                switch.due = False

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
            _check_fits(f, g.dtype)
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
                _check_fits(f, local.dtype)
                with torch.no_grad():
                    _poke(local, f.value)

        return callback

    # Traced by torch.compile (is_compiling()): the device switch decides, no Python state is read.
    # Run eagerly: the step number decides, as always.
    def _output_hook(self, f: Fault, switch: _Switch) -> Any:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
            if not torch.is_grad_enabled():
                return None
            traced = torch.compiler.is_compiling()
            if not traced and not self._fires(f):
                return None
            t = out[0] if isinstance(out, (tuple, list)) else out
            if not isinstance(t, torch.Tensor):
                return None
            _check_fits(f, t.dtype)
            mask = _first_element(t)
            if traced:
                mask = mask & switch.fire(t.device)
            t2 = torch.where(mask, torch.full_like(t, f.value), t)
            if isinstance(out, tuple):
                return (t2, *out[1:])
            if isinstance(out, list):
                return [t2, *out[1:]]
            return t2

        return hook

    def _backward_hook(self, f: Fault, switch: _Switch) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
            if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
                return None
            if not args[0].requires_grad:
                return None
            traced = torch.compiler.is_compiling()
            if not traced and not self._fires(f):
                return None
            _check_fits(f, args[0].dtype)  # the gradient it corrupts has its input's dtype
            if traced:
                return (_CorruptGradIf.apply(args[0], switch.fire(args[0].device), f.value), *args[1:])
            return (_CorruptGrad.apply(args[0], f.value), *args[1:])

        return hook

    def remove(self) -> None:
        """Remove every hook and callback this injection installed. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mark in reversed(self._marks):
            mark.undo()
        self._marks.clear()

    def __enter__(self) -> Injection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def inject(opt: torch.optim.Optimizer, model: torch.nn.Module | Fault | None = None, *faults: Fault) -> Injection:
    """Install ``faults`` on a guarded optimizer (and its model: by default ``wrap(model=...)``'s).
    ``opt`` is the optimizer ``ampguard.wrap()`` returned, or a framework's wrapper of it whose
    ``.guard`` is that optimizer (accelerate's). Returns the :class:`Injection`."""
    from .guard import GuardedOptimizer

    guard = getattr(opt, "guard", None)  # a framework's wrapper around the guard (accelerate's)
    guarded = guard if isinstance(guard, GuardedOptimizer) else opt
    if not isinstance(guarded, GuardedOptimizer):
        raise TypeError("inject() needs the optimizer returned by ampguard.wrap()")
    if isinstance(model, Fault):
        faults = (model, *faults)
        model = None
    return Injection(guarded, model, faults)
