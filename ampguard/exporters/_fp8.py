"""StepReport.fp8 turned into bounded series, once per step, for every exporter.

A model can hold hundreds of ``Float8Linear`` modules (3 casts each); a metrics backend must not get a
series per module. :func:`fp8_series` keeps the first ``max_modules`` module names seen (the model's
order; :data:`ampguard.metrics.FP8_MODULES` by default) and folds every other module into
``module="_other"``: the largest amax, the smallest scale, the largest underflow ratio and dynamic
range, and the sum of non-finite casts of the folded modules, per role. So a rank exports at most
``(max_modules + 1) * 3`` series per fp8 metric.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

from .. import metrics as M
from ..metrics import FP8_MODULES, FP8_OTHER
from ..records import Fp8Cast

__all__ = ["Fp8Series", "fp8_log_casts", "fp8_scalars", "fp8_series"]


@dataclasses.dataclass(slots=True)
class Fp8Series:
    """One (module, role) series of one step: the cast's values, or the fold of several casts."""

    module: str
    role: str
    amax: float
    scale: float
    underflow: float | None
    dynamic_range: float | None
    nonfinite: int

    def values(self) -> list[tuple[M.Metric, float]]:
        """(catalogue entry, value) of this series: amax, scale, the non-finite casts (a counter's increment),
        and the underflow ratio and dynamic range on sampled steps only (a gauge keeps its last sample)."""
        out: list[tuple[M.Metric, float]] = [(M.FP8_AMAX, self.amax), (M.FP8_SCALE, self.scale),
                                             (M.FP8_NONFINITE, float(self.nonfinite))]
        if self.underflow is not None:
            out.append((M.FP8_UNDERFLOW, self.underflow))
        if self.dynamic_range is not None:
            out.append((M.FP8_DYNAMIC_RANGE, self.dynamic_range))
        return out

    def fold(self, cast: Fp8Cast) -> None:
        self.amax = _worst(self.amax, cast.amax, max)
        self.scale = _worst(self.scale, cast.scale, min)
        self.underflow = _opt(self.underflow, cast.underflow)
        self.dynamic_range = _opt(self.dynamic_range, cast.dynamic_range)
        self.nonfinite += 0 if cast.finite else 1


def _worst(a: float, b: float, pick: Callable[[float, float], float]) -> float:
    if math.isnan(a) or math.isnan(b):  # a NaN is never hidden by folding
        return math.nan
    return float(pick(a, b))


def _opt(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return b if a is None else a
    return _worst(a, b, max)


def fp8_series(casts: Iterable[Fp8Cast] | None, known: list[str], max_modules: int = FP8_MODULES) -> list[Fp8Series]:
    """The bounded series of one step's casts. ``known`` is the exporter's list of module names given a
    series of their own so far (updated in place: a name is added while fewer than ``max_modules`` are
    known, so a module keeps its series for the run). Every other module folds into :data:`FP8_OTHER`."""
    out: dict[tuple[str, str], Fp8Series] = {}
    for cast in casts or ():
        module = cast.module
        if module not in known:
            if len(known) < max_modules:
                known.append(module)
            else:
                module = FP8_OTHER
        key = (module, cast.role)
        series = out.get(key)
        if series is None:
            out[key] = Fp8Series(module, cast.role, cast.amax, cast.scale, cast.underflow, cast.dynamic_range,
                                 0 if cast.finite else 1)
        else:
            series.fold(cast)
    return list(out.values())


def fp8_scalars(casts: Iterable[Fp8Cast] | None, prefix: str = "ampguard/") -> dict[str, float]:
    """One step's casts as run-tracker scalars, ``<prefix>fp8/<module>/<role>/<what>`` (``amax``, ``scale``,
    ``nonfinite``: the non-finite casts of the step; ``underflow_ratio`` and ``dynamic_range_log2`` on
    sampled steps), bounded as the metrics: the first :data:`~ampguard.metrics.FP8_MODULES` modules of the
    step (the model's order, the same every step) by name, the rest in ``_other``."""
    out: dict[str, float] = {}
    for series in fp8_series(casts, []):
        for metric, value in series.values():
            what = metric.name.removeprefix(M.PREFIX + "fp8_").removesuffix("_total")
            out[f"{prefix}fp8/{series.module}/{series.role}/{what}"] = value
    return out


def fp8_log_casts(casts: tuple[Fp8Cast, ...] | None) -> tuple[Fp8Cast, ...] | None:
    """The casts a healthy step's JSONL record holds: every cast on a sampled step (one with an underflow
    ratio) or one with a non-finite cast; otherwise the bounded fold (at most ``(FP8_MODULES + 1) * 3``
    casts, the rest in ``_other``): a healthy step of 672 casts costs ~2 ms (8 KB) on the writer thread, not
    ~10 ms (100 KB)."""
    if not casts or any(c.underflow is not None or not c.finite for c in casts):
        return casts
    series = fp8_series(casts, [])
    if len(series) == len(casts):
        return casts
    return tuple(Fp8Cast(s.module, s.role, s.amax, s.scale) for s in series)
