"""The fp8 part of the preflight: a trial of torchao float8 training, measured per layer and role.

``preflight(..., precision=(..., "fp8"))`` runs its fp8 trial through :class:`Fp8Trial`: the fresh model from the
user's factory is converted with ``torchao.float8.convert_to_float8_training`` and trained under bf16 autocast
(the guard at ``precision="bf16"``), whose own fp8 monitoring (on for a model holding ``Float8Linear`` layers)
samples every cast on every step (``numerics_every=1``: underflow included, the trial is short) and puts it in
each step's report. Each cast's worst over the trial becomes an :class:`Fp8CastStats`;
:func:`advise` turns them into an :class:`Fp8Advice`: which layers should stay in bf16, each with its measured
reason, and the ``module_filter_fn`` that keeps them there.

torchao is imported only by :func:`setup` (when "fp8" is a candidate), and its version is checked first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._versions import require
from .records import FP8_ROLES, Fp8Cast, StepReport

__all__ = ["FP8_UNDERFLOW_LIMIT", "Fp8Advice", "Fp8CastStats", "Fp8Trial", "advise", "setup"]

FP8_UNDERFLOW_LIMIT = 0.01
"""A layer whose cast flushed more than this fraction of its tensor's non-zero elements to 0, on any trial step,
should stay in bf16 (the level ``AmpguardFp8UnderflowRising`` alerts above)."""

SATURATION = ("not measured: torchao 0.18 float8 training scales dynamically (each cast's scale comes from its own "
              "amax), so nothing saturates")
"""Why every :attr:`Fp8CastStats.saturation` is None."""

Filter = Callable[[torch.nn.Module, str], bool]


def format_range(dtype: torch.dtype) -> float:
    """log2(largest / smallest subnormal) of an fp8 dtype: the widest dynamic range one scale can hold
    (17.8 bits for e4m3fn, 31.8 for e5m2)."""
    info = torch.finfo(dtype)
    return math.log2(info.max / (info.smallest_normal * info.eps))


@dataclasses.dataclass(frozen=True)
class Fp8CastStats:
    """One cast (a ``Float8Linear`` and a role) over every step of the fp8 trial: its worst values."""

    module: str
    """Qualified name of the ``Float8Linear``, as ``model_fn()``'s ``named_modules()`` names it."""
    role: str
    """``input``, ``weight`` or ``grad_output``."""
    dtype: str
    """The fp8 dtype the role casts to (``float8_e4m3fn``, ``float8_e5m2``)."""
    steps: int
    """Trial steps on which this cast ran."""
    amax: float
    """The largest amax over the trial (NaN when any step's was NaN)."""
    scale: float
    """The smallest scale over the trial (NaN when any step's was NaN)."""
    underflow: float | None
    """The largest underflow fraction (non-zero in high precision, 0 after the cast) over the trial's steps on which
    this cast was finite."""
    dynamic_range: float | None
    """The largest finite ``log2(amax / min nonzero |x|)`` over the same steps, in bits."""
    format_range: float
    """The widest dynamic range the fp8 dtype holds under one scale, in bits (:func:`format_range`)."""
    nonfinite_steps: int
    """Steps on which the amax or scale was non-finite, or the scale 0."""
    first_nonfinite: str | None = None
    """``"step 3: amax inf → scale 0"`` for the first of them."""
    saturation: float | None = None
    """Always None: see :data:`SATURATION`."""


@dataclasses.dataclass(frozen=True)
class Fp8Advice:
    """What the fp8 trial measured and which layers should stay in bf16.

    ``convert_to_float8_training(model, config=..., module_filter_fn=advice.module_filter_fn)`` converts the
    layers the trial converted except those in :attr:`keep_bf16`."""

    casts: tuple[Fp8CastStats, ...]
    """Every cast of every ``Float8Linear`` of the trial, module by module, role by role."""
    converted: tuple[str, ...]
    """The layers the trial converted to ``Float8Linear``."""
    keep_bf16: dict[str, str]
    """Layer -> the measured reason it should stay in bf16 (in the model's order)."""
    nonfinite_in_bf16_too: dict[str, str]
    """Layer -> its non-finite casts, where the bf16 trial went non-finite too: the cause is upstream of fp8 (the
    data, the model), so bf16 would not help and the layer is not in :attr:`keep_bf16`."""
    underflow_limit: float
    """The underflow fraction above which a layer is kept in bf16 (:data:`FP8_UNDERFLOW_LIMIT`)."""
    emulated: str | None
    """Why the trial emulated the fp8 matmuls (``Float8LinearConfig(emulate=True)``), or None where it ran them."""
    loss_vs_bf16: float | None = None
    """The fp8 trial's last loss minus the bf16 trial's (None unless both ran)."""
    time_vs_bf16: float | None = None
    """The fp8 trial's median step time over the bf16 trial's (below 1: faster; None unless both ran). Not a forecast
    of fp8's speed: the trial runs torchao eagerly (no ``torch.compile``) and measures every cast on every step."""

    def module_filter_fn(self, module: torch.nn.Module, fqn: str) -> bool:
        """``convert_to_float8_training``'s filter: True for a layer the trial converted and found fit for fp8."""
        return fqn in self.converted and fqn not in self.keep_bf16

    def lines(self) -> list[str]:
        """The advice in words, for ``str(recommendation)``."""
        out = [f"  fp8 casts: {len(self.converted)} layers converted; keep in bf16: "
               + (", ".join(self.keep_bf16) if self.keep_bf16 else "none")
               + f" (underflow limit {self.underflow_limit:.0%})"]
        out += [f"        {module}: {why}" for module, why in self.keep_bf16.items()]
        if self.nonfinite_in_bf16_too:
            out.append("        non-finite in fp8 and in the bf16 trial too (not fp8's doing): "
                       + ", ".join(self.nonfinite_in_bf16_too))
        worst = max((c for c in self.casts if c.underflow), key=lambda c: c.underflow or 0.0, default=None)
        if worst is not None and worst.module not in self.keep_bf16:
            out.append(f"        largest underflow kept in fp8: {worst.module} {worst.role} {worst.underflow:.2%} "
                       f"({worst.dtype})")
        if self.loss_vs_bf16 is not None or self.time_vs_bf16 is not None:
            loss = f"loss {self.loss_vs_bf16:+.4g} vs bf16" if self.loss_vs_bf16 is not None else ""
            time = f"step time {self.time_vs_bf16:.2f}x bf16's" if self.time_vs_bf16 is not None else ""
            note = ("emulated: not fp8's speed" if self.emulated else
                    "eager torchao, every cast measured each step: not compiled fp8's speed")
            out.append("        " + ", ".join(p for p in (loss, time) if p) + (f" ({note})" if time else ""))
        if self.emulated:
            out.append(f"        emulated: {self.emulated}")
        out.append(f"        saturation {SATURATION}")
        return out


@dataclasses.dataclass(frozen=True)
class Setup:
    """The fp8 trial's torchao config and filter, checked before any trial runs."""

    config: Any
    filter: Filter | None
    emulated: str | None


def _fp8_matmul(device: torch.device) -> bool:
    """Does ``device`` run fp8 matmuls (``torch._scaled_mm``): CUDA of compute capability 8.9 or newer."""
    return device.type == "cuda" and tuple(torch.cuda.get_device_capability(device)) >= (8, 9)


def setup(config: Any, module_filter: Filter | None, device: torch.device) -> Setup:
    """Import torchao (refusing a missing or untested one with the ``ampguard[fp8]`` extra) and settle the
    trial's ``Float8LinearConfig``: torchao's default when ``config`` is None, emulated where ``device`` has no
    fp8 matmul."""
    require("torchao")
    from torchao.float8 import Float8LinearConfig

    if config is None:
        config = Float8LinearConfig()
    elif not isinstance(config, Float8LinearConfig):
        raise TypeError(f"preflight fp8_config={config!r}; allowed: None (torchao's default) or a "
                        f"torchao.float8.Float8LinearConfig")
    if module_filter is not None and not callable(module_filter):
        raise TypeError(f"preflight fp8_filter={module_filter!r}; allowed: None or a function (module, fqn) -> bool, "
                        f"as convert_to_float8_training's module_filter_fn takes")
    emulated = None
    if config.emulate:
        emulated = "fp8_config has emulate=True"
    elif not _fp8_matmul(device):
        what = (f"{device} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))} < 8.9)"
                if device.type == "cuda" else f"{device}")
        emulated = (f"{what} has no fp8 matmul, so the trial ran Float8LinearConfig(emulate=True): the casts and "
                    f"their statistics are torchao's own, the step times are not fp8's")
        config = dataclasses.replace(config, emulate=True)
    return Setup(config, module_filter, emulated)


class Fp8Trial:
    """Converts the trial's fresh model; :meth:`close` reads its casts from the guard's reports (the trial's guard
    samples them on every step: ``GuardConfig(numerics_every=1)``)."""

    def __init__(self, model: torch.nn.Module, setup: Setup) -> None:
        from torchao.float8 import convert_to_float8_training

        from .fp8 import _dtype, float8_modules

        self.model = convert_to_float8_training(model, config=setup.config, module_filter_fn=setup.filter)
        layers = float8_modules(self.model)
        if not layers:
            raise ValueError("convert_to_float8_training converted no layer of model_fn()'s model (it converts "
                             "torch.nn.Linear layers that fp8_filter accepts): nothing to try in fp8")
        self.converted = tuple(name for name, _ in layers)
        self.dtypes = {(name, role): _dtype(module, role) for name, module in layers for role in FP8_ROLES}
        self.casts: tuple[Fp8CastStats, ...] = ()
        """The worst of each cast over the trial, once :meth:`close` has run."""

    def close(self, reports: Sequence[StepReport]) -> tuple[Fp8CastStats, ...]:
        """The worst of each cast over the trial's ``reports`` (each step's ``StepReport.fp8``), kept in
        :attr:`casts`."""
        steps = [(r.step, r.fp8) for r in reports if r.fp8 is not None]
        out = []
        for module, role in ((name, role) for name in self.converted for role in FP8_ROLES):
            ran = [(step, c) for step, casts in steps for c in casts if (c.module, c.role) == (module, role)]
            dtype = self.dtypes[(module, role)]
            bad = [(step, c) for step, c in ran if not c.finite]
            # a non-finite cast's own "underflow" (a zero scale zeroes every finite element) is its non-finiteness,
            # counted once, in nonfinite_steps
            underflows = [c.underflow for _, c in ran if c.finite and c.underflow is not None]
            ranges = [c.dynamic_range for _, c in ran
                      if c.finite and c.dynamic_range is not None and math.isfinite(c.dynamic_range)]
            out.append(Fp8CastStats(
                module=module, role=role, dtype=str(dtype).removeprefix("torch."), steps=len(ran),
                amax=_worst([c.amax for _, c in ran], max), scale=_worst([c.scale for _, c in ran], min),
                underflow=max(underflows) if underflows else None,
                dynamic_range=max(ranges) if ranges else None,
                format_range=format_range(dtype), nonfinite_steps=len(bad),
                first_nonfinite=_first(bad)))
        self.casts = tuple(out)
        return self.casts


def _first(bad: Sequence[tuple[int, Fp8Cast]]) -> str | None:
    return f"step {bad[0][0]}: amax {bad[0][1].amax:g} → scale {bad[0][1].scale:g}" if bad else None


def _worst(values: Sequence[float], pick: Callable[[Sequence[float]], float]) -> float:
    if not values:
        return math.nan
    return math.nan if any(math.isnan(v) for v in values) else pick(values)


def advise(casts: Sequence[Fp8CastStats], converted: Sequence[str], setup: Setup, *,
           bf16_nonfinite: bool | None = None, loss_vs_bf16: float | None = None,
           time_vs_bf16: float | None = None) -> Fp8Advice:
    """Which converted layers should stay in bf16, and why, from the trial's measured casts: a layer with a
    non-finite cast on any step (unless the bf16 trial, ``bf16_nonfinite``, went non-finite too; None: no bf16
    trial to tell), or a cast whose underflow went above :data:`FP8_UNDERFLOW_LIMIT`."""
    reasons: dict[str, list[str]] = {}
    upstream: dict[str, list[str]] = {}
    for c in casts:
        if c.nonfinite_steps:
            why = f"{c.role}: non-finite cast on {c.nonfinite_steps} of {c.steps} steps (first {c.first_nonfinite})"
            if bf16_nonfinite:
                upstream.setdefault(c.module, []).append(why)
            else:
                unknown = "" if bf16_nonfinite is False else "; no bf16 trial to tell whether bf16 goes non-finite too"
                reasons.setdefault(c.module, []).append(why + unknown)
        if c.underflow is not None and c.underflow > FP8_UNDERFLOW_LIMIT:
            wide = (f", dynamic range {c.dynamic_range:.1f} bits > {c.format_range:.1f} that {c.dtype} holds"
                    if c.dynamic_range is not None and c.dynamic_range > c.format_range else "")
            reasons.setdefault(c.module, []).append(
                f"{c.role}: {c.underflow:.1%} of its elements underflow to 0 in {c.dtype} "
                f"(> {FP8_UNDERFLOW_LIMIT:.0%}; amax {c.amax:.3g}{wide})")
    keep = {module: "; ".join(reasons[module]) for module in converted if module in reasons}
    return Fp8Advice(casts=tuple(casts), converted=tuple(converted), keep_bf16=keep,
                     nonfinite_in_bf16_too={m: "; ".join(upstream[m]) for m in converted if m in upstream},
                     underflow_limit=FP8_UNDERFLOW_LIMIT, emulated=setup.emulated,
                     loss_vs_bf16=loss_vs_bf16, time_vs_bf16=time_vs_bf16)
