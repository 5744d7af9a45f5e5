"""Run integrity: is the state about to be saved (or just loaded) healthy?

:func:`verify` gives a :class:`Verdict`: whether the last steps were finite, which parameters and
optimizer state tensors are non-finite now, and a bitwise fingerprint of every parameter
(:mod:`ampguard.fingerprint`). ``GuardedOptimizer.state_dict()`` carries it and
``load_state_dict()`` checks a checkpoint against it (:func:`check_loaded`), refusing, with
:class:`~ampguard.errors.CheckpointError`, a state that is non-finite or whose weights are not the
ones it was saved with. See docs/integrity.md.

Finiteness is read from one max-norm per tensor (``torch._foreach_norm(..., inf)``: NaN or Inf
whenever any element is; one read of the tensors, grouped by device and dtype; on the CPU one
``aminmax`` per tensor, the same values, 10-30x faster there), then one host read for all of
them. :func:`nonfinite_names` is the same check on an already-reduced vector (the guard's periodic
parameter check rides the step's report with it, :mod:`ampguard.payload`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .errors import CheckpointError
from .fingerprint import param_fingerprints
from .stats import cpu_amax, cpu_amax_ok, local_tensor

__all__ = ["Verdict", "amax_per_tensor", "check_loaded", "check_weights", "listed", "nonfinite_names",
           "refuse_unhealthy", "state_tensors", "verify"]


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """The health of a training state (:meth:`ampguard.GuardedOptimizer.verify`). Plain values."""

    step: int
    """Optimizer steps the guard had run when it was taken."""
    last_step_finite: bool
    """The last reported step was not skipped for a non-finite loss, gradient or parameter."""
    nonfinite: tuple[str, ...]
    """Parameters (by name) and optimizer state tensors (``optimizer.state[<param>].<key>``) holding a
    NaN or Inf now."""
    fingerprints: tuple[tuple[int, int], ...] = ()
    """Each parameter's bitwise fingerprint (:func:`ampguard.fingerprint.param_fingerprints`), in
    ``param_groups`` order."""
    names: tuple[str, ...] = ()
    """The parameters' names, in the order of :attr:`fingerprints`."""

    @property
    def healthy(self) -> bool:
        """No parameter and no optimizer state tensor holds a NaN/Inf: safe to save, and to resume
        from. (A last step skipped for a non-finite gradient left the state as it was: still healthy;
        :attr:`last_step_finite` says so for whoever wants to know.)"""
        return not self.nonfinite

    def describe(self) -> str:
        if self.healthy:
            return f"healthy at step {self.step} ({len(self.fingerprints)} parameters fingerprinted)"
        parts = []
        if self.nonfinite:
            parts.append(f"non-finite: {listed(self.nonfinite)}")
        if not self.last_step_finite:
            parts.append("the last step was non-finite")
        return f"unhealthy at step {self.step}: " + "; ".join(parts)

    def mismatched(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
        """The parameters whose bits differ from the fingerprints saved here (every parameter when
        their number differs; none when nothing was fingerprinted)."""
        if not self.fingerprints:
            return ()
        if len(self.fingerprints) != len(named_params):
            return tuple(n for n, _ in named_params)
        now = param_fingerprints([p for _, p in named_params]).tolist()
        return tuple(name for name, saved, cur in zip(self.names, self.fingerprints, now)
                     if tuple(saved) != tuple(cur))

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "last_step_finite": self.last_step_finite, "nonfinite": list(self.nonfinite),
                "fingerprints": [list(f) for f in self.fingerprints], "names": list(self.names)}

    @classmethod
    def from_dict(cls, d: Any) -> Verdict:
        """The verdict a checkpoint carries; a malformed one is refused (CheckpointError)."""
        try:
            fps = tuple((int(a), int(b)) for a, b in d["fingerprints"])
            names = tuple(str(n) for n in d["names"])
            verdict = cls(int(d["step"]), bool(d["last_step_finite"]), tuple(str(n) for n in d["nonfinite"]),
                          fps, names)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the checkpoint's verdict is malformed ({exc!r}): it was not written by "
                                  "GuardedOptimizer.state_dict(); nothing was loaded") from None
        if len(fps) != len(names):
            raise CheckpointError(f"the checkpoint's verdict names {len(names)} parameters and fingerprints "
                                  f"{len(fps)}; nothing was loaded")
        return verdict


def state_tensors(optimizer_state: Mapping[Any, Any], labels: Mapping[Any, str]) -> list[tuple[str, torch.Tensor]]:
    """The floating-point tensors of an optimizer's ``state`` (live, keyed by parameter, or a
    state dict's, keyed by index), each named ``optimizer.state[<label>].<key>``."""
    out = []
    for key, entry in optimizer_state.items():
        if not isinstance(entry, Mapping):
            continue
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                out.append((f"optimizer.state[{labels.get(key, key)}].{name}", value))
    return out


def amax_per_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """max|x| of each tensor, float32, stacked on the first tensor's device (NaN or Inf exactly
    where the tensor holds one). No host sync; one read, by device and dtype: a group's maxima are
    stacked and converted once (not one ``.to`` a tensor: ~2.6 us each on the H200's host), and one
    group with no empty tensor (the usual case) is the vector as it is."""
    if not tensors:
        return torch.zeros(0)
    device = tensors[0].device
    local = [local_tensor(t).detach() for t in tensors]
    out: list[torch.Tensor | None] = [None] * len(local)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(local):
        if t.numel():  # an empty tensor (an FSDP2 shard of an uneven split) has no max: 0
            groups.setdefault((t.device, t.dtype), []).append(i)
        else:
            out[i] = torch.zeros((), dtype=torch.float32, device=device)
    for (dev, dtype), idx in groups.items():
        ts = [local[i] for i in idx]
        amax = cpu_amax(ts) if cpu_amax_ok(dev, dtype) else torch.stack(torch._foreach_norm(ts, math.inf))
        amax = amax.to(device=device, dtype=torch.float32)  # a max is exact in float32: the same values
        if len(idx) == len(local):
            return amax
        for i, n in zip(idx, amax.unbind()):
            out[i] = n
    return torch.stack(out)  # type: ignore[arg-type]


def nonfinite_names(amax: Sequence[float], names: Sequence[str]) -> tuple[str, ...]:
    return tuple(n for n, v in zip(names, amax) if not math.isfinite(v))


def verify(named_params: Sequence[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer, *, step: int,
           last_step_finite: bool, fingerprints: bool = True) -> Verdict:
    """The verdict on the live state (one host read for every tensor; two with the fingerprints;
    ``fingerprints=False``: health only, as a save's refusal needs)."""
    labels = {id(p): n for n, p in named_params}
    state = state_tensors({id(p): s for p, s in optimizer.state.items()}, labels)
    named = [(n, p.detach()) for n, p in named_params] + state
    floats = [(n, t) for n, t in named if t.is_floating_point() and t.numel()]
    amax = amax_per_tensor([t for _, t in floats]).tolist()
    params = [p for _, p in named_params]
    fps = param_fingerprints(params).tolist() if params and fingerprints else []
    return Verdict(step, last_step_finite, nonfinite_names(amax, [n for n, _ in floats]),
                   tuple((int(a), int(b)) for a, b in fps), tuple(n for n, _ in named_params))


def listed(names: Sequence[str], shown: int = 5) -> str:
    """``names`` for a message: the first ``shown``, then how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def refuse_unhealthy(verdict: Verdict, refused: str) -> None:
    """Before a checkpoint is written: a state holding a NaN/Inf raises CheckpointError, which begins
    with ``refused`` (who refused what) and names the tensors; nothing is written by then."""
    if not verdict.healthy:
        raise CheckpointError(f"{refused}: the guarded state is {verdict.describe()}. Nothing was written; the last "
                              "checkpoint on disk is the last good one")


def check_loaded(verdict: Verdict | None, optimizer_state: Mapping[Any, Any]) -> None:
    """Refuse (CheckpointError, naming what and where) a checkpoint whose saved verdict was
    unhealthy or whose optimizer state holds a NaN/Inf. Changes nothing. (Whether the model's
    weights are those the state was saved with is checked at the first step after the load, when
    both are loaded whatever their order: :func:`check_weights`.)"""
    if verdict is not None and not verdict.healthy:
        raise CheckpointError(f"refusing to load a checkpoint saved {verdict.describe()}. Load the last "
                              "healthy checkpoint instead; nothing was loaded")
    state = state_tensors(optimizer_state, {})
    if state:
        amax = amax_per_tensor([t for _, t in state]).tolist()
        bad = nonfinite_names(amax, [n for n, _ in state])
        if bad:
            raise CheckpointError(f"refusing to load a checkpoint whose optimizer state is non-finite: {listed(bad)}; "
                                  "nothing was loaded")


def check_weights(verdict: Verdict, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Refuse (CheckpointError) to step with an optimizer state saved for other weights: the model's
    weights not loaded from the same checkpoint, or loaded from another one."""
    differ = verdict.mismatched(named_params)
    if differ:
        raise CheckpointError(
            f"the model's weights are not the ones the optimizer state loaded (saved at step {verdict.step}) was "
            f"saved with: {len(differ)} parameter(s) differ bitwise ({listed(differ)}). Load the model's weights from "
            "the same checkpoint (before the first step after loading); to go on from other weights on purpose, "
            "load the state without its verdict (del state_dict['ampguard']['verdict']). This step changed nothing")

