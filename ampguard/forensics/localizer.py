"""Where a non-finite value came from (module, phase, rank) and why (overflow, NaN, transient).

Healthy runs pay nothing: no hook exists until a step goes non-finite. Then the guard arms
a :class:`Localizer` on the model for the following steps (``GuardConfig.forensics_window``
clean steps, then it disarms). While armed, every module call's inputs and outputs, and the
gradients arriving at its output and leaving it through its inputs, are checked on device; the
flags are read with one host sync per step (armed steps only).

The rule (:meth:`Localizer.collect`), first match wins:

1. **input**: a module called from outside every hooked module (the model itself) receives a
   non-finite input: the batch is bad (``Phase.INPUT``, no module), unless a module named below
   went non-finite earlier;
2. **forward**: the first module call, in execution order, whose inputs were all finite and
   whose output was not. A container finishes after its children, so it is named only when no
   child qualifies: the non-finite value arose in its own code (an attention's ``q @ kᵀ`` and
   softmax). An embedding's integer input counts as finite, so a NaN embedding row names it;
3. **loss**: every module output was finite, the loss was not (``Phase.LOSS``, no module, no
   cause: nothing between the model's output and the loss can be recomputed);
4. **backward**: the first module, in backward order, whose incoming gradient (at its outputs)
   was finite and whose outgoing gradient (at its inputs) was not. Each module sees its inputs
   through views of its own, so its outgoing gradient is its own contribution, not the sum of
   every consumer of the same tensor;
5. **parameter**: every flag above was finite, yet a parameter's gradient is not (a hook, a
   custom autograd function, corruption between backward and step): its owner and the parameter.

"All finite" for a module's inputs: its first floating-point input entirely finite, the others
free of NaN and +inf (-inf is the masking convention of additive attention masks).

Classification of a forward culprit (``Finding.cause``), from evidence: the culprit is
recomputed on its saved inputs twice, in the run's precision (the autocast state of the call,
and the module's own weights, half precision included) and in fp32 (inputs and a float32 copy
of its half-precision parameters and buffers). The saved inputs are what the call saw: stateful
arguments (a KV cache the call and later layers append to) are copied at the call, and each
recompute runs on copies of its own (:mod:`ampguard.forensics.recompute`), so the run's cache is untouched:

- non-finite in the run's precision, finite in fp32 -> ``"overflow"`` (also inside the
  module, as attention logits past 65504 in fp16);
- non-finite in both -> ``"nan"`` (log of a negative, 0/0, a NaN weight);
- finite in both -> ``"not_reproduced"``: the module's math on these inputs is fine (an
  injected value, a race, hardware, or state the recompute does not see);
- a recompute that fails (an error, sharded parameters), or not run because a saved input was
  written in place after the call or could not be copied -> cause None, the reason in ``detail``.

A backward culprit is ``"overflow"`` when its gradient holds inf but no NaN under fp16 loss
scaling, else ``"nan"``; the same for a gradient that was non-finite already where the loss's
backward entered the model. A non-finite model input is ``"nan"`` (bad data).

A replay (``opt.step(closure, replay=True)``, :mod:`ampguard.forensics.arming`) then decides
persistence: a replay that reproduces keeps the recompute's cause (``persistent=True``); a
clean replay makes it ``"transient"`` (``persistent=False``).

With ``torch.compile`` (the model compiled whole, in place, per submodule, fullgraph or not; the
guard given the compiled module or the original): names are as the user wrote them (no
``_orig_mod.``), and while armed, compiled code runs eagerly (``torch.compiler.set_stance
("force_eager")``), so every module is seen as without compile and nothing recompiles; the cached
compiled code runs again once disarmed. Armed steps are therefore eager steps (slower, more
activation memory), and a NaN that only the compiled kernels produce does not recur while armed:
it is reported, and skipped, but not attributed to a module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..module_hooks import Hook
from ..vocab import Cause, Phase
from .calls import Call, all_finite, first_tensor, floats, inputs_finite, map_tensors, outputs_finite
from .compile import _disarm, _EagerWhileArmed, compile_safe, named_user_modules, user_module
from .recompute import classify

__all__ = ["Finding", "Localizer"]


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """What the localizer found on one step."""

    module: str | None
    """Qualified name as the user wrote it (no DDP ``module.`` prefix), "" for the model root;
    None where no module applies (the input batch, the loss)."""
    phase: Phase | None
    """"input" | "forward" | "loss" | "backward"; None where unknown (a clean replay of a step
    whose first pass was not observed)."""
    cause: Cause | None
    """"overflow" | "nan" | "not_reproduced" | "transient"; None where the evidence could not
    be gathered (``detail`` says why)."""
    dtype: str
    """dtype of the non-finite tensor."""
    input_max_abs: float
    """max |x| of the culprit's first input, or NaN where unknown."""
    detail: str
    rank: int | None = None
    """The rank whose view this is (in a distributed run, the first rank where it originated)."""
    param: str | None = None
    """The parameter named, when the finding is about one parameter's gradient."""
    persistent: bool | None = None
    """A replay of the same batch reproduced it (True), was clean (False); None: no replay."""



class Localizer:
    """Hooks on every module of ``model``; one record per module call, flags kept on device."""

    def __init__(self, model: torch.nn.Module, within: str | None = None) -> None:
        root = user_module(model)  # DDP/FSDP/torch.compile wrappers: names as the user wrote them
        self.root = root
        self.within = within
        """Hooks on this module and its descendants only (a block the sentinel named); None: all."""
        self.modules: list[tuple[str, Any]] = [
            (n, m) for n, m in named_user_modules(root)
            if not within or n == within or n.startswith(f"{within}.")]
        self._handles: list[Any] = []
        self._recomputing = False
        self.reset()
        for idx, (_, m) in enumerate(self.modules):
            # prepend: see the inputs as the caller passed them, before other pre-hooks replace them
            self._handles.append(m.register_forward_pre_hook(Hook(self._pre_hook(idx)), prepend=True, with_kwargs=True))
            self._handles.append(m.register_forward_hook(Hook(self._fwd_hook(idx))))
        eager = _EagerWhileArmed.enter()  # torch.compile: see the comment above compile_safe
        self._disarm = weakref.finalize(self, _disarm, self._handles, eager)
        self._disarm.atexit = False

    def reset(self) -> None:
        self._calls: list[Call] = []
        self._stack: list[int] = []  # the calls under way, innermost last
        self._flags: list[torch.Tensor] = []  # 0-dim bool tensors on device, read at collect
        # backward order: (call, flag index: the gradient leaving it through this input was finite,
        # flag index: it held a NaN, dtype)
        self._grad_in: list[tuple[int, int, int, str]] = []
        self._seq = 0
        self.observed = False
        """A forward call was recorded since the last reset."""

    def remove(self) -> None:
        self._disarm()  # once; also when the Localizer is collected without remove()
        self.reset()

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    @contextlib.contextmanager
    def _quietly(self) -> Iterator[None]:
        """The hooks ignore the calls made inside (a recompute's)."""
        self._recomputing = True
        try:
            yield
        finally:
            self._recomputing = False

    # ------------------------------------------------------------------ hooks
    def _flag(self, t: torch.Tensor) -> int:
        self._flags.append(t)
        return len(self._flags) - 1

    # The hooks are compile_safe: where torch.compile traces a module call (a region compiled while
    # they were on it), they run eagerly at a graph break instead of being traced into the graph.
    # The module hooks hold the Localizer weakly: a guard dropped while armed does not keep it (and the
    # force_eager stance) alive through the model; its finalizer removes the hooks.
    def _pre_hook(self, idx: int) -> Any:
        ref = weakref.ref(self)

        @compile_safe
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            loc = ref()
            if loc is None or loc._recomputing or not torch.is_grad_enabled():
                return None
            return loc._enter(idx, args, kwargs)

        return hook

    def _enter(self, idx: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = Call(idx, self._stack[-1] if self._stack else -1, self._seq)
        self._seq += 1
        self.observed = True
        ins = list(floats((args, kwargs)))
        if ins:
            call.in_ok = self._flag(inputs_finite(ins))
            device = ins[0].device.type
            if torch.is_autocast_enabled(device):
                call.autocast = (device, torch.get_autocast_dtype(device))
        # Each module sees its inputs through views of its own: the gradient reaching a view is this
        # module's contribution only (a tensor feeding q, k and v gets three).
        views: dict[int, torch.Tensor] = {}

        def own(t: torch.Tensor) -> torch.Tensor:
            if not (t.requires_grad and t.is_floating_point()):
                return t
            if id(t) not in views:
                views[id(t)] = v = t.view_as(t)
                v.register_hook(self._in_grad_hook(len(self._calls)))
            return views[id(t)]

        args, kwargs = map_tensors(args, own), map_tensors(kwargs, own)
        call.save(args, kwargs)
        self._stack.append(len(self._calls))
        self._calls.append(call)
        return (args, kwargs) if views else None

    def _fwd_hook(self, idx: int) -> Any:
        ref = weakref.ref(self)

        @compile_safe
        def hook(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
            loc = ref()
            if loc is None or loc._recomputing or not torch.is_grad_enabled():
                return
            loc._exit(idx, out)

        return hook

    def _exit(self, idx: int, out: Any) -> None:
        # The innermost call under way of this module (a forward that raised leaves others open).
        pos = next((p for p in range(len(self._stack) - 1, -1, -1) if self._calls[self._stack[p]].idx == idx), None)
        if pos is None:
            return
        c = self._stack[pos]
        del self._stack[pos:]
        call = self._calls[c]
        call.exit = self._seq
        self._seq += 1
        outs = list(floats(out))
        if not outs:
            return
        call.out_ok = self._flag(outputs_finite(outs))
        call.out_dtype = str(outs[0].dtype)
        for t in outs:
            if t.requires_grad:
                t.register_hook(self._out_grad_hook(c))

    # Gradient hooks may get None (no gradient flowed to that tensor: an output that did not require
    # grad in a compiled graph, a branch the loss does not depend on): nothing to check then.
    def _out_grad_hook(self, c: int) -> Any:
        @compile_safe
        def hook(g: torch.Tensor | None) -> None:
            if g is not None:
                call = self._calls[c]
                call.grad_out.append(self._flag(all_finite(g)))
                if call.parent == -1:  # the gradient the loss's backward sent into the model
                    call.grad_nan.append(self._flag(torch.isnan(g).any()))

        return hook

    def _in_grad_hook(self, c: int) -> Any:
        @compile_safe
        def hook(g: torch.Tensor | None) -> None:
            if g is not None:
                self._grad_in.append((c, self._flag(all_finite(g)), self._flag(torch.isnan(g).any()), str(g.dtype)))

        return hook

    # ------------------------------------------------------------------ the rule
    def _read_flags(self) -> list[bool]:
        """Every flag of the step, read with one host sync per device (one, usually)."""
        if not self._flags:
            return []
        by_device: dict[torch.device, list[int]] = {}
        for i, f in enumerate(self._flags):
            by_device.setdefault(f.device, []).append(i)
        values = [False] * len(self._flags)
        for idxs in by_device.values():
            for i, v in zip(idxs, torch.stack([self._flags[i] for i in idxs]).cpu().tolist()):  # SYNC (armed)
                values[i] = bool(v)
        return values

    def collect(self, *, loss_finite: bool, fp16_scaling: bool) -> Finding | None:
        """Read the flags (one host sync) and name the culprit, or None if all were finite.
        None too when no forward was observed (the hooks were armed after this step's forward)."""
        if not self.observed:
            self.reset()
            return None
        ok = self._read_flags()
        top = [call for call in self._calls if call.parent == -1]
        try:
            finding = self._forward_finding(ok)
            if finding is None and (not loss_finite or any(c.in_ok is not None and not ok[c.in_ok] for c in top)):
                finding = self._outside(Phase.FORWARD) if self.within is not None else Finding(
                    None, Phase.LOSS, None, "", math.nan,
                    "every module's inputs and outputs were finite; the loss itself was non-finite "
                    "(the code between the model's output and the loss; no module to recompute: cause unknown)")
            if finding is None:
                finding = self._backward_finding(ok, fp16_scaling)
            if finding is None and any(not ok[f] for c in top for f in c.grad_out):
                finding = self._outside(Phase.BACKWARD) if self.within is not None else self._loss_backward(
                    ok, top, fp16_scaling)
            if finding is None:
                finding = self._param_finding(fp16_scaling)
        finally:
            self.reset()
        return finding

    @staticmethod
    def _loss_backward(ok: list[bool], top: list[Call], fp16_scaling: bool) -> Finding:
        """The gradient arriving at the model's output was non-finite: the loss's backward made it.
        Its cause by the backward rule (inf without NaN under fp16 loss scaling: overflow)."""
        nan = any(ok[f] for c in top for f in c.grad_nan)
        overflow = fp16_scaling and not nan
        why = ("inf but no NaN, under fp16 loss scaling: the scaled gradient exceeded fp16's range" if overflow
               else "it holds NaN" if nan else "it holds inf")
        return Finding(None, Phase.BACKWARD, Cause.OVERFLOW if overflow else Cause.NAN, "", math.nan,
                       f"the gradient arriving at the model's output was already non-finite ({why}): it arose in the "
                       "loss's backward (the code between the model's output and the loss)")

    def _outside(self, phase: Phase) -> Finding:
        """Hooks inside one block (the sentinel's) only, and the first non-finite value was not made
        there: no module is named (``Forensics`` widens the hooks to the whole model)."""
        what = "forward value" if phase == Phase.FORWARD else "gradient"
        return Finding(None, phase, None, "", math.nan,
                       f"the first non-finite {what} arose outside {self.within}, the only block watched: "
                       "forensics hooks widen to the whole model")

    def _forward_finding(self, ok: list[bool]) -> Finding | None:
        # (when, call, phase): a top-level call given a non-finite input, at its entry; a call whose
        # inputs were finite and whose output was not, at its exit (after every child's).
        events = []
        for c, call in enumerate(self._calls):
            in_ok = call.in_ok is None or ok[call.in_ok]
            if not in_ok and call.parent == -1 and self.within is None:  # inside a block: from upstream
                events.append((call.enter, c, Phase.INPUT))
            elif in_ok and call.out_ok is not None and not ok[call.out_ok]:
                events.append((call.exit, c, Phase.FORWARD))
        if not events:
            return None
        _, c, phase = min(events)
        call = self._calls[c]
        name = self.modules[call.idx][0]
        x = first_tensor(list(floats((call.args, call.kwargs))))
        in_max = float(x.detach().abs().max()) if x is not None and x.numel() and not call.moved() else math.nan
        if phase == Phase.INPUT:
            what = "NaN" if x is not None and bool(torch.isnan(x).any()) else "inf"
            return Finding(None, Phase.INPUT, Cause.NAN, str(x.dtype) if x is not None else "", in_max,
                           f"the input of {name or 'the model'} holds {what} before any module ran on it: a bad batch "
                           "(or code outside the model's modules); the step's batch_ids are quarantined")
        cause, detail = self._classify_forward(call)
        label = f"{name or 'the model'} ({type(self.modules[call.idx][1]).__name__})"
        return Finding(name, Phase.FORWARD, cause, call.out_dtype, in_max,
                       f"{label}'s inputs were finite and its output was not; {detail}; input max |x| = {in_max:.4g}",
                       param=self._own_param(call.idx))

    def _backward_finding(self, ok: list[bool], fp16_scaling: bool) -> Finding | None:
        for c, in_ok, has_nan, dtype in self._grad_in:
            call = self._calls[c]
            if ok[in_ok] or not all(ok[f] for f in call.grad_out):
                continue
            name = self.modules[call.idx][0]
            overflow = fp16_scaling and not ok[has_nan]
            cause = Cause.OVERFLOW if overflow else Cause.NAN
            why = ("inf but no NaN, under fp16 loss scaling: the scaled gradient exceeded fp16's range" if overflow
                   else "it holds NaN" if ok[has_nan] else "it holds inf")
            return Finding(name, Phase.BACKWARD, cause, dtype, math.nan,
                           f"the gradient leaving {name or 'the model'} in backward became non-finite ({dtype}: {why}) "
                           "while the gradient arriving at its output was finite", param=self._own_param(call.idx))
        return None

    def _own_param(self, idx: int) -> str | None:
        """The culprit's first parameter (its own or its children's) whose gradient is non-finite."""
        name, module = self.modules[idx]
        for pname, p in module.named_parameters():
            g = p.grad
            if g is not None:
                g = g.to_local() if callable(getattr(g, "to_local", None)) else g
                if not bool(torch.isfinite(g).all()):  # SYNC (the culprit's parameters only)
                    return f"{name}.{pname}" if name else pname
        return None

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
                g = g.coalesce()._values() if g.is_sparse else g  # nn.Embedding(sparse=True)
                if bool(torch.isfinite(g).all()):
                    continue
                has_nan = bool(torch.isnan(g).any())
                cause = Cause.OVERFLOW if fp16_scaling and not has_nan else Cause.NAN
                full = f"{name}.{pname}" if name else pname
                return Finding(name, Phase.BACKWARD, cause, str(g.dtype), math.nan,
                               f"the gradient of {full} is non-finite ({'NaN' if has_nan else 'inf'}) while every "
                               "module's output and input gradients were finite", param=full)
        return None

    # ------------------------------------------------------------------ classification
    def _classify_forward(self, call: Call) -> tuple[Cause | None, str]:
        """Recompute the culprit on its saved inputs in the run's precision and in fp32
        (:func:`ampguard.forensics.recompute.classify`)."""
        return classify(self.modules[call.idx][1], call, self._quietly)
