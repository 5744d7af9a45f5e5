"""Classification of a forward culprit from evidence: recompute it on its saved inputs in the
run's precision and in fp32 (see :mod:`ampguard.forensics.localizer` for the verdicts).

Each recompute runs on copies that nothing else holds: its tensors cloned (or cast), its stateful
arguments (a KV cache, kept as it was at the call by :meth:`ampguard.forensics.calls.Call.save`) copied
again, its module's buffers cloned. A recompute that appends to a cache or writes in place changes
nothing of the run, and the second recompute sees what the call saw, not what the first left. A
saved tensor written in place during or after the call (its version moved) is not recomputed on:
the cause is then None, and the detail says which input changed.

A torchao ``Float8Linear`` is a leaf recomputed three ways: in its own fp8 recipe (its forward, in the call's
autocast state), as the same layer without fp8 in the run's high precision (``F.linear`` under that autocast),
and as that layer in fp32. The fp8 recipe alone non-finite is ``Cause.FP8`` (its casts or its GEMM made it); the
recipe and the high precision non-finite and fp32 finite is the run's precision overflowing; all three a genuine
NaN. The detail carries what the layer's casts of these inputs come to (amax, scale, underflow), so an fp8 range
problem is told apart from a NaN in the data."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..fp8 import is_float8_linear, layer_cast_stats
from ..vocab import Cause
from .calls import FP16_MAX, HALF, Call, copy_tensors, first_tensor, floats

__all__ = ["classify"]


@torch.no_grad()
def classify(module: torch.nn.Module, call: Call,
             quietly: Callable[[], AbstractContextManager[None]]) -> tuple[Cause | None, str]:
    """Recompute the culprit ``module`` on its saved inputs in the run's precision and in fp32.
    ``quietly()`` is entered around each recompute (the localizer's hooks ignore what runs inside)."""
    if any(hasattr(p, "placements") for p in module.parameters()):
        return None, "not recomputed: its parameters are sharded (DTensor/FSDP2)"
    unchanged = _unchanged(call)
    if unchanged is not None:
        return None, unchanged
    ac = call.autocast
    run_label = (f"{str(ac[1]).removeprefix('torch.')} autocast" if ac is not None
                 else call.out_dtype.removeprefix("torch."))
    on = "on its saved inputs" + (f" (copies of {', '.join(call.copied)} as at the call)" if call.copied else "")
    if is_float8_linear(module):
        return _classify_fp8(module, call, quietly, run_label, on)
    run, run_err = _recompute(quietly, module, call, fp32=False)
    fp32, fp32_err = _recompute(quietly, module, call, fp32=True)
    failed = _failed(((run_label, run, run_err), ("fp32", fp32, fp32_err)))
    if failed is not None:
        return None, failed
    run_ok, fp32_ok, fp32_max = run[0], fp32[0], fp32[1]
    if not run_ok and fp32_ok:
        return Cause.OVERFLOW, (f"recomputed {on} it is non-finite in {run_label} and finite in "
                                f"fp32 (max |y| = {fp32_max:.4g}): the run's precision overflowed (fp16 ends at "
                                f"±{FP16_MAX:g}), possibly inside the module")
    if not run_ok:
        return Cause.NAN, (f"recomputed {on} it is non-finite in {run_label} and in fp32: a "
                           "genuine NaN/inf (log of a negative, 0/0, a non-finite weight)")
    if not fp32_ok:
        return Cause.NAN, f"recomputed {on} it is finite in {run_label} but non-finite in fp32"
    return Cause.NOT_REPRODUCED, (f"recomputed {on} it is finite in {run_label} and in fp32: not "
                                  "reproducible by recompute (an injected value, a race, hardware, or state the "
                                  "recompute does not see)")


def _failed(passes: tuple[tuple[str, tuple[bool, float], str | None], ...]) -> str | None:
    """None where every recompute ran; else what each showed or why it failed (the cause is then None)."""
    if all(err is None for _, _, err in passes):
        return None
    return "; ".join(f"recomputed in {label} it is {'finite' if res[0] else 'non-finite'}" if err is None
                     else f"the {label} recompute failed ({err})" for label, res, err in passes)


def _classify_fp8(module: torch.nn.Module, call: Call, quietly: Callable[[], AbstractContextManager[None]],
                  run_label: str, on: str) -> tuple[Cause | None, str]:
    """A torchao ``Float8Linear`` culprit: its fp8 recipe, the same layer without fp8 in the run's precision, and
    in fp32 (module docstring), and what its casts of these inputs come to."""
    linear = _as_linear(module)
    recipe, recipe_err = _recompute(quietly, module, call, fp32=False)
    high, high_err = _recompute(quietly, module, call, fp32=False, forward=linear)
    fp32, fp32_err = _recompute(quietly, module, call, fp32=True, forward=linear)
    recipe_label, high_label = f"its fp8 recipe ({run_label})", f"{run_label} without fp8"
    casts = _casts(module, call)
    failed = _failed(((recipe_label, recipe, recipe_err), (high_label, high, high_err), ("fp32", fp32, fp32_err)))
    if failed is not None:
        return None, f"{failed}; {casts}"
    if not recipe[0] and high[0] and fp32[0]:
        return Cause.FP8, (f"recomputed {on} it is non-finite in {recipe_label} and finite as the same layer "
                           f"without fp8, in {run_label} (max |y| = {high[1]:.4g}) and in fp32: its fp8 casts or "
                           f"fp8 GEMM made it; {casts}")
    if not recipe[0] and fp32[0]:
        return Cause.OVERFLOW, (f"recomputed {on} it is non-finite in {recipe_label} and in {high_label}, finite in "
                                f"fp32 (max |y| = {fp32[1]:.4g}): the run's precision overflowed, not fp8 (fp16 ends "
                                f"at ±{FP16_MAX:g}); {casts}")
    if not recipe[0]:
        return Cause.NAN, (f"recomputed {on} it is non-finite in {recipe_label}, in {high_label} and in fp32: a "
                           f"genuine NaN/inf (a non-finite weight, bad data), not fp8; {casts}")
    if not (high[0] and fp32[0]):
        return Cause.NAN, (f"recomputed {on} it is finite in {recipe_label} but non-finite "
                           f"{'without fp8' if not high[0] else 'in fp32'}; {casts}")
    return Cause.NOT_REPRODUCED, (f"recomputed {on} it is finite in {recipe_label}, in {high_label} and in fp32: "
                                  "not reproducible by recompute (an injected value, a race, hardware, a compiled "
                                  f"kernel); {casts}")


def _as_linear(module: Any) -> Callable[..., Any]:
    """The forward of ``module`` as the plain ``nn.Linear`` it replaced: ``F.linear`` of its (state's) weight and
    bias, no fp8."""

    def forward(state: dict[str, torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0] if args else kwargs["input"]
        return torch.nn.functional.linear(x, state.get("weight", module.weight),
                                          state.get("bias", module.bias))

    return forward


def _casts(module: Any, call: Call) -> str:
    """``"its fp8 casts of these inputs: input amax … → scale …, underflow … %; weight …"``: the layer's input
    and weight cast as it casts them (the input in CUDA autocast's dtype, its recipe's scaling)."""
    x = first_tensor(list(floats((call.args, call.kwargs))))
    if x is None:
        return "its fp8 casts: no input to measure"
    # torchao 0.18 casts the input to the autocast dtype under CUDA autocast only, and never the weight
    dtype = call.autocast[1] if call.autocast is not None and call.autocast[0] == "cuda" else None
    said = []
    try:
        for role, t in (("input", x.to(dtype) if dtype is not None else x), ("weight", module.weight)):
            stats = layer_cast_stats(module, role, t.detach()).tolist()
            said.append(f"{role} amax {stats[1]:.4g} → scale {stats[2]:.4g}, underflow {100 * stats[3]:.3g} %")
    except Exception as exc:  # a layout the statistics do not know: say so, guess nothing
        return f"its fp8 casts could not be measured ({type(exc).__name__}: {str(exc)[:120]})"
    return "its fp8 casts of these inputs: " + "; ".join(said)


def _unchanged(call: Call) -> str | None:
    """None where the saved inputs are as the call saw them; else why not (not recomputed)."""
    if call.unsaved is not None:
        return f"not recomputed: {call.unsaved}"
    moved = call.moved()
    if moved:
        t, v = moved[0]
        return (f"not recomputed: {len(moved)} of its saved input tensors ({tuple(t.shape)} {t.dtype}, ...) were "
                f"written in place during or after the call (version {v} -> {t._version}), so a recompute would not "
                "see what the call saw")
    return None


def _recompute(quietly: Callable[[], AbstractContextManager[None]], module: torch.nn.Module, call: Call, *,
               fp32: bool, forward: Callable[..., Any] | None = None) -> tuple[tuple[bool, float], str | None]:
    """(outputs all finite, max |output|), or the error that stopped the recompute. Buffers
    are copies (a BatchNorm's running stats stay as they were); the RNG is forked (a dropout
    inside does not shift the run's masks). ``forward(state, args, kwargs)``: what to run instead of the
    module's own forward (a ``Float8Linear`` as a plain linear layer)."""

    def prep(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.float() if fp32 and t.dtype in HALF else t

    def own(t: torch.Tensor) -> torch.Tensor:  # a copy of its own: the recompute may write into it
        c = prep(t)
        return c.clone() if c.dtype == t.dtype else c  # (a cast is a copy already)

    try:
        args, kwargs = copy_tensors((call.args, call.kwargs), own)
    except Exception as exc:  # an object that cannot be copied: say so, guess nothing
        return (True, math.nan), f"its saved inputs could not be copied ({type(exc).__name__}: {str(exc)[:200]})"
    state = {n: prep(b).clone() for n, b in module.named_buffers()}
    if fp32:
        state.update({n: p.detach().float() for n, p in module.named_parameters() if p.dtype in HALF})
    devices = {t.device for t in floats((args, kwargs, list(state.values())))}
    devices |= {p.device for p in module.parameters()}
    device_type = next(iter(devices)).type if devices else "cpu"
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)[:1]
    ac = call.autocast
    try:
        # fork_rng: CPU and the module's CUDA device
        with quietly(), torch.random.fork_rng(devices=cuda), torch.autocast(
                device_type=ac[0] if ac is not None and not fp32 else device_type,
                dtype=ac[1] if ac is not None and not fp32 else None,
                enabled=ac is not None and not fp32):
            out = (forward(state, args, kwargs) if forward is not None
                   else torch.func.functional_call(module, state, args, kwargs, strict=False))
        outs = list(floats(out))
        if not outs:
            return (True, math.nan), "no floating-point output"
        finite = all(bool(torch.isfinite(t).all()) for t in outs)
        top = max(float(t.detach().float().abs().nan_to_num(0.0, posinf=0.0).max()) if t.numel() else 0.0
                  for t in outs)
        return (finite, top), None
    except Exception as exc:  # a module that cannot be re-run on its saved inputs: say so, guess nothing
        return (True, math.nan), f"{type(exc).__name__}: {str(exc)[:200]}"
