"""One event record, read field by field: every value checked and converted to the type the
records hold (:class:`~ampguard.StepReport`, :class:`~ampguard.Anomaly`), or the record refused
with :class:`BadRecord` naming the field. The reader skips a refused record with a warning, so a
damaged line costs that record, never the log (and never a traceback).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ..records import Fp8Cast, StepReport
from ..vocab import AnomalyKind, Cause, Phase, SkipReason

__all__ = ["MAX_DEPTH", "MAX_RANK", "BadRecord", "anomaly_fields", "parse_line", "rank_of", "run_info", "step_report"]

MAX_RANK = 1 << 20
"""Ranks and world sizes beyond this are damage, not a run (and would cost memory to list)."""
MAX_COUNT = (1 << 63) - 1
MAX_DEPTH = 16
"""Nesting deeper than this is no ampguard record (the deepest, an anomaly's report, is 3)."""

_NONFINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf,
              "infinity": math.inf, "+infinity": math.inf, "-infinity": -math.inf}
_E = TypeVar("_E", bound=enum.Enum)


class BadRecord(ValueError):
    """A record that lacks or mangles a field."""


# ---------------------------------------------------------------------------------- lines
def parse_line(line: str) -> dict[str, Any] | None:
    """The event record on ``line``, or None when it holds none (not JSON, too deep, no ``event``)."""
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: e.g. a 100k-deep array
        return None
    if not (isinstance(rec, dict) and isinstance(rec.get("event"), str)) or _deeper_than(rec, MAX_DEPTH):
        return None
    return rec


def _deeper_than(value: Any, limit: int) -> bool:
    level: list[Any] = [value]
    for _ in range(limit + 1):
        nxt = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (dict, list))]
        if not nxt:
            return False
        level = nxt
    return True


# ---------------------------------------------------------------------------------- values
def _refuse(name: str, value: Any, expected: str) -> BadRecord:
    return BadRecord(f"{name!r} is {json.dumps(value, default=str)[:40]}; expected {expected}")


def integer(value: Any, name: str, low: int = 0, high: int = MAX_COUNT) -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _refuse(name, value, f"an int in {low}..{high}")
    return value


def real(value: Any, name: str) -> float:
    if isinstance(value, str) and value.lower() in _NONFINITE:
        return _NONFINITE[value.lower()]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(name, value, 'a number, or "nan"/"inf"/"-inf"')
    try:
        return float(value)
    except OverflowError:  # an integer beyond float's range
        raise _refuse(name, value, "a number in float range") from None


def _finite(value: Any, name: str) -> float:
    v = real(value, name)
    if not math.isfinite(v):
        raise _refuse(name, value, "a finite number")
    return v


def flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise _refuse(name, value, "true or false")


def text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _refuse(name, value, "a string")
    return value


def word(vocab: type[_E], value: Any, name: str) -> _E:
    """A member of ``vocab``; a word it does not know (a log written by another ampguard version)
    is kept as logged, as a plain string, rather than refused."""
    value = text(value, name)
    try:
        return vocab(value)
    except ValueError:
        return cast(_E, value)


def _items(value: Any, name: str, convert: Callable[[Any, str], Any]) -> tuple[Any, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _refuse(name, value, "a list")
    return tuple(convert(v, name) for v in value)


def _optional(convert: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, name: None if value is None else convert(value, name)


def _ranks(value: Any, name: str) -> tuple[int, ...]:
    return _items(value, name, lambda v, n: integer(v, n, 0, MAX_RANK))


def _reals(value: Any, name: str) -> tuple[float, ...]:
    return _items(value, name, real)


def _named_reals(value: Any, name: str) -> tuple[tuple[str, float], ...]:
    """``[[name, value], ...]`` (per-module indicators) as a tuple of pairs."""
    def pair(v: Any, n: str) -> tuple[str, float]:
        if not (isinstance(v, list) and len(v) == 2):
            raise _refuse(n, v, "a [name, number] pair")
        return text(v[0], n), real(v[1], n)
    return _items(value, name, pair)


def _fp8_cast(value: Any, name: str) -> Fp8Cast:
    """One logged fp8 cast (``Fp8Cast.to_dict()``)."""
    if not isinstance(value, dict):
        raise _refuse(name, value, "an object")
    opt = _optional(real)
    return Fp8Cast(module=text(value.get("module"), name), role=text(value.get("role"), name),
                   amax=real(value.get("amax"), name), scale=real(value.get("scale"), name),
                   underflow=opt(value.get("underflow"), name), saturation=opt(value.get("saturation"), name),
                   dynamic_range=opt(value.get("dynamic_range"), name))


def _reason(value: Any, name: str) -> SkipReason:
    return word(SkipReason, value, name)


#: How each StepReport field is read, by its annotation (a new field with a new annotation fails
#: the import, and so the tests, until it is given a reader here).
_BY_TYPE: dict[str, Callable[[Any, str], Any]] = {
    "int": integer,
    "float": real,
    "float | None": _optional(real),
    "bool": flag,
    "int | None": _optional(integer),
    "SkipReason | None": _optional(_reason),
    "tuple[int, ...]": _ranks,
    "tuple[float, ...] | None": _optional(_reals),
    "tuple[tuple[str, float], ...] | None": _optional(_named_reals),
    "tuple[Fp8Cast, ...] | None": _optional(lambda v, n: _items(v, n, _fp8_cast)),
}
_STEP_READERS: dict[str, Callable[[Any, str], Any]] = {
    f.name: _BY_TYPE[str(f.type)] for f in dataclasses.fields(StepReport)
}


# ---------------------------------------------------------------------------------- records
def rank_of(rec: dict[str, Any]) -> int:
    return integer(rec.get("rank", 0), "rank", 0, MAX_RANK)


def step_report(rec: dict[str, Any]) -> StepReport:
    """The :class:`StepReport` a ``step``/``skipped`` record (or an anomaly's ``report``) holds."""
    if not isinstance(rec, dict):
        raise _refuse("report", rec, "an object")
    if "step" not in rec:
        raise BadRecord("no 'step'")
    kw = {k: read(rec[k], k) for k, read in _STEP_READERS.items() if k in rec}
    kw.setdefault("skipped", False)
    kw.setdefault("reason", None)
    for name in ("loss", "loss_scale", "grad_norm"):
        kw.setdefault(name, math.nan)
    kw.setdefault("next_loss_scale", kw["loss_scale"])
    kw.setdefault("nonfinite_grads", 0)
    kw.setdefault("nonfinite_loss", kw["loss"] is not None and not math.isfinite(kw["loss"]))
    return StepReport(**kw)


def anomaly_fields(rec: dict[str, Any]) -> dict[str, Any]:
    """An ``anomaly`` record's fields, read (the :class:`~ampguard.runlog.LoggedAnomaly` ones but
    ``logged_by``)."""
    for required in ("step", "kind"):
        if required not in rec:
            raise BadRecord(f"no {required!r}")
    get = rec.get
    return {
        "step": integer(get("step"), "step"),
        "kind": word(AnomalyKind, get("kind"), "kind"),
        "detail": text(get("detail", ""), "detail"),
        "ranks": _ranks(get("ranks"), "ranks"),
        "params": _items(get("params"), "params", text),
        "module": _optional(text)(get("module"), "module") or None,  # "" means "not localised"
        "phase": _optional(lambda v, n: word(Phase, v, n))(get("phase"), "phase"),
        "cause": _optional(lambda v, n: word(Cause, v, n))(get("cause"), "cause"),
        "reason": _optional(_reason)(get("reason"), "reason"),
    }


def run_info(rec: dict[str, Any], problems: list[str], where: str) -> dict[str, Any]:
    """A ``run`` record, with each field that is not what ampguard writes dropped (and said so):
    the record still marks where its run starts."""
    checks: dict[str, Callable[[Any, str], Any]] = {
        "rank": lambda v, n: integer(v, n, 0, MAX_RANK),
        "local_rank": lambda v, n: integer(v, n, 0, MAX_RANK),
        "world_size": lambda v, n: integer(v, n, 1, MAX_RANK),
        "time": _finite,
        "run_id": text,
    }
    info = dict(rec)
    for name, check in checks.items():
        if name in info:
            try:
                info[name] = check(info[name], name)
            except BadRecord as e:
                problems.append(f"{where}: the 'run' record's {e}; ignored that field")
                del info[name]
    return info
