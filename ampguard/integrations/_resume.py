"""The guard's own state restored beside a framework's in-place FSDP load (accelerate's ``load_state``,
the Trainer's FSDP branch, Lightning's ``ModelParallelStrategy``): the frameworks load the model and the
inner optimizer themselves, the guards' states come from where each integration saved them, and
:func:`restore_agreed` checks them and has every rank agree before any guard is restored. No framework
import here: each integration reads its own files."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CheckpointError, refusal_reason
from ..guard import GuardedOptimizer

__all__ = ["restore_agreed"]


def restore_agreed(saved: Sequence[tuple[GuardedOptimizer, Any]], where: str, caller: str) -> None:
    """``saved``: each guard with the state this rank's checkpoint holds for it (what
    ``GuardedOptimizer._state_without_optimizer()`` returned; None: the checkpoint holds none, as an
    unguarded run's). Each is checked (a NaN/Inf in it or in the inner optimizer's state just loaded, an
    unhealthy verdict) and the ranks agree before any guard is restored: one rank's refusal is every
    rank's (``CheckpointError`` naming the rank and why; the framework has loaded the model and the
    optimizers in place by then, and the message says so). A checkpoint without any guard state leaves
    the guards' own, with a warning; one with a state for some ranks only (saved on another number of
    ranks) is refused. collective."""
    restores: list[Callable[[], None]] = []
    reason: str | None = None
    missing = sum(state is None for _, state in saved)
    for guard, state in saved:
        if state is None:
            continue
        try:
            restores.append(guard._check_without_optimizer(state, guard.optimizer.state_dict()))
        except ValueError as e:  # CheckpointError included
            reason = refusal_reason(e)
            break
    answers = saved[0][0].backend.all_gather_object((reason, missing)) if saved else [(reason, missing)]
    refused = next(((r, a[0]) for r, a in enumerate(answers) if a[0] is not None), None)
    if refused is None and any(a[1] for a in answers) and not all(a[1] == len(saved) for a in answers):
        refused = (next(r for r, a in enumerate(answers) if a[1]),
                   "no guard state for this rank (the checkpoint keeps one per rank: resume on as many ranks as "
                   "saved it)")
    if refused is not None:
        rank, why = refused
        raise CheckpointError(
            f"{caller}: rank {rank} refused the guard's state ({why}). The guards were not restored; the model and "
            f"the optimizers are already loaded from {where} (FSDP loads in place). Load a healthy checkpoint "
            "before training on")
    if missing:
        warnings.warn(f"ampguard: {where} holds no guard state (saved without the guard?): the guards keep their own "
                      "(loss scale, counters, detectors)", RuntimeWarning, stacklevel=4)
    for restore in restores:
        restore()
