"""torch.compile and the hooks ampguard arms: how compiled code is made to see them, and names
as the user wrote them (no ``_orig_mod.``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Retrace", "compile_safe", "named_user_modules", "retrace", "user_module", "user_name"]


# ---------------------------------------------------------------- torch.compile
# Under torch.compile, module hooks are not called per module: dynamo inlines each submodule's call
# into the compiled code and, by default (``torch._dynamo.config.skip_nnmodule_hook_guards``), does
# not guard on empty hook dicts, so code compiled before the hooks existed never calls them (measured
# on a compiled GPT: only the root's hooks fire, 1 of 25 modules). Hooks present when dynamo traces
# are traced into the graph: their Python state baked in and guarded on (recompiles until dynamo's
# limit, measured), their tensor hooks put on graph intermediates (where they can be called with
# None: the crash reported on nanoGPT). So:
#
# - while armed, compiled code runs eagerly (``torch.compiler.set_stance("force_eager")``, the whole
#   process, from arming to disarming): every hook fires as without compile, nothing is traced or
#   recompiled, and fullgraph=True regions do not object; disarmed, the cached compiled code runs
#   again. The armed steps are eager steps: slower, more activation memory, and a NaN that only the
#   compiled kernels produce does not recur while armed. (torch < 2.6 has no stance: hooks inside
#   compiled code are then not called);
# - every hook body here is :func:`compile_safe`: where dynamo does trace a hooked call anyway (the
#   stance could not be set; compiled autograd), the call is a graph break and the body runs eagerly
#   on real tensors; the gradient hooks take None. (``ampguard.faults`` is traced instead: see there.)


def compile_safe(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` never traced by torch.compile: where dynamo meets a call to it, it breaks the graph and
    calls it eagerly, so it sees real tensors and Python state that dynamo would otherwise bake into
    the graph (and guard on, recompiling when it changes)."""
    return torch.compiler.disable(fn, recursive=True)


# Process-wide: one marked subclass per module class, created on first use and kept for the process
# (bounded by the module classes ever marked). Every mark of a class gives the same subclass, so code
# compiled for a marked module is reused by the next injection on that class instead of counting
# towards dynamo's recompile limit. Nothing is undone: the subclass adds nothing, and a module is
# re-classed back by Retrace.undo().
_MARKED: dict[type, type] = {}


def _marked(cls: type) -> type:
    """A subclass of ``cls`` that adds nothing: a module of it behaves the same, but torch.compile's
    guards on the module's type fail, so compiled code that inlined the module is traced again."""
    if cls not in _MARKED:
        _MARKED[cls] = type(cls.__name__, (cls,), {"__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return _MARKED[cls]


class Retrace:
    """A module re-classed by :func:`retrace`; :meth:`undo` puts its class back."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.previous = module, type(module)
        module.__class__ = _marked(self.previous)

    def undo(self) -> None:
        if type(self.module) is _marked(self.previous):  # not changed since: code cached for the plain class fits
            self.module.__class__ = self.previous


def retrace(module: torch.nn.Module) -> Retrace:
    """Make torch.compile trace ``module``'s call again, now with its new hook (how ``ampguard.faults``
    gets its hooks traced into compiled code): dynamo does not guard on an empty hook dict, so code
    compiled before (or on another instance of the same class) would never call the hook; it does
    guard on the type. Undo it with the returned :meth:`Retrace.undo`."""
    return Retrace(module)


class _EagerWhileArmed:
    """``torch.compiler.set_stance("force_eager")`` while any Localizer is armed (counted: several
    guarded optimizers may arm at once); the stance from before put back when the last disarms.

    Process-wide, necessarily: dynamo's stance is one setting of the process, and so is this count
    (class attributes, not per guard). Only touched once something was compiled in the process;
    undone by the last :func:`_disarm` (a Localizer's ``remove()`` or its finalizer), unless the
    stance was changed by someone else since (theirs is left as it is)."""

    armed = 0
    stance: Any = None

    @classmethod
    def enter(cls) -> bool:
        if not _compiled_anything():  # nothing compiled in this process: no stance to change
            return False
        if cls.armed == 0 and cls.stance is None:
            set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
            if set_stance is None:
                return False
            try:
                cls.stance = set_stance("force_eager")  # sets it now; keeps the previous
            except RuntimeError:  # called inside a compiled region: leave the stance alone
                return False
        cls.armed += 1
        return True

    @classmethod
    def exit(cls) -> None:
        cls.armed -= 1
        if cls.armed == 0 and cls.stance is not None:
            eval_frame = sys.modules.get("torch._dynamo.eval_frame")
            if getattr(eval_frame, "_stance", None) is cls.stance.stance:  # nobody changed it since
                try:
                    cls.stance.__exit__(None, None, None)  # the stance from before
                except RuntimeError:  # inside a compiled region (a finalizer run by the GC): keep it for
                    return  # the next enter() to take over
            cls.stance = None


def _compiled_anything() -> bool:
    """Whether dynamo compiled any frame in this process (its counters survive ``reset()``): only
    then can hooks be missed, and only then is the process's compile stance touched."""
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.utils import counters

    return bool(counters["frames"]["ok"])


def _disarm(handles: list[Any], eager: bool) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    if eager:
        _EagerWhileArmed.exit()


def _compiled_wrapper_type() -> type | None:
    """``torch.compile``'s module wrapper class, if dynamo was imported (else nothing is compiled)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def _strip_compiled(module: torch.nn.Module) -> torch.nn.Module:
    wrapper = _compiled_wrapper_type()
    while wrapper is not None and isinstance(module, wrapper):
        module = module._modules["_orig_mod"]  # type: ignore[assignment]  # always a Module
    return module


def user_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module the user wrote: without the DDP/FSDP ``module`` wrapper and without
    ``torch.compile``'s ``OptimizedModule`` (outside or inside the DDP wrapper)."""
    root = _strip_compiled(model)
    return _strip_compiled(getattr(root, "module", root))


def user_name(name: str) -> str:
    """A qualified name without the ``_orig_mod`` of modules compiled inside the model."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod") if "_orig_mod" in name else name


def named_user_modules(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``root.named_modules()`` as the user wrote them: compiled submodules' wrappers left out (their
    ``_orig_mod`` takes the wrapper's name)."""
    wrapper = _compiled_wrapper_type()
    return [(user_name(name), m) for name, m in root.named_modules()
            if wrapper is None or not isinstance(m, wrapper)]


