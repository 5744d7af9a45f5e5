"""``torch.distributed.checkpoint`` (DCP) for a guarded run: the model and the inner optimizer in
DCP's own format (sharded, resharded on load, as ``get_state_dict``/``set_state_dict`` make them),
the guard's own state beside them.

>>> import torch.distributed.checkpoint as dcp
>>> from ampguard.integrations import dcp as guard_dcp
>>> dcp.save(guard_dcp.get_state_dict(model, opt), checkpoint_id=path)
>>> # to resume: a template of the same keys, filled by dcp.load, then restored
>>> state = guard_dcp.get_state_dict(model, opt)
>>> dcp.load(state, checkpoint_id=path)
>>> guard_dcp.set_state_dict(model, opt, state)

Why not ``get_state_dict(model, opt)`` with torch's functions directly: they read
``opt.state_dict()`` as a plain optimizer's (``state`` and ``param_groups`` at the top; the guard's has
``optimizer``, ``scaler`` and ``ampguard``), keep only those two keys, and initialise an empty
optimizer state by calling ``opt.step()`` on zero gradients, which the guard would count (or refuse,
in fp16: the gradients were not scaled). Here DCP gets the inner optimizer, and the guard's state
(loss scale, growth tracker, step count, detectors' statistics, quarantine, the verdict: what
:meth:`~ampguard.GuardedOptimizer.state_dict` holds besides the inner optimizer) travels as one
object per rank, under ``"ampguard"``, key ``"rank<r>"``: each rank's verdict fingerprints its own
parameters (its shards, under FSDP2). So a run resumes on as many ranks as saved it: DCP would
reshard the model and optimizer states, the guard's per-rank state does not.

:func:`set_state_dict` checks the guard's state and the optimizer state DCP loaded (a NaN/Inf in it,
an unhealthy verdict: :class:`~ampguard.CheckpointError`) before it changes anything of its own;
then DCP's ``set_state_dict`` restores the model and the inner optimizer, and the guard resumes at
the saved step. (``dcp.load`` itself writes into the tensors of the template, which are the model's
and the optimizer's own: a refused checkpoint is already in them, and the error says to load a
healthy one before training on.) As after ``opt.load_state_dict``, the first step checks that the
model's weights are the ones the state was saved with.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint import state_dict as _dcp

from ..errors import CheckpointError, refusal_reason
from ..guard import GuardedOptimizer

__all__ = ["get_state_dict", "set_state_dict"]


def _guard(opt: Any) -> GuardedOptimizer:
    if not isinstance(opt, GuardedOptimizer):
        raise TypeError(f"expects the guarded optimizer (ampguard.wrap(...)), got {type(opt).__name__}; for a plain "
                        "optimizer use torch.distributed.checkpoint.state_dict.get_state_dict itself")
    return opt


def _key(opt: GuardedOptimizer) -> str:
    return f"rank{opt.backend.rank}"


def get_state_dict(model: torch.nn.Module, opt: GuardedOptimizer,
                   options: _dcp.StateDictOptions | None = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ..., "ampguard": {"rank<r>": io.BytesIO}}``: what to hand
    ``dcp.save``, and, made again before resuming, the template ``dcp.load`` fills. ``model`` and
    ``optim`` are ``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt.optimizer,
    options=options)``. collective where DCP's is (FSDP); the guard's part syncs the host (its verdict
    reads every parameter's fingerprint)."""
    opt = _guard(opt)
    model_sd, optim_sd = _dcp.get_state_dict(model, opt.optimizer, options=options)
    buf = io.BytesIO()
    torch.save(opt._state_without_optimizer(), buf)
    return {"model": model_sd, "optim": optim_sd, "ampguard": {_key(opt): buf}}


def set_state_dict(model: torch.nn.Module, opt: GuardedOptimizer, state: dict[str, Any],
                   options: _dcp.StateDictOptions | None = None) -> None:
    """Restore what ``dcp.load`` put into ``state`` (a template from :func:`get_state_dict`): the
    guard's state and the optimizer state are checked first (a refusal changes nothing of the guard's),
    and the ranks agree (one rank's refusal is every rank's); then the model and the inner optimizer are
    restored by DCP's ``set_state_dict`` and the guard by its own state. collective."""
    opt = _guard(opt)
    restore, refused, template = None, None, True
    try:
        saved = _guard_state(opt, state)
        template = False
        restore = opt._check_without_optimizer(saved, _nested(state["optim"]))
    except ValueError as e:  # CheckpointError included
        refused = e
    # The same answer on every rank before DCP's collective restore: a rank that refuses alone would
    # leave the others waiting in it. collective (blocks; a resume happens once).
    reasons = opt.backend.all_gather_object(None if refused is None else f"{type(refused).__name__}: {refused}")
    if any(r is not None for r in reasons):
        if refused is None:
            first = next(k for k, r in enumerate(reasons) if r is not None)
            refused = CheckpointError(f"rank {first} refused the checkpoint ({reasons[first]})")
        if template:
            raise refused  # not the dict get_state_dict() made: nothing was read from it, nothing changed
        reason = refusal_reason(refused, typed=False)
        raise type(refused)(
            f"{reason}. The guard's state was not restored; dcp.load has already written the checkpoint's values into "
            "the model and the optimizer (DCP loads in place). Load a healthy checkpoint (dcp.load, then "
            "set_state_dict) before training on") from None
    assert restore is not None  # internal: no rank refused
    _dcp.set_state_dict(model, opt.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                        options=options)
    restore()


def _guard_state(opt: GuardedOptimizer, state: Any) -> Any:
    """This rank's guard state, read back from the template ``dcp.load`` filled."""
    if not isinstance(state, dict) or not {"model", "optim", "ampguard"} <= set(state):
        raise ValueError("set_state_dict() expects the dict get_state_dict() made, filled by dcp.load (keys 'model', "
                         "'optim', 'ampguard'). Nothing was loaded.")
    saved = state["ampguard"]
    buf = saved.get(_key(opt)) if isinstance(saved, dict) else None
    if not isinstance(buf, io.BytesIO) or not buf.getbuffer().nbytes:
        raise ValueError(f"the checkpoint holds no guard state for {_key(opt)} (it keeps one per rank: resume on as "
                         "many ranks as it was saved from, with a template from get_state_dict()). Nothing was loaded.")
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # plain values only: no code runs


def _nested(optim: Any) -> Any:
    """The optimizer state as ``{"state": {fqn: {name: tensor}}, ...}``, also where DCP flattened it
    (``StateDictOptions(flatten_optimizer_state_dict=True)``: keys ``state.<fqn>.<name>``)."""
    if not isinstance(optim, dict) or "state" in optim:
        return optim
    nested: dict[str, dict[str, Any]] = {}
    for key, value in optim.items():
        if isinstance(key, str) and key.startswith("state."):
            fqn, _, name = key[len("state."):].rpartition(".")
            nested.setdefault(fqn, {})[name] = value
    return {"state": nested, "param_groups": []}
