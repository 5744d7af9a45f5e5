"""The guard's state as plain Python values, and its restore: validate everything, then apply.

A failed :func:`load` changes nothing: every field of the dict is checked before the inner
optimizer, the scaler or any guard counter is touched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .config import HEADROOM_MARGIN_MAX, SCALE_POLICIES, GuardConfig
from .integrity import Verdict, check_loaded
from .policies import SpikeState
from .records import History
from .reporter import Reporter
from .scaling import ScaleState

__all__ = ["STATE_VERSION", "Carried", "Guarded", "check", "load", "save"]


class Guarded(Protocol):
    """What is saved and restored of the guard itself (:class:`~ampguard.guard.GuardedOptimizer`)."""

    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    precision: str
    config: GuardConfig

    @property
    def step_count(self) -> int: ...


class Carried(Protocol):
    """The state a step carries to the next (:class:`~ampguard.pipeline.StepPipeline`'s)."""

    spikes: SpikeState
    scale_state: ScaleState

STATE_VERSION = 1

_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def save(guard: Guarded, rep: Reporter, pipe: Carried, *, optimizer: bool = True) -> dict[str, Any]:
    """Inner optimizer, scaler and every piece of guard state (``rep``: its records; ``pipe``: the
    state its steps carry). ``optimizer=False``: ``"optimizer"`` is None, the inner optimizer's
    state being saved elsewhere (``torch.distributed.checkpoint``: :mod:`ampguard.integrations.dcp`).
    Synchronises the host."""
    ladder = rep.ladder
    return {
        "optimizer": guard.optimizer.state_dict() if optimizer else None,
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
            **_save_detectors(pipe.spikes),
            "quarantine": list(rep.quarantine),
            "escalation": ladder.state_dict() if ladder is not None else None,
            "scale_policy": guard.config.scale_policy,
            "headroom_margin_log2": guard.config.headroom_margin_log2,
        },
    }


_NOTHING = "Nothing was loaded."
_INT32_MAX = 2**31 - 1  # counters held in int32 device tensors (hysteresis run, EMA count, growth tracker)
_INT64_MAX = 2**63 - 1
_FLOAT32_MAX = 3.4028234663852886e38  # the spike averages are float32 device tensors


def _refuse(what: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{what} is {value!r:.120}; expected {allowed}. {_NOTHING}")


def _bad(field: str, value: Any, allowed: str) -> ValueError:
    return _refuse(f"state_dict['ampguard'][{field!r}]", value, allowed)


def _present(g: dict[str, Any], field: str) -> Any:
    if field not in g:
        raise ValueError(f"state_dict['ampguard'] has no {field!r}: it was not made by GuardedOptimizer.state_dict() "
                         f"of this version. {_NOTHING}")
    return g[field]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(g: dict[str, Any], field: str, high: int = _INT64_MAX) -> int:
    v = _present(g, field)
    if not (_is_int(v) and 0 <= v <= high):
        raise _bad(field, v, f"an int in 0..{high}")
    return int(v)


def _real(g: dict[str, Any], field: str) -> float:
    v = _present(g, field)
    if not (_is_real(v) and abs(v) <= _FLOAT32_MAX and math.isfinite(v)):  # abs() first: no float(10**400)
        raise _bad(field, v, "a finite number (float32 range)")
    return float(v)


# -- the z-score detector's and ZClip's running statistics --
# (and the runs of flagged steps the detectors re-baseline on, which came later)
_DETECTORS = {"z_mean": "z_mean", "z_var": "z_var", "zclip_mean": "clip_mean", "zclip_var": "clip_var",
              "zclip_count": "clip_count"}
_REBASELINE = {"flag_run": "flag_run", "flag_norm_mean": "flag_norm_mean", "flag_norm_var": "flag_norm_var",
               "flag_loss_mean": "flag_loss_mean", "zclip_run": "clip_run", "zclip_flag_mean": "clip_flag_mean",
               "zclip_flag_var": "clip_flag_var"}
_GROUPS = (_DETECTORS, _REBASELINE)
"""state_dict key -> SpikeState attribute, per group of keys saved together (a group is absent as a
whole in a state saved before it existed)."""
_COUNTS = ("zclip_count", "flag_run", "zclip_run")
_VARIANCES = ("z_var", "zclip_var", "flag_norm_var", "zclip_flag_var")


def _save_detectors(spikes: SpikeState) -> dict[str, Any]:
    return {k: (int if k in _COUNTS else float)(getattr(spikes, a).item()) for group in _GROUPS
            for k, a in group.items()}


def _check_detectors(g: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Per group, the detectors' statistics to restore; None when the state predates the group (a
    checkpoint of an earlier version: those statistics then start afresh). Present, all must be
    valid: a mean finite, a variance finite and >= 0, a count an int32."""
    out: list[dict[str, Any] | None] = []
    for group in _GROUPS:
        if not any(k in g for k in group):
            out.append(None)
            continue
        values: dict[str, Any] = {k: _count(g, k, _INT32_MAX) if k in _COUNTS else _real(g, k) for k in group}
        for var in _VARIANCES:
            if var in group and values[var] < 0:
                raise _bad(var, g[var], "a finite number >= 0 (float32 range)")
        out.append(values)
    return out


def _restore_detectors(spikes: SpikeState, groups: list[dict[str, Any] | None]) -> None:
    for group, values in zip(_GROUPS, groups):
        for key, attr in group.items():
            getattr(spikes, attr).fill_(0 if values is None else values[key])
# -- end of the z-score detector's and ZClip's statistics --


def _check_optimizer(guard: Guarded, sd: Any) -> None:
    if not (isinstance(sd, dict) and isinstance(sd.get("state"), dict) and isinstance(sd.get("param_groups"), list)):
        raise ValueError("state_dict['optimizer'] is not an optimizer state (keys 'state' and 'param_groups'). "
                         + _NOTHING)
    ours = guard.optimizer.param_groups
    theirs = sd["param_groups"]
    sizes = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) else -1
             for g in theirs]
    if sizes != [len(g["params"]) for g in ours]:
        raise ValueError(f"state_dict['optimizer'] has param groups of sizes {sizes}; this optimizer has "
                         f"{[len(g['params']) for g in ours]}. {_NOTHING}")


def _check_scaler(guard: Guarded, sd: Any) -> dict[str, Any] | None:
    if (sd is None) != (guard.scaler is None):
        raise ValueError(f"state and guard disagree on loss scaling (one has a GradScaler, the other not). {_NOTHING}")
    if sd is None:
        return None
    if not isinstance(sd, dict) or any(k not in sd for k in _SCALER_KEYS):
        raise ValueError(f"state_dict['scaler'] must be a GradScaler state_dict with keys {list(_SCALER_KEYS)}; "
                         f"got {sd!r:.120}. {_NOTHING}")

    def check(key: str, ok: bool, allowed: str) -> None:
        if not ok:
            raise _refuse(f"state_dict['scaler'][{key!r}]", sd[key], allowed)

    def real(key: str) -> bool:
        v = sd[key]
        return _is_real(v) and abs(v) <= _FLOAT32_MAX and math.isfinite(v)

    check("scale", real("scale") and sd["scale"] > 0, "a finite number > 0")
    check("growth_factor", real("growth_factor") and sd["growth_factor"] >= 1, "a finite number >= 1")
    check("backoff_factor", real("backoff_factor") and 0 < sd["backoff_factor"] <= 1, "a number in (0, 1]")
    check("growth_interval", _is_int(sd["growth_interval"]) and 1 <= sd["growth_interval"] <= _INT32_MAX,
          f"an int in 1..{_INT32_MAX}")
    check("_growth_tracker", _is_int(sd["_growth_tracker"]) and 0 <= sd["_growth_tracker"] <= _INT32_MAX,
          f"an int in 0..{_INT32_MAX}")
    return sd


def _check_escalation(value: Any) -> dict[str, Any]:
    """The ladder's state to restore (``None`` in the dict: a fresh ladder)."""
    if value is None:
        return {"recent": [], "rollbacks": 0}
    if not isinstance(value, dict):
        raise _bad("escalation", value, "None or a dict with 'recent' and 'rollbacks'")
    recent = value.get("recent", [])
    if not isinstance(recent, list) or any(not (_is_int(s) and 0 <= s <= _INT64_MAX) for s in recent):
        raise _bad("escalation", value, "'recent' as a list of step numbers")
    return {"recent": list(recent), "rollbacks": _count({"escalation.rollbacks": value.get("rollbacks", 0)},
                                                        "escalation.rollbacks")}


def _check_scale_policy(g: dict[str, Any]) -> None:
    """The scale policy the state was saved under (absent in states saved before the headroom policy existed: the
    default). Either policy's state loads into either: the scale, growth tracker and hysteresis run
    are the scaler's and the guard's own (the headroom policy keeps the tracker at 0)."""
    policy = g.get("scale_policy", "default")
    if policy not in SCALE_POLICIES:
        raise _bad("scale_policy", policy, " | ".join(map(repr, SCALE_POLICIES)))
    margin = g.get("headroom_margin_log2", 2)
    if not (_is_int(margin) and 0 <= margin <= HEADROOM_MARGIN_MAX):
        raise _bad("headroom_margin_log2", margin, f"an int in [0, {HEADROOM_MARGIN_MAX}]")


def load(guard: Guarded, rep: Reporter, pipe: Carried, state_dict: Any) -> tuple[int, Verdict | None]:
    """Restore what :func:`save` made; the run then continues bit for bit. Returns the restored
    step (the guard resumes there) and the saved verdict (None: saved before verdicts existed),
    whose fingerprints the weights must match at the next step (:func:`ampguard.integrity.check_weights`).
    A state with an unhealthy verdict or a non-finite optimizer state is refused
    (:func:`ampguard.integrity.check_loaded`)."""
    return check(guard, rep, pipe, state_dict)()


def check(guard: Guarded, rep: Reporter, pipe: Carried, state_dict: Any, *,
          optimizer_state: Any = None) -> Callable[[], tuple[int, Verdict | None]]:
    """:func:`load` in two halves: every field checked now (a refusal raises, changing nothing),
    and the returned call applies them (it cannot fail). ``optimizer_state``: where ``state_dict``
    was saved without the inner optimizer (``save(optimizer=False)``), the optimizer state restored
    elsewhere (``torch.distributed.checkpoint``'s, keys ``state`` and ``param_groups``), checked for
    a NaN/Inf here and not loaded by the returned call."""
    if not isinstance(state_dict, dict) or "ampguard" not in state_dict or "optimizer" not in state_dict:
        raise ValueError(
            "load_state_dict() expects a dict made by GuardedOptimizer.state_dict() (keys 'optimizer', "
            f"'scaler', 'ampguard'); to load a plain optimizer state, use opt.optimizer.load_state_dict(). {_NOTHING}"
        )
    if "scaler" not in state_dict:
        raise ValueError(f"state_dict has no 'scaler' (None when the run had no GradScaler). {_NOTHING}")
    g = state_dict["ampguard"]
    if not isinstance(g, dict):
        raise ValueError(f"state_dict['ampguard'] must be a dict, got {type(g).__name__}. {_NOTHING}")
    if g.get("version") != STATE_VERSION or isinstance(g.get("version"), bool):
        raise ValueError(f"unsupported ampguard state version {g.get('version')!r} (expected {STATE_VERSION}). "
                         + _NOTHING)
    if g.get("precision") != guard.precision:
        raise ValueError(f"state was saved with precision={g.get('precision')!r}, this guard runs "
                         f"{guard.precision!r}. {_NOTHING}")
    step = _count(g, "step")
    counts = {f: _count(g, f) for f in ("skipped_total", "consecutive_skips")}
    counts.update({f: _count(g, f, _INT32_MAX) for f in ("overflow_run", "ema_count")})
    if counts["skipped_total"] > step or counts["consecutive_skips"] > counts["skipped_total"]:
        raise _bad("skipped_total", counts["skipped_total"],
                   f"skipped_total <= step ({step}) and consecutive_skips <= skipped_total")
    emas = {f: _real(g, f) for f in ("grad_ema", "loss_ema")}
    detectors = _check_detectors(g)
    quarantine = _present(g, "quarantine")
    if not isinstance(quarantine, (list, tuple)):
        raise _bad("quarantine", quarantine, "a list of batch ids")
    escalation = _check_escalation(_present(g, "escalation"))
    _check_scale_policy(g)
    scaler = _check_scaler(guard, state_dict["scaler"])
    inner = state_dict["optimizer"]
    if inner is None:  # saved with optimizer=False: the caller restores the inner optimizer's state
        if optimizer_state is None:
            raise ValueError("state_dict['optimizer'] is None: the state was saved without the inner optimizer (by "
                             "ampguard.integrations.dcp); restore it with ampguard.integrations.dcp.set_state_dict(). "
                             + _NOTHING)
        if not (isinstance(optimizer_state, dict) and isinstance(optimizer_state.get("state"), dict)):
            raise ValueError("the optimizer state to check is not one (keys 'state' and 'param_groups'). " + _NOTHING)
        checked_state = optimizer_state["state"]
    else:
        _check_optimizer(guard, inner)
        checked_state = inner.get("state", {})
    verdict = Verdict.from_dict(g["verdict"]) if g.get("verdict") is not None else None
    check_loaded(verdict, checked_state)

    def apply() -> tuple[int, Verdict | None]:
        # Everything checked: apply. The inner optimizer first (torch checks its own groups before it
        # changes anything, and builds the new state aside), then the scaler and the guard's counters,
        # whose values were all checked above to fit the tensors they fill: nothing below can fail.
        if inner is not None:
            guard.optimizer.load_state_dict(inner)
        if guard.scaler is not None and scaler is not None:  # both or neither: _check_scaler
            guard.scaler.load_state_dict(scaler)
        _restore_counters(guard.config, rep, pipe, step, counts, emas, list(quarantine), escalation)
        _restore_detectors(pipe.spikes, detectors)
        return step, verdict

    return apply


def _restore_counters(config: GuardConfig, rep: Reporter, pipe: Carried, step: int, counts: dict[str, int],
                      emas: dict[str, float], quarantine: list[Any], escalation: dict[str, Any]) -> None:
    rep.clear_pending()
    rep.history = History(config.history_size)
    rep.history._count = step  # reports before the resume are not available
    rep.skipped_total, rep.consecutive_skips = counts["skipped_total"], counts["consecutive_skips"]
    rep.quarantine[:] = quarantine
    pipe.scale_state.overflow_run.fill_(counts["overflow_run"])
    pipe.spikes.grad_ema.fill_(emas["grad_ema"])
    pipe.spikes.loss_ema.fill_(emas["loss_ema"])
    pipe.spikes.count.fill_(counts["ema_count"])
    if rep.ladder is not None:
        rep.ladder.load_state_dict(escalation)
