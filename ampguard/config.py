"""GuardConfig: every knob of the guard, one per feature, validated at construction.

A feature with parameters of its own takes them in one small frozen dataclass (:class:`Spikes`,
:class:`ZClip`, :class:`Escalation`). Implementation switches that only tests and benchmarks
turn (the CUDA graph, the fused fast path) are environment variables read once per ``wrap``:
:func:`ampguard.switches.implementation_switches`."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["Escalation", "GuardConfig", "Spikes", "ZClip"]

_ON_SPIKE = ("warn", "skip")
_ON_DIVERGENCE = ("warn", "raise")
SCALE_POLICIES = ("default", "headroom")
"""``GuardConfig.scale_policy`` values (also checked when a state dict is loaded)."""
HEADROOM_MARGIN_MAX = 15
"""The largest ``GuardConfig.headroom_margin_log2`` (also checked when a state dict is loaded)."""


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_INT32_MAX = 2**31 - 1


def _int_at_least(name: str, value: Any, low: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise ValueError(f"GuardConfig.{name}={value!r}; allowed: an int >= {low}")


def _optional_int_at_least(name: str, value: Any, low: int) -> None:
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise ValueError(f"GuardConfig.{name}={value!r}; allowed: None or an int >= {low}")


def _positive_float(name: str, value: Any) -> None:
    if not (_is_real(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"GuardConfig.{name}={value!r}; allowed: a finite number > 0")


def _count(name: str, value: Any, why: str) -> None:
    """An int in 1..2**31-1: a count kept in an int32 on the device."""
    _int_at_least(name, value, 1)
    if value > _INT32_MAX:
        raise ValueError(f"GuardConfig.{name}={value!r}; allowed: an int in 1..{_INT32_MAX} ({why})")


def _fraction(name: str, value: Any) -> None:
    if not (_is_real(value) and 0 < value < 1):
        raise ValueError(f"GuardConfig.{name}={value!r}; allowed: a number in (0, 1)")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"GuardConfig.{name}={value!r}; allowed: {' | '.join(map(repr, allowed))}")


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class Escalation:
    """The recovery ladder past skip and backoff: roll back, then stop.

    skip -> back off the scale (every non-finite step) -> roll back to the last good snapshot
    (when ``rollback_after`` non-finite steps fall within ``window`` steps) -> stop with a
    checkpoint and a diagnosis (when that happens again after ``max_rollbacks`` rollbacks).
    Every rank takes the same rung at the same step: the counts come from the agreed reports.
    """

    rollback_after: int = 3
    """Non-finite steps within ``window`` steps that trigger a rollback (>= 1)."""

    window: int = 100
    """Length of the sliding window, in steps (>= 1)."""

    snapshot_every: int | None = 50
    """Take an in-memory snapshot (model + optimizer state, on the model's device) after every
    N-th clean step (None: no snapshot; then rollback needs ``on_rollback``)."""

    snapshot_device: str | None = "cpu"
    """Where snapshots live: "cpu" (default; costs host memory and a copy), or None for the
    parameters' own device (faster, costs device memory)."""

    max_rollbacks: int = 2
    """Rollbacks allowed; the next trigger stops training (>= 0)."""

    def __post_init__(self) -> None:
        _int_at_least("escalation.rollback_after", self.rollback_after, 1)
        _int_at_least("escalation.window", self.window, 1)
        _optional_int_at_least("escalation.snapshot_every", self.snapshot_every, 1)
        _int_at_least("escalation.max_rollbacks", self.max_rollbacks, 0)
        if self.snapshot_device not in (None, "cpu"):
            raise ValueError(f"GuardConfig.escalation.snapshot_device={self.snapshot_device!r}; allowed: 'cpu' | None")


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class Spikes:
    """Spike detection on the gradient norm and the loss (docs/detectors.md). Each detector is on
    when its threshold is set; ``Spikes()`` (the default) flags nothing. The gradient-norm detector
    is the factor detector or the z-score detector, whichever threshold is set (not both)."""

    grad_factor: float | None = None
    """Flag a step whose gradient norm exceeds this factor (> 1) times its running average
    (None: off)."""

    grad_zscore: float | None = None
    """Flag a step whose gradient norm lies more than this many standard deviations (> 0) above its
    running mean: ``(norm - mean) / std > grad_zscore``, mean and variance over ``window`` healthy
    steps (None: off; 4.0 is a reasonable start). Exclusive with ``grad_factor``."""

    loss_factor: float | None = None
    """Flag a step whose loss exceeds this factor (> 1) times its running average (None: off). Works
    alongside either gradient-norm detector."""

    warmup: int = 20
    """Healthy steps the running averages need before spikes are flagged (>= 1). Also the
    re-baseline bound: after this many flagged steps in a row (a lasting shift of the level, not a
    bad batch), the detectors' statistics are re-based on those steps and a ``rebaseline`` anomaly is
    recorded, so a skipping detector skips at most ``warmup`` flagged steps in a row."""

    decay: float = 0.98
    """Decay of the factor detectors' running averages (``grad_factor``, ``loss_factor``), in (0, 1)."""

    window: int = 50
    """The z-score detector's window (>= 2): mean and variance are exponential moving averages of
    span ``window`` (decay ``1 - 2 / (window + 1)``, the window's centre of mass), exact running mean
    and variance over the first healthy steps (see :mod:`ampguard.policies`)."""

    action: str = "warn"
    """What a flagged step does: "warn" (record an anomaly and step anyway) or "skip" (also skip the
    step; the loss scale does not change)."""

    def __post_init__(self) -> None:
        for name in ("grad_factor", "loss_factor"):
            value = getattr(self, name)
            if value is not None and not (_is_real(value) and math.isfinite(value) and value > 1):
                raise ValueError(f"GuardConfig.spikes.{name}={value!r}; allowed: None or a finite number > 1")
        if self.grad_zscore is not None:
            _positive_float("spikes.grad_zscore", self.grad_zscore)
        if self.grad_factor is not None and self.grad_zscore is not None:
            raise ValueError(f"GuardConfig.spikes: grad_factor={self.grad_factor!r} and grad_zscore="
                             f"{self.grad_zscore!r} both set: the gradient-norm detector is the factor detector "
                             "or the z-score detector; allowed: one of them (the other None)")
        _count("spikes.warmup", self.warmup, "the detectors count steps in int32")
        _fraction("spikes.decay", self.decay)
        _int_at_least("spikes.window", self.window, 2)
        _choice("spikes.action", self.action, _ON_SPIKE)


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class ZClip:
    """Adaptive gradient clipping in the style of ZClip (Kumar et al. 2025, arXiv:2504.02507):
    after ``warmup`` finite steps, clip a step whose gradient norm has an EMA z-score above ``z`` to
    ``mean + z**2 * std / score``, and fold the clipped norm into the averages. After ``warmup``
    clipped steps in a row (a lasting shift of the norm's level), mean and variance are re-based on
    those steps and a ``rebaseline`` anomaly is recorded. See docs/detectors.md."""

    z: float = 2.5
    """The z-score threshold (> 0; the paper's default 2.5)."""

    alpha: float = 0.97
    """EMA smoothing factor for the norm's mean and variance, in (0, 1) (the paper's 0.97)."""

    warmup: int = 20
    """Finite steps of exact running mean and variance before clipping starts; also the re-baseline
    bound (>= 1)."""

    def __post_init__(self) -> None:
        _positive_float("zclip.z", self.z)
        _fraction("zclip.alpha", self.alpha)
        _count("zclip.warmup", self.warmup, "ZClip counts steps in int32")


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class GuardConfig:
    """How the guard decides. Every field has a default that changes nothing numerically:
    with ``GuardConfig()`` a healthy run is bitwise identical to the plain GradScaler loop.

    A bad value raises ``ValueError`` naming the field, the value and what is allowed.
    Build one from a mapping (e.g. a YAML file) with :meth:`from_dict`, which also rejects
    unknown keys by name; a misspelt keyword (``GuardConfig(hysterisis=2)``) is a ``TypeError``
    naming the closest field, as the mapping's ``ValueError`` does.
    """

    hysteresis: int = 1
    """Overflows the loss scale tolerates before it backs off (>= 1): the first ``hysteresis - 1``
    overflowing steps after the scale last grew do not back it off, and every later one does,
    until the scale grows again (the allowance refills only on growth, as DeepSpeed's and
    Megatron-LM's do; clean steps in between do not refill it, so intermittent overflows back off
    too). Every overflowing step is still skipped. 1 is GradScaler's behaviour. See
    docs/hysteresis.md."""

    min_scale: float = 1.0
    """Floor of the loss scale (> 0). Reaching it records a ``scale_floor`` anomaly: an fp16
    run whose scale collapses to the floor is usually broken, not unlucky."""

    max_scale: float | None = None
    """Ceiling of the loss scale (None: unbounded, as GradScaler). Must be >= ``min_scale``."""

    max_consecutive_skips: int | None = 100
    """Raise :class:`~ampguard.NonFiniteError`, with a diagnosis, when this many steps in a row were
    skipped (None: never). Every rank raises at the same step; half-way there the ``ampguard``
    logger warns. The default, 100, stops a run that cannot learn (a NaN loss on every step, an
    optimizer over parameters the loss never reaches) and leaves room for what is normal: an fp16
    warm-up, where the scale calibrates down from GradScaler's 65536, skips at most 16 steps per
    unit of ``hysteresis`` (to the default floor 1.0), so up to hysteresis 6 fits."""

    spikes: Spikes = Spikes()
    """Spike detection on the gradient norm and the loss: a :class:`Spikes` (the default flags nothing;
    e.g. ``Spikes(grad_factor=5.0, action="skip")``). A dict of its fields is accepted by
    :meth:`from_dict`."""

    clip_grad_norm: float | None = None
    """Clip the unscaled gradients to this global L2 norm (> 0), using the norm the guard
    already computed: no second pass over the gradients. None: no clipping."""

    zclip: ZClip | None = None
    """Adaptive gradient clipping (a :class:`ZClip`, e.g. ``ZClip(z=2.5)``; None: off). Replaces a
    fixed ``clip_grad_norm`` (the two are exclusive). A dict of its fields is accepted by
    :meth:`from_dict`."""

    history_size: int = 1024
    """How many step reports ``opt.history`` retains (>= 1)."""

    max_anomalies: int = 10_000
    """How many anomalies ``opt.anomalies`` retains, oldest dropped first (>= 1)."""

    param_norms_every: int | None = None
    """Copy per-parameter gradient norms to the host every N steps, for histograms (None:
    only on steps with non-finite gradients, where they name the parameters)."""

    numerics_every: int | None = None
    """Every N steps, sample the numerics of the still-scaled gradients on the device: the fraction of
    gradient elements that are exactly zero (fp16 underflow) and the loss-scale headroom
    log2(65504 / max|scaled grad|). The values ride the step's report (``StepReport.grad_zero_fraction``
    etc.): no host sync (None: off). See docs/numerics.md."""

    indicators_every: int | None = None
    """Every N steps, sample the leading indicators per top-level module of ``wrap(model=...)``:
    gradient norm and update-to-weight ratio (one transient copy of the trained parameters on sampled
    steps, :mod:`ampguard.indicators`), in the step's report (``StepReport.module_grad_norms`` etc.):
    no host sync (None: off). Needs ``model``. See docs/indicators.md."""

    scale_policy: str = "default"
    """How the loss scale grows. "default": GradScaler's rule (back off on overflow, grow after
    ``growth_interval`` clean steps). "headroom" (opt-in; fp16 with a GradScaler; needs
    ``numerics_every``): overflows still skip and back off, but the growth timer never grows the
    scale; instead, on every sampled step that was taken, the scale is set from the headroom
    measured on the still-scaled gradients, the minimum over ranks (agreed through the step's one
    collective): ``scale * 2**(floor(headroom) - headroom_margin_log2)``, clamped to
    [``min_scale``, ``max_scale``] (``max_scale`` None: 2**24). See docs/numerics.md."""

    headroom_margin_log2: int = 2
    """With ``scale_policy="headroom"``: doublings of the loss scale kept free below fp16's
    largest value (an int in [0, 15]): the largest scaled gradient is aimed at 65504 / 2**k."""

    consistency_every: int | None = None
    """Every N steps, compare step count, skip count, loss scale and a bitwise fingerprint of the
    parameters across ranks (None: off); on a mismatch, a second exchange names the parameters and
    the ranks whose bits differ. Costs one pass over the parameters and one small extra collective on
    those steps (:mod:`ampguard.consistency`)."""

    param_check_every: int | None = 10
    """Every N steps, check on device that the updated parameters are finite: max|p| of each parameter
    (one read of the weights, NaN/Inf wherever an element is), riding the step's report (no host sync).
    A hit is a ``nonfinite_params`` anomaly naming the parameters; the ladder rolls back where it can,
    else :class:`~ampguard.NonFiniteError` stops training. None: off. See docs/integrity.md."""

    on_divergence: str = "warn"
    """What a failed consistency check does: "warn" (record a ``rank_divergence`` anomaly)
    or "raise" (also raise :class:`~ampguard.RankDivergenceError` on every rank)."""

    forensics: bool = True
    """After a non-finite step, arm module hooks on ``wrap(model=...)`` to name the first module
    that goes non-finite next (healthy runs never register a hook). Under fp16 with a GradScaler an
    overflow with a finite loss arms only right after a step that backed the scale off (backing off did not
    cure it); a non-finite loss arms at once (docs/diagnosis.md). Needs ``model``."""

    forensics_window: int = 50
    """Clean steps after which armed forensics hooks are removed again (>= 1)."""

    sentinel: str | tuple[str, ...] | None = None
    """Opt-in coarse sentinel (:mod:`ampguard.forensics.sentinel`): ``"top"`` (the model's top-level
    blocks) or module names. One on-device finiteness flag per block output, no host sync, no
    hook inside a block: a non-finite step names its first non-finite block (or the input) in
    its own report, and the forensics hooks then arm inside that block only. With ``"top"``, the
    last block's output, when it is the model's output (a language model's logits), is read through
    the loss the guard is given instead of summed (docs/diagnosis.md). None: off (no hook on healthy
    steps). Needs ``model``."""

    escalation: Escalation | None = None
    """The rollback/stop ladder (None: skip and back off only). A dict of
    :class:`Escalation` fields is accepted by :meth:`from_dict`."""

    def __post_init__(self) -> None:
        if not isinstance(self.forensics, bool):  # 'no' and 'false' are truthy
            raise ValueError(f"GuardConfig.forensics={self.forensics!r}; allowed: True | False")
        _count("hysteresis", self.hysteresis, "the allowance is counted in an int32")
        _positive_float("min_scale", self.min_scale)
        if self.max_scale is not None:
            _positive_float("max_scale", self.max_scale)
            if self.max_scale < self.min_scale:
                raise ValueError(f"GuardConfig.max_scale={self.max_scale!r} is below min_scale={self.min_scale!r}; "
                                 "allowed: None or a value >= min_scale")
        _optional_int_at_least("max_consecutive_skips", self.max_consecutive_skips, 1)
        if not isinstance(self.spikes, Spikes):
            raise ValueError(f"GuardConfig.spikes={self.spikes!r}; allowed: an ampguard.Spikes "
                             "(Spikes(), the default, flags nothing)")
        if self.clip_grad_norm is not None:
            _positive_float("clip_grad_norm", self.clip_grad_norm)
        if self.zclip is not None and not isinstance(self.zclip, ZClip):
            raise ValueError(f"GuardConfig.zclip={self.zclip!r}; allowed: None (off) or an ampguard.ZClip: "
                             "zclip=ZClip() for the paper's defaults, ZClip(z=2.5, alpha=0.97, warmup=20)")
        if self.zclip is not None and self.clip_grad_norm is not None:
            raise ValueError(f"GuardConfig.zclip={self.zclip!r} with clip_grad_norm={self.clip_grad_norm!r}: ZClip "
                             "replaces a fixed clipping norm; allowed: one of them (clip_grad_norm=None, or "
                             "zclip=None)")
        _int_at_least("history_size", self.history_size, 1)
        _int_at_least("max_anomalies", self.max_anomalies, 1)
        _optional_int_at_least("param_norms_every", self.param_norms_every, 1)
        _optional_int_at_least("numerics_every", self.numerics_every, 1)
        _optional_int_at_least("indicators_every", self.indicators_every, 1)
        _optional_int_at_least("consistency_every", self.consistency_every, 1)
        _optional_int_at_least("param_check_every", self.param_check_every, 1)
        _choice("scale_policy", self.scale_policy, SCALE_POLICIES)
        if not (isinstance(self.headroom_margin_log2, int) and not isinstance(self.headroom_margin_log2, bool)
                and 0 <= self.headroom_margin_log2 <= HEADROOM_MARGIN_MAX):
            raise ValueError(f"GuardConfig.headroom_margin_log2={self.headroom_margin_log2!r}; allowed: an int in "
                             f"[0, {HEADROOM_MARGIN_MAX}] (doublings of the loss scale kept free below fp16's max "
                             "65504)")
        if self.scale_policy == "headroom" and self.numerics_every is None:
            raise ValueError("GuardConfig.scale_policy='headroom' with numerics_every=None: the headroom policy sets "
                             "the scale from the sampled headroom; allowed: numerics_every=N (e.g. 10), or "
                             "scale_policy='default'")
        _choice("on_divergence", self.on_divergence, _ON_DIVERGENCE)
        _int_at_least("forensics_window", self.forensics_window, 1)
        if isinstance(self.sentinel, (list, tuple)):
            object.__setattr__(self, "sentinel", tuple(self.sentinel))
        if not (self.sentinel is None or self.sentinel == "top" or (
                isinstance(self.sentinel, tuple) and self.sentinel and all(isinstance(n, str) for n in self.sentinel))):
            raise ValueError(f"GuardConfig.sentinel={self.sentinel!r}; allowed: None | 'top' | a non-empty list of "
                             "module names")
        if self.escalation is not None and not isinstance(self.escalation, Escalation):
            raise ValueError(f"GuardConfig.escalation={self.escalation!r}; allowed: None or an ampguard.Escalation")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> GuardConfig:
        """Build a config from a mapping (e.g. a YAML file); ``spikes``, ``zclip`` and ``escalation``
        may be mappings of their class's fields. An unknown key raises ValueError naming it (a key
        of an older ampguard: naming what replaced it)."""
        problem = _removed_fields(values) or _unknown_keys(cls, values)
        if problem:
            raise ValueError(problem)
        values = dict(values)
        for name, part in _PARTS.items():
            if isinstance(values.get(name), Mapping):
                fields = dict(values[name])
                unknown = _unknown_keys(part, fields)
                if unknown:
                    raise ValueError(f"GuardConfig.{name}: {unknown}")
                values[name] = part(**fields)
        return cls(**values)

    def replace(self, **changes: Any) -> GuardConfig:
        """A copy with some fields changed (validated like the original)."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return GuardConfig.from_dict({**current, **changes})


_PARTS: dict[str, type] = {"spikes": Spikes, "zclip": ZClip, "escalation": Escalation}
"""The fields that take a dataclass of their own (a mapping in :meth:`GuardConfig.from_dict`)."""

_REMOVED: dict[str, str] = {
    "grad_spike_factor": "use spikes=Spikes(grad_factor={v!r})",
    "loss_spike_factor": "use spikes=Spikes(loss_factor={v!r})",
    "spike_detector": "the gradient-norm detector follows the threshold that is set: spikes=Spikes(grad_factor=...) "
                      "for the factor detector, spikes=Spikes(grad_zscore=...) for the z-score detector",
    "spike_zscore": "use spikes=Spikes(grad_zscore={v!r}) (setting it turns the z-score detector on)",
    "spike_window": "use spikes=Spikes(window={v!r})",
    "spike_warmup": "use spikes=Spikes(warmup={v!r}) (and zclip=ZClip(warmup={v!r}) for ZClip)",
    "spike_ema_decay": "use spikes=Spikes(decay={v!r})",
    "on_spike": "use spikes=Spikes(action={v!r})",
    "zclip_z": "use zclip=ZClip(z={v!r})",
    "zclip_alpha": "use zclip=ZClip(alpha={v!r})",
    "cuda_graph": "set AMPGUARD_CUDA_GRAPH={env} (tests/benchmarks only)",
    "fused_fast_path": "set AMPGUARD_FUSED_FAST_PATH={env} (tests/benchmarks only)",
    "track_memory": "the guard no longer reads device memory: the Prometheus and OpenTelemetry exporters read the "
                    "CUDA allocator's high-water mark themselves (the device memory peak metric; nothing reset)",
    "memory_peak_per_step": "the guard no longer resets torch's process-wide peak memory counters; call "
                            "torch.cuda.reset_peak_memory_stats() yourself where you want a window of your own",
}
"""Fields of an older GuardConfig, each with what replaced it (no aliases: the error names the new way)."""


def _removed_fields(keys: Mapping[str, Any]) -> str:
    """"" when no key is a removed field; else one message naming each and what replaced it."""
    found = [k for k in keys if k in _REMOVED]
    return "; ".join(f"GuardConfig has no field {k!r} any more: " + _REMOVED[k].format(
        v=keys[k], env="0" if keys[k] is False or keys[k] == 0 else "1") for k in found)


def _unknown_keys(cls: type, keys: Iterable[Any]) -> str:
    """"" when every key is a field of ``cls``; else a message naming the unknown keys, each with the
    closest field (difflib), and the known ones."""
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = [k for k in keys if k not in known]
    if not unknown:
        return ""
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown {cls.__name__} key(s): {', '.join(hints)}; known keys: {', '.join(known)}"


def _suggest_unknown_keywords(cls: type) -> None:
    """Make ``cls(...)`` (a kw_only dataclass) answer a misspelt keyword as :meth:`GuardConfig.from_dict`
    answers a misspelt key: a ``TypeError`` (what Python raises for it) naming the closest field. The
    generated ``__init__`` still does the work, so ``dataclasses.replace`` and pickling are unchanged."""
    generated = vars(cls)["__init__"]

    @functools.wraps(generated)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = (_removed_fields(kwargs) if cls is GuardConfig else "") or _unknown_keys(cls, kwargs)
        if unknown:
            raise TypeError(unknown)
        generated(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]


_suggest_unknown_keywords(Escalation)
_suggest_unknown_keywords(Spikes)
_suggest_unknown_keywords(ZClip)
_suggest_unknown_keywords(GuardConfig)
