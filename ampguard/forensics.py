"""Where a non-finite value came from (module, phase, rank) and why (overflow, NaN, transient).

Healthy runs pay nothing: no hook exists until a step goes non-finite. Then the guard arms
a :class:`Localizer` on the model for the following steps (``GuardConfig.forensics_window``
clean steps, then it disarms). While armed, every module's forward output, and the
gradients arriving at and leaving every module, are checked on device; the flags are read
with one host sync per step (armed steps only). On the next non-finite step it names the
**first** module, in execution order, whose forward output, or whose backward gradient,
became non-finite.

With a replay closure (``opt.step(closure, replay=True)``) the guard replays a non-finite step with the
hooks armed at the same loss scale, so the culprit is named on the step itself, and a
replay that comes out clean is classified ``"transient"``.

With ``torch.compile`` (the model compiled whole, in place, per submodule, fullgraph or not; the
guard given the compiled module or the original): names are as the user wrote them (no
``_orig_mod.``), and while armed, compiled code runs eagerly (``torch.compiler.set_stance
("force_eager")``), so every module is seen as without compile and nothing recompiles; the cached
compiled code runs again once disarmed. Armed steps are therefore eager steps (slower, more
activation memory), and a NaN that only the compiled kernels produce does not recur while armed:
it is reported, and skipped, but not attributed to a module.

Classification (``Anomaly.cause``):

- ``"overflow"``: the culprit's computation is finite in fp32 but exceeds fp16's range
  (max-abs > 65504), or a backward gradient went to ±inf under fp16 loss scaling;
- ``"nan"``: the culprit's computation is non-finite in fp32 too (log of 0, 0/0, bad data);
- ``"transient"``: recomputing the culprit (or replaying the batch) is clean.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .vocab import Cause, Phase

__all__ = ["FP16_MAX", "Finding", "Localizer", "compile_safe", "named_user_modules", "user_module", "user_name"]

FP16_MAX = 65504.0


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """What the localizer found on one step."""

    module: str
    """Qualified name as the user wrote it (no DDP ``module.`` prefix); "" for the model root."""
    phase: Phase
    """"forward" | "backward" | "loss"."""
    cause: Cause
    """"overflow" | "nan" | "transient"."""
    dtype: str
    """dtype of the non-finite tensor."""
    input_max_abs: float
    """max |x| of the culprit's (finite) input, or NaN where unknown."""
    detail: str
    rank: int | None = None
    """The rank whose view this is (in a distributed run, the first rank where it originated)."""


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


class _EagerWhileArmed:
    """``torch.compiler.set_stance("force_eager")`` while any Localizer is armed (counted: several
    guarded optimizers may arm at once); the stance from before put back when the last disarms."""

    armed = 0
    stance: Any = None

    @classmethod
    def enter(cls) -> bool:
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


def _first_tensor(value: Any) -> torch.Tensor | None:
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


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=t.device)
    return torch.isfinite(t).all()


class Localizer:
    """Hooks on every module of ``model``; one record per hook firing, flags kept on device."""

    def __init__(self, model: torch.nn.Module) -> None:
        root = user_module(model)  # DDP/FSDP/torch.compile wrappers: names as the user wrote them
        self.root = root
        self.modules: list[tuple[str, Any]] = named_user_modules(root)
        self._handles: list[Any] = []
        self._recomputing = False
        self.reset()
        for idx, (_, m) in enumerate(self.modules):
            # prepend: see the inputs as the caller passed them, before other pre-hooks replace them
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(idx), prepend=True))
            self._handles.append(m.register_forward_hook(self._fwd_hook(idx)))
        eager = _EagerWhileArmed.enter()  # torch.compile: see the comment above compile_safe
        self._disarm = weakref.finalize(self, _disarm, self._handles, eager)
        self._disarm.atexit = False

    # Each record: (order, module index, phase, finite flag tensor, tensor dtype).
    def reset(self) -> None:
        self._fwd: list[tuple[int, int, torch.Tensor, str, torch.Tensor | None]] = []
        self._bwd_out: dict[int, torch.Tensor] = {}  # module -> finite flag of grad at its output
        # (module, finite flag of the gradient at its input, dtype, which input tensor)
        self._bwd_in: list[tuple[int, torch.Tensor, str, int]] = []
        self._inputs: dict[int, tuple[Any, ...]] = {}
        self._order = 0

    def remove(self) -> None:
        self._disarm()  # once; also when the Localizer is collected without remove()
        self.reset()

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    # The hooks are compile_safe: where torch.compile traces a module call (a region compiled while
    # they were on it), they run eagerly at a graph break instead of being traced into the graph.
    # The module hooks hold the Localizer weakly: a guard dropped while armed does not keep it (and the
    # force_eager stance) alive through the model; its finalizer removes the hooks.
    def _pre_hook(self, idx: int) -> Any:
        ref = weakref.ref(self)

        @compile_safe
        def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            loc = ref()
            if loc is None or loc._recomputing or not torch.is_grad_enabled():
                return
            loc._inputs[idx] = args
            x = _first_tensor(args)
            if x is not None and x.requires_grad and x.is_floating_point():
                x.register_hook(loc._in_grad_hook(idx, id(x)))

        return hook

    def _fwd_hook(self, idx: int) -> Any:
        ref = weakref.ref(self)

        @compile_safe
        def hook(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
            loc = ref()
            if loc is None or loc._recomputing or not torch.is_grad_enabled():
                return
            t = _first_tensor(out)
            if t is None or not t.is_floating_point():
                return
            x = _first_tensor(args)
            in_max = x.detach().abs().max().float() if x is not None and x.is_floating_point() and x.numel() else None
            loc._fwd.append((loc._order, idx, _all_finite(t.detach()), str(t.dtype), in_max))
            loc._order += 1
            if t.requires_grad:
                t.register_hook(loc._out_grad_hook(idx))

        return hook

    # Gradient hooks may get None (no gradient flowed to that tensor: an output that did not require
    # grad in a compiled graph, a branch the loss does not depend on): nothing to check then.
    def _out_grad_hook(self, idx: int) -> Any:
        @compile_safe
        def hook(g: torch.Tensor | None) -> None:
            if g is not None:
                self._bwd_out[idx] = _all_finite(g)

        return hook

    def _in_grad_hook(self, idx: int, key: int) -> Any:
        @compile_safe
        def hook(g: torch.Tensor | None) -> None:
            if g is not None:
                self._bwd_in.append((idx, _all_finite(g), str(g.dtype), key))

        return hook

    def collect(self, *, loss_finite: bool, fp16_scaling: bool) -> Finding | None:
        """Read the flags (one host sync) and name the first culprit, or None if all were finite."""
        finding = None
        if self._fwd:
            flags = torch.stack([f[2] for f in self._fwd]).cpu().tolist()
            for (_, idx, _, dtype, in_max), ok in zip(self._fwd, flags):
                if not ok:
                    finding = self._forward_finding(idx, dtype, in_max)
                    break
        if finding is None and not loss_finite:
            finding = Finding("", Phase.LOSS, Cause.NAN, "float32", float("nan"),
                              "the forward outputs were finite; the loss itself was non-finite")
        if finding is None and self._bwd_in:
            # Backward order: the first module whose input-gradient is non-finite while the gradient
            # arriving at its output was finite produced it.
            flags = torch.stack([f[1] for f in self._bwd_in]).cpu().tolist()
            out_flags = {k: bool(v) for k, v in zip(self._bwd_out, torch.stack(list(self._bwd_out.values()))
                                                     .cpu().tolist())} if self._bwd_out else {}
            candidates = [(idx, dtype, key) for (idx, _, dtype, key), ok in zip(self._bwd_in, flags)
                          if not ok and out_flags.get(idx, True)]
            if candidates:
                # Modules sharing one input tensor (a block and its first sub-layer) get the same
                # gradient; the deepest of them is the one whose backward wrote into it.
                key = candidates[0][2]
                idx, dtype, _ = max((c for c in candidates if c[2] == key), key=lambda c: self._depth(c[0]))
                name = self.modules[idx][0]
                cause = Cause.OVERFLOW if fp16_scaling else Cause.NAN
                finding = Finding(name, Phase.BACKWARD, cause, dtype, float("nan"),
                                  f"the gradient leaving {name or 'the model'} in backward became non-finite"
                                  f" ({dtype}) while the gradient arriving at its output was finite")
        if finding is None:
            finding = self._param_finding(fp16_scaling)
        self.reset()
        return finding

    def _param_finding(self, fp16_scaling: bool) -> Finding | None:
        """No module output or input-gradient was non-finite, yet a parameter gradient is (a hook,
        a custom autograd function, corruption between backward and step): name the module that
        owns the first such parameter in backward order (the reverse of the module order)."""
        for name, module in reversed(self.modules):
            for pname, p in module.named_parameters(recurse=False):
                g = p.grad
                if g is None:
                    continue
                g = g.to_local() if callable(getattr(g, "to_local", None)) else g
                if bool(torch.isfinite(g).all()):
                    continue
                has_nan = bool(torch.isnan(g).any())
                cause = Cause.OVERFLOW if fp16_scaling and not has_nan else Cause.NAN
                full = f"{name}.{pname}" if name else pname
                return Finding(name, Phase.BACKWARD, cause, str(g.dtype), float("nan"),
                               f"the gradient of {full} is non-finite ({'NaN' if has_nan else 'inf'}) while every "
                               "module's output and input gradients were finite")
        return None

    def _depth(self, idx: int) -> int:
        name = self.modules[idx][0]
        return name.count(".") + 1 if name else 0

    def _forward_finding(self, idx: int, dtype: str, in_max: torch.Tensor | None) -> Finding:
        name, module = self.modules[idx]
        in_max_f = float(in_max) if in_max is not None else float("nan")
        cause = self._classify_forward(idx, module)
        label = name or "the model"
        detail = {
            "overflow": f"{label}'s output overflowed {dtype} (finite in fp32, beyond ±{FP16_MAX:g})",
            "nan": f"{label}'s output is non-finite in fp32 too: a genuine NaN/inf (bad input or math)",
            "transient": f"{label}'s output was non-finite but recomputing it is clean: transient or injected",
        }[cause]
        return Finding(name, Phase.FORWARD, cause, dtype, in_max_f, f"{detail}; input max |x| = {in_max_f:.4g}")

    @torch.no_grad()
    def _classify_forward(self, idx: int, module: torch.nn.Module) -> Cause:
        args = self._inputs.get(idx)
        if args is None:
            return Cause.NAN
        self._recomputing = True
        try:
            fp32_args = tuple(a.detach().float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                              for a in args)
            device_type = next((a.device.type for a in fp32_args if isinstance(a, torch.Tensor)), "cpu")
            cuda = [a.device for a in fp32_args if isinstance(a, torch.Tensor) and a.device.type == "cuda"][:1]
            # The recompute must not draw from the run's RNG (a dropout inside the module would
            # shift every later mask): fork it, CPU and the module's CUDA device.
            with torch.random.fork_rng(devices=cuda), torch.autocast(device_type=device_type, enabled=False):
                out = _first_tensor(module(*fp32_args))
            if out is None:
                return Cause.NAN
            out = out.float()
            if not bool(torch.isfinite(out).all()):
                return Cause.NAN
            if float(out.abs().max()) > FP16_MAX:
                return Cause.OVERFLOW
            return Cause.TRANSIENT
        except Exception:  # a module that cannot be re-run on its saved input: say what we know
            return Cause.NAN
        finally:
            self._recomputing = False
