"""The guard's state as plain Python values, and its restore: validate everything, then apply.

A failed :func:`load` changes nothing: every field of the dict is checked before the inner
optimizer, the scaler or any guard counter is touched.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["STATE_VERSION", "load", "save"]

STATE_VERSION = 1

_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def save(guard: Any) -> dict[str, Any]:
    """Inner optimizer, scaler and every piece of guard state. Synchronises the host."""
    pipe, rep = guard._pipeline, guard._reporter
    ladder = rep.ladder
    return {
        "optimizer": guard.optimizer.state_dict(),
        "scaler": guard.scaler.state_dict() if guard.scaler is not None else None,
        "ampguard": {
            "version": STATE_VERSION,
            "precision": guard.precision,
            "step": guard.step_count,
            "skipped_total": rep.skipped_total,
            "consecutive_skips": rep.consecutive_skips,
            "overflow_run": int(pipe.scale_state.overflow_run.item()),
            "grad_ema": float(pipe.spikes.grad_ema.item()),
            "loss_ema": float(pipe.spikes.loss_ema.item()),
            "ema_count": int(pipe.spikes.count.item()),
            "quarantine": list(rep.quarantine),
            "escalation": ladder.state_dict() if ladder is not None else None,
        },
    }


def _bad(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"state_dict['ampguard'][{field!r}] is {value!r}; expected {allowed}. Nothing was loaded.")


def _count(g: dict[str, Any], field: str) -> int:
    if field not in g:
        raise ValueError(f"state_dict['ampguard'] has no {field!r}: it was not made by GuardedOptimizer.state_dict() "
                         "of this version. Nothing was loaded.")
    v = g[field]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _bad(field, v, "an int >= 0")
    return v


def _real(g: dict[str, Any], field: str) -> float:
    if field not in g:
        raise ValueError(f"state_dict['ampguard'] has no {field!r}. Nothing was loaded.")
    v = g[field]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        raise _bad(field, v, "a number")
    return float(v)


def _check_optimizer(guard: Any, sd: Any) -> None:
    if not (isinstance(sd, dict) and isinstance(sd.get("state"), dict) and isinstance(sd.get("param_groups"), list)):
        raise ValueError("state_dict['optimizer'] is not an optimizer state (keys 'state' and 'param_groups'). "
                         "Nothing was loaded.")
    ours = guard.optimizer.param_groups
    theirs = sd["param_groups"]
    sizes = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in theirs]
    if sizes != [len(g["params"]) for g in ours]:
        raise ValueError(f"state_dict['optimizer'] has param groups of sizes {sizes}; this optimizer has "
                         f"{[len(g['params']) for g in ours]}. Nothing was loaded.")


def _check_scaler(guard: Any, sd: Any) -> None:
    if (sd is None) != (guard.scaler is None):
        raise ValueError("state and guard disagree on loss scaling (one has a GradScaler, the other not). "
                         "Nothing was loaded.")
    if sd is None:
        return
    if not isinstance(sd, dict) or any(k not in sd for k in _SCALER_KEYS):
        raise ValueError(f"state_dict['scaler'] must be a GradScaler state_dict with keys {list(_SCALER_KEYS)}; "
                         f"got {sd!r:.120}. Nothing was loaded.")
    for k in _SCALER_KEYS:
        if isinstance(sd[k], bool) or not isinstance(sd[k], (int, float)):
            raise ValueError(f"state_dict['scaler'][{k!r}] is {sd[k]!r}; expected a number. Nothing was loaded.")


def _check_escalation(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad("escalation", value, "None or a dict with 'recent' and 'rollbacks'")
    recent = value.get("recent", [])
    if not isinstance(recent, list) or any(isinstance(s, bool) or not isinstance(s, int) for s in recent):
        raise _bad("escalation", value, "'recent' as a list of step numbers")
    _count({"rollbacks": value.get("rollbacks", 0)}, "rollbacks")


def load(guard: Any, state_dict: Any) -> None:
    """Restore what :func:`save` made; the run then continues bit for bit."""
    if not isinstance(state_dict, dict) or "ampguard" not in state_dict or "optimizer" not in state_dict:
        raise ValueError(
            "load_state_dict() expects a dict made by GuardedOptimizer.state_dict() (keys 'optimizer', "
            "'scaler', 'ampguard'); to load a plain optimizer state, use opt.optimizer.load_state_dict()"
        )
    g = state_dict["ampguard"]
    if not isinstance(g, dict):
        raise ValueError(f"state_dict['ampguard'] must be a dict, got {type(g).__name__}. Nothing was loaded.")
    if g.get("version") != STATE_VERSION:
        raise ValueError(f"unsupported ampguard state version {g.get('version')!r} (expected {STATE_VERSION})")
    if g.get("precision") != guard.precision:
        raise ValueError(f"state was saved with precision={g.get('precision')!r}, this guard runs {guard.precision!r}")
    step = _count(g, "step")
    counts = {f: _count(g, f) for f in ("skipped_total", "consecutive_skips", "overflow_run", "ema_count")}
    if counts["skipped_total"] > step or counts["consecutive_skips"] > counts["skipped_total"]:
        raise _bad("skipped_total", counts["skipped_total"],
                   f"skipped_total <= step ({step}) and consecutive_skips <= skipped_total")
    emas = {f: _real(g, f) for f in ("grad_ema", "loss_ema")}
    quarantine = g.get("quarantine", [])
    if not isinstance(quarantine, (list, tuple)):
        raise _bad("quarantine", quarantine, "a list of batch ids")
    _check_escalation(g.get("escalation"))
    _check_scaler(guard, state_dict.get("scaler"))
    _check_optimizer(guard, state_dict["optimizer"])

    # Everything checked: apply. The inner optimizer first (torch checks its own groups before it
    # changes anything), then the scaler, then the guard's counters.
    guard.optimizer.load_state_dict(state_dict["optimizer"])
    if guard.scaler is not None:
        guard.scaler.load_state_dict(state_dict["scaler"])
    _restore_counters(guard, step, counts, emas, list(quarantine), g.get("escalation"))


def _restore_counters(guard: Any, step: int, counts: dict[str, int], emas: dict[str, float],
                      quarantine: list[Any], escalation: dict[str, Any] | None) -> None:
    from .report import History

    rep, pipe = guard._reporter, guard._pipeline
    rep.clear_pending()
    rep.history = History(guard.config.history_size)
    rep.history._count = step  # reports before the resume are not available
    rep.skipped_total, rep.consecutive_skips = counts["skipped_total"], counts["consecutive_skips"]
    rep.quarantine[:] = quarantine
    pipe.scale_state.overflow_run.fill_(counts["overflow_run"])
    pipe.spikes.grad_ema.fill_(emas["grad_ema"])
    pipe.spikes.loss_ema.fill_(emas["loss_ema"])
    pipe.spikes.count.fill_(counts["ema_count"])
    if rep.ladder is not None and escalation:
        rep.ladder.load_state_dict(escalation)
    guard._reset_iteration(step)
