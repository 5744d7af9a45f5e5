"""A module call as forensics saves it, and the tensor walks over saved arguments.

While forensics is armed, :class:`Call` keeps each module call's inputs: tensors shared (their
version counters recorded), any other object that is not a plain immutable value copied at the
call, so a later recompute sees what the call saw (a KV cache appended to afterwards, a mutable
config). :func:`copy_tensors` makes the fresh copies each recompute runs on.
"""

from __future__ import annotations

import copy
import enum
import math
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["FP16_MAX", "HALF", "Call", "all_finite", "copy_tensors", "first_tensor", "floats", "inputs_finite",
           "map_tensors", "outputs_finite"]

FP16_MAX = 65504.0
HALF = (torch.float16, torch.bfloat16)



def first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    if isinstance(value, dict):
        for v in value.values():
            if isinstance(v, torch.Tensor):
                return v
    return None


def all_finite(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=t.device)
    return torch.isfinite(t).all()


def floats(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The floating-point tensors in a module's inputs or outputs (tuples, lists, dicts and
    ``ModelOutput``s, a few levels deep), in order."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif depth < 4 and isinstance(value, (tuple, list)):
        for v in value:
            yield from floats(v, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            yield from floats(v, depth + 1)


def inputs_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The first tensor finite, the others free of NaN and +inf (-inf: attention masks)."""
    first, *rest = tensors
    flags = [torch.isfinite(first.detach()).all()]
    flags += [(torch.isfinite(t.detach()) | (t.detach() == -math.inf)).all() for t in rest]
    return flags[0] if not rest else torch.stack([f.to(flags[0].device) for f in flags]).all()


def outputs_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    flags = [torch.isfinite(t.detach()).all() for t in tensors]
    return flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).all()


def map_tensors(value: Any, fn: Any) -> Any:
    """``value`` with every tensor at its top level (positional args, kwargs values) mapped."""
    if isinstance(value, tuple):
        return tuple(fn(v) if isinstance(v, torch.Tensor) else v for v in value)
    return {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in value.items()}


# ---------------------------------------------------------------- what a call saw, kept unchangeable
_ATOMS = (type(None), bool, int, float, complex, str, bytes, enum.Enum, type, torch.dtype, torch.device,
          torch.layout, torch.memory_format, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _plain(value: Any) -> bool:
    """A value later code cannot change without it showing: a tensor (an in-place write moves its
    version), an immutable atom, or a tuple of them."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, (torch.Tensor, *_ATOMS))


def _reachable(value: Any) -> tuple[list[torch.Tensor], list[Any]]:
    """The tensors, and the modules (shared, never copied), reachable from ``value`` through
    containers and object attributes (``__dict__``, ``__slots__``), each once."""
    tensors: list[torch.Tensor] = []
    shared: list[Any] = []
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, torch.Tensor):
            tensors.append(v)
        elif isinstance(v, torch.nn.Module):
            shared.append(v)
        elif isinstance(v, _ATOMS):
            continue
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        else:
            stack.extend(getattr(v, "__dict__", {}).values())
            for cls in type(v).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                for name in (slots,) if isinstance(slots, str) else slots:
                    if name not in ("__dict__", "__weakref__") and hasattr(v, name):
                        stack.append(getattr(v, name))
    return tensors, shared


def copy_tensors(value: Any, fn: Any, reach: tuple[list[torch.Tensor], list[Any]] | None = None) -> Any:
    """A copy of ``value`` (containers and objects, a KV cache included) in which every tensor
    ``t`` is ``fn(t)`` and every module is the same module (``reach``: ``_reachable(value)``)."""
    tensors, shared = _reachable(value) if reach is None else reach
    memo: dict[int, Any] = {id(t): fn(t) for t in tensors}
    memo.update((id(m), m) for m in shared)
    return copy.deepcopy(value, memo)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor has no version counter (and cannot be written to)
        return None


class Call:
    """One forward call of one module, while armed. Flags are indices into ``Localizer._flags``."""

    __slots__ = ("args", "autocast", "copied", "enter", "exit", "grad_nan", "grad_out", "idx", "in_ok", "kwargs",
                 "out_dtype", "out_ok", "parent", "unsaved", "versions")

    def __init__(self, idx: int, parent: int, enter: int) -> None:
        self.idx, self.parent, self.enter = idx, parent, enter
        self.exit = -1
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.autocast: tuple[str, torch.dtype] | None = None
        self.in_ok: int | None = None  # flag index: the inputs were all finite (None: no float input)
        self.out_ok: int | None = None  # flag index: the outputs were all finite (None: no float output)
        self.out_dtype = ""
        self.grad_out: list[int] = []  # flag indices: the gradients arriving at the outputs were finite
        self.grad_nan: list[int] = []  # top-level calls: flag indices: those gradients held a NaN
        self.copied: tuple[str, ...] = ()  # the stateful arguments kept as copies made at the call
        self.unsaved: str | None = None  # why the inputs could not be kept as the call saw them
        self.versions: list[tuple[torch.Tensor, int]] = []  # each saved tensor and its version at the call

    def moved(self) -> list[tuple[torch.Tensor, int]]:
        """The saved tensors written in place since the call (during it or after), with their
        version at the call."""
        return [(t, v) for t, v in self.versions if t._version != v]

    def save(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Keep the call's inputs as the call saw them. Stateful arguments (a KV cache the call and
        later layers append to, a mutable config) are copied now, their tensors shared (a cache that
        appends makes new tensors); the version of every tensor kept is noted, so that a tensor
        written in place afterwards (a static cache, an in-place op) is known to have changed."""
        stateful = [(f"argument {i}", v) for i, v in enumerate(args) if not _plain(v)]
        stateful += [(k, v) for k, v in kwargs.items() if not _plain(v)]
        self.args, self.kwargs = args, kwargs
        reach = _reachable((args, kwargs))
        self.versions = [(t, v) for t in reach[0] if (v := _version(t)) is not None]
        if stateful:
            self.copied = tuple(f"{k} ({type(v).__name__})" for k, v in stateful)
            try:
                self.args, self.kwargs = copy_tensors((args, kwargs), lambda t: t, reach)
            except Exception as exc:  # an object that cannot be copied: the recompute will not run on it
                self.unsaved = (f"its argument(s) {', '.join(self.copied)} could not be copied at the call "
                                f"({type(exc).__name__}: {str(exc)[:120]})")
