"""Classification of a forward culprit from evidence: recompute it on its saved inputs in the
run's precision and in fp32 (see :mod:`ampguard.forensics.localizer` for the verdicts).

Each recompute runs on copies that nothing else holds: its tensors cloned (or cast), its stateful
arguments (a KV cache, kept as it was at the call by :meth:`ampguard.forensics.calls.Call.save`) copied
again, its module's buffers cloned. A recompute that appends to a cache or writes in place changes
nothing of the run, and the second recompute sees what the call saw, not what the first left. A
saved tensor written in place during or after the call (its version moved) is not recomputed on:
the cause is then None, and the detail says which input changed."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from ..vocab import Cause
from .calls import FP16_MAX, HALF, Call, copy_tensors, floats

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
    run, run_err = _recompute(quietly, module, call, fp32=False)
    fp32, fp32_err = _recompute(quietly, module, call, fp32=True)
    if run_err is not None or fp32_err is not None:
        said = [f"recomputed in {label} it is {'finite' if res[0] else 'non-finite'}" if err is None
                else f"the {label} recompute failed ({err})"
                for label, res, err in ((run_label, run, run_err), ("fp32", fp32, fp32_err))]
        return None, "; ".join(said)
    run_ok, fp32_ok, fp32_max = run[0], fp32[0], fp32[1]
    on = "on its saved inputs" + (f" (copies of {', '.join(call.copied)} as at the call)" if call.copied else "")
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
               fp32: bool) -> tuple[tuple[bool, float], str | None]:
    """(outputs all finite, max |output|), or the error that stopped the recompute. Buffers
    are copies (a BatchNorm's running stats stay as they were); the RNG is forked (a dropout
    inside does not shift the run's masks)."""

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
            out = torch.func.functional_call(module, state, args, kwargs, strict=False)
        outs = list(floats(out))
        if not outs:
            return (True, math.nan), "no floating-point output"
        finite = all(bool(torch.isfinite(t).all()) for t in outs)
        top = max(float(t.detach().float().abs().nan_to_num(0.0, posinf=0.0).max()) if t.numel() else 0.0
                  for t in outs)
        return (finite, top), None
    except Exception as exc:  # a module that cannot be re-run on its saved inputs: say so, guess nothing
        return (True, math.nan), f"{type(exc).__name__}: {str(exc)[:200]}"
