"""The two executions of the step's rules: on tensors, and on host floats.

The decision rule (:func:`ampguard.policies.decide`) and the scale rule
(:func:`ampguard.scale_rule.next_scale`) are each written once, over a small namespace of
operations ``o``: arithmetic (``add``, ``sub``, ``mul``, ``div``, ``recip``), ``where``,
``clamp``, ``isfinite``, ``not_`` and a few more, plus how the carried state is read and stored.

- :class:`TensorOps`: each operation is torch's, on device tensors: no host sync; on CUDA the
  whole rule is captured once as a CUDA graph (``pipeline.DecisionGraph``).
- :class:`HostOps` (:data:`HOST`): the same operations on host values (Python floats holding
  float32 values, ints, bools), each float32 operation rounded once (:func:`f32`) with the
  operands torch uses, so both give the same bits. This is the CPU path, where reading a tensor
  costs nothing and each tiny tensor op costs microseconds.

Rules of the namespace (what keeps the two executions equal):

- a Python scalar that meets a float32 value is rounded to float32 first, as torch does: the rules
  pass constants (``clamp``'s bounds too) through :func:`f32`;
- ``c / t`` is written ``mul(recip(t), c)``, what ``Tensor.__rtruediv__`` computes;
- ``where(c, a, b)`` evaluates both branches on both executions (torch must), and host values that
  are not taken are discarded; inside ``if o.may(c):`` every result is taken only through
  ``where(c, ...)``, so the host may skip the block when ``c`` is false;
- a carried tensor is read with ``o.value(t)`` (on the host: ``.item()``) and written with
  ``o.store(t, new, old)`` after the last use of ``old`` (on tensors ``old`` is ``t`` itself; on the
  host nothing is written when ``new`` is ``old``, passed through a ``where``).
"""

from __future__ import annotations

import math
import operator
import struct
from typing import Any, NamedTuple, Protocol

import torch

__all__ = ["HOST", "DeviceConstants", "HostOps", "Ops", "TensorOps", "capturing", "device_constants", "f32"]

Value = Any
"""A value of a rule: a tensor (:class:`TensorOps`), or a host float, int or bool (:class:`HostOps`)."""

_F32 = struct.Struct("f")
_pack, _unpack = _F32.pack, _F32.unpack


def f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest, ties to even; overflow to inf; NaN stays NaN), as a
    Python float. One float32 operation is the exact result of its float32 operands rounded
    once (53 >= 2*24 + 2 bits: computing it in double first does not change the rounding)."""
    return _unpack(_pack(x))[0]  # type: ignore[no-any-return]


def _clamp(x: float, lo: float | None, hi: float | None) -> float:
    """``torch.clamp`` of a float32 value with float32 bounds: ``min`` is applied before ``max``,
    NaN propagates (both comparisons are false)."""
    if lo is not None and x < lo:
        x = lo
    if hi is not None and x > hi:
        x = hi
    return x


def _div(a: float, b: float) -> float:
    """float32 ``a / b`` of float32 values, as torch divides (IEEE: x/0 is +-inf, 0/0 NaN)."""
    if b == 0:
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1.0, b)
    return _unpack(_pack(a / b))[0]  # type: ignore[no-any-return]



class Ops(Protocol):
    """What a rule takes as ``o``: :class:`TensorOps` or :class:`HostOps`. ``Value``: a tensor, or
    a host float32 value / int / bool."""

    @property
    def false(self) -> Value: ...
    @property
    def one(self) -> Value: ...
    @property
    def nan(self) -> Value: ...
    @property
    def inf(self) -> Value: ...
    def add(self, a: Value, b: Value, /) -> Value: ...
    def sub(self, a: Value, b: Value, /) -> Value: ...
    def mul(self, a: Value, b: Value, /) -> Value: ...
    def div(self, a: Value, b: Value, /) -> Value: ...
    def recip(self, x: Value, /) -> Value: ...
    def to_float(self, n: Value, /) -> Value: ...
    def clamp(self, x: Value, lo: float | None, hi: float | None, /) -> Value: ...
    def imin(self, x: Value, k: int, /) -> Value: ...
    def isfinite(self, x: Value, /) -> Value: ...
    def nonfinite(self, x: Value, /) -> Value:
        """``not isfinite(x)``."""
    def positive(self, cmax: Any, cols: tuple[int, ...], /) -> list[Value]:
        """``[cmax[c] > 0 for c in cols]``: columns of :meth:`columns`' maximum as flags (on tensors: one
        comparison of every column, read by column)."""
    def isnan(self, x: Value, /) -> Value: ...
    def not_(self, x: Value, /) -> Value: ...
    def floor(self, x: Value, /) -> Value: ...
    def exp2(self, x: Value, /) -> Value: ...
    def where(self, c: Value, a: Value, b: Value, /) -> Value: ...
    def may(self, c: Value, /) -> bool: ...
    def first(self, cases: list[tuple[Value, Value]], default: Value, /) -> Value:
        """The value of the first true condition (``default`` if none): nested ``where``."""
    def zeros_like(self, x: Value, /) -> Value: ...
    def value(self, t: torch.Tensor, /) -> Value: ...
    def store(self, t: torch.Tensor, value: Value, old: Value, /) -> None: ...
    def sqrt_of(self, t: torch.Tensor, /) -> Value: ...
    def columns(self, g: torch.Tensor, /) -> tuple[Any, Any]: ...
    def rank_min(self, g: torch.Tensor, col: int, cmax: Any, /) -> Value: ...
    def norm(self, x: torch.Tensor, /) -> Value: ...
    def vector(self, values: list[Any], flags: list[Any], tail: list[Any], /) -> Any: ...


class HostOps:
    """The rules' operations on host values, float32 emulated (see the module docstring)."""

    false = False
    one = 1.0
    nan = math.nan
    inf = math.inf

    # f32 written out in the arithmetic: a call less per operation on the host path
    @staticmethod
    def add(a: float, b: float) -> float:
        return _unpack(_pack(a + b))[0]  # type: ignore[no-any-return]

    @staticmethod
    def sub(a: float, b: float) -> float:
        return _unpack(_pack(a - b))[0]  # type: ignore[no-any-return]

    @staticmethod
    def mul(a: float, b: float) -> float:
        return _unpack(_pack(a * b))[0]  # type: ignore[no-any-return]

    div = staticmethod(_div)

    @staticmethod
    def recip(x: float) -> float:
        """``torch.reciprocal`` (1/0 is inf, not an exception)."""
        return _unpack(_pack(1.0 / x))[0] if x != 0 else math.copysign(math.inf, x)  # type: ignore[no-any-return]

    @staticmethod
    def to_float(n: int) -> float:
        return f32(float(n))

    clamp = staticmethod(_clamp)
    imin = staticmethod(min)
    isfinite = staticmethod(math.isfinite)
    isnan = staticmethod(math.isnan)
    not_ = staticmethod(operator.not_)

    @staticmethod
    def nonfinite(x: float) -> bool:
        return not math.isfinite(x)

    @staticmethod
    def positive(cmax: list[float], cols: tuple[int, ...]) -> list[bool]:
        return [cmax[c] > 0 for c in cols]

    @staticmethod
    def floor(x: float) -> float:
        return float(math.floor(x)) if math.isfinite(x) else x

    @staticmethod
    def exp2(x: float) -> float:
        """``torch.exp2`` of a float32 integer value (the rules use it so: exact)."""
        return f32(2.0**x) if x < 128 else math.inf

    @staticmethod
    def where(c: bool, a: Value, b: Value) -> Value:
        return a if c else b

    @staticmethod
    def may(c: bool) -> bool:
        return bool(c)

    @staticmethod
    def first(cases: list[tuple[bool, Value]], default: Value) -> Value:
        for c, v in cases:
            if c:
                return v
        return default

    @staticmethod
    def zeros_like(x: int) -> int:
        return 0

    value = staticmethod(torch.Tensor.item)
    """A carried 0-d tensor's value (or the scaler's 1-element scale): ``.item()``, free on the CPU."""

    @staticmethod
    def store(t: torch.Tensor, value: Value, old: Value) -> None:
        if value is not old:  # the value read, passed through: nothing to write
            t.fill_(value)

    @staticmethod
    def sqrt_of(t: torch.Tensor) -> float:
        """``torch.sqrt`` of a carried float32 tensor: torch's own kernel, not ``math.sqrt`` (on
        CPU it is not always correctly rounded: 1 ulp off on about 1 value in 6, torch 2.13)."""
        return float(torch.sqrt(t).item())

    @staticmethod
    def columns(g: torch.Tensor) -> tuple[list[float], list[float]]:
        """The gathered matrix's maximum and sum over ranks (torch's reductions: its summation order)."""
        if g.shape[0] > 1:
            return g.amax(0).tolist(), g.sum(0).tolist()
        row = g.tolist()[0]
        return row, row

    @staticmethod
    def rank_min(g: torch.Tensor, col: int, cmax: list[float]) -> float:
        return g[:, col].amin(0).item() if g.shape[0] > 1 else cmax[col]

    @staticmethod
    def norm(x: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(x, 2.0).item())

    @staticmethod
    def vector(values: list[float], flags: list[bool], tail: list[float]) -> list[float]:
        return values + [1.0 if f else 0.0 for f in flags] + tail


HOST = HostOps()
"""The host execution (stateless: one for the process)."""
HOST.__dict__.update({name: getattr(HostOps, name) for name, v in vars(HostOps).items() if isinstance(v, staticmethod)})
# (each op an attribute of the instance: one dict lookup per op on the host path, not a descriptor call)


class DeviceConstants(NamedTuple):
    """The 0-d constants the device executions read (:class:`TensorOps`, the local vector's device pack in
    :mod:`ampguard.stats`): float32 except ``false``."""

    zero: torch.Tensor
    one: torch.Tensor
    nan: torch.Tensor
    minus_one: torch.Tensor
    inf: torch.Tensor
    false: torch.Tensor


_CONSTANTS: dict[torch.device, DeviceConstants] = {}
"""Per device, made once (:func:`device_constants`). Process-wide, and safe so: a few bytes a device, never written."""


def device_constants(device: torch.device) -> DeviceConstants:
    """``device``'s constants, made once per process and device: fills a step fewer on the device path (on CUDA each
    fill is a kernel of every step's graph). Never written: the rules and the local vector only read them (every
    value they return or store is a new tensor or a copy), so every step on the device shares them, and a captured
    graph reads them where they lie. Kept only when made outside a CUDA graph capture (a fill recorded in a capture
    runs only in that graph's replays): the step graph and the decision's graph are captured after an eager first
    run, which makes them; a capture that finds none makes its own, kept with that graph, not here. Nor when made
    inside a ``torch.compile`` trace (the fused rule's first step, ``AMPGUARD_FUSED_RULE``): they are then constants
    of the compiled code, and the capture check is not asked there (dynamo cannot trace a query that returns a bool:
    on an H100 (stop 65) the first guard of a process failed its compile so, warned, and took the rule op by op)."""
    c = _CONSTANTS.get(device)
    if c is None:
        def full(v: float) -> torch.Tensor:
            return torch.full((), v, dtype=torch.float32, device=device)

        c = DeviceConstants(full(0.0), full(1.0), full(math.nan), full(-1.0), full(math.inf),
                            torch.zeros((), dtype=torch.bool, device=device))
        if not torch.compiler.is_compiling() and not capturing(device):
            _CONSTANTS[device] = c
    return c


def capturing(device: torch.device) -> bool:
    """Is ``device``'s current stream capturing a CUDA graph? Outside a ``torch.compile`` trace only (a bool query)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class TensorOps:
    """The rules' operations on tensors of one device: torch's own ops, no host sync.

    On CUDA each op is a kernel (one node of the captured step graph, ~1-2 us of device time each: stop 44's profile
    of a compiled fp8 step put the decision's ~60 small kernels beside the norms), so the ops are written for few:
    the constants (:attr:`false`, :attr:`one`, :attr:`nan`, :attr:`inf`) are made once per device
    (:func:`device_constants`), and
    ``isfinite``/``nonfinite`` are one subtraction and one comparison, where ``torch.isfinite`` is four kernels
    (``(x == x) * (x.abs() != inf)``): ``x - x`` is exactly 0 for every finite ``x`` and NaN for an infinite or NaN
    one (IEEE 754), so ``(x - x) == 0`` is ``isfinite(x)``, bit for bit."""

    add = staticmethod(operator.add)
    sub = staticmethod(operator.sub)
    mul = staticmethod(operator.mul)
    div = staticmethod(operator.truediv)
    isnan = staticmethod(torch.isnan)
    not_ = staticmethod(operator.invert)
    floor = staticmethod(torch.floor)
    exp2 = staticmethod(torch.exp2)
    zeros_like = staticmethod(torch.zeros_like)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        c = device_constants(device)
        self.false, self.one, self.nan, self.inf = c.false, c.one, c.nan, c.inf

    def recip(self, x: torch.Tensor) -> torch.Tensor:
        """``1 / x`` as a division of the constant one: bit for bit ``torch.reciprocal`` (both IEEE division rounded to
        nearest, eagerly), where inductor, compiling the fused rule (``AMPGUARD_FUSED_RULE``), lowers
        ``torch.reciprocal`` to an approximate division even with its division rounding on (torch 2.11 on an H100:
        7 of 360 random decisions' clip coefficients 1 ulp off, ``benchmarks/results/gpu_stop62/fused_rule.txt``)."""
        return torch.div(self.one, x)

    @staticmethod
    def isfinite(x: torch.Tensor) -> torch.Tensor:
        return (x - x) == 0  # the class docstring: torch.isfinite's value by two kernels, not four

    @staticmethod
    def nonfinite(x: torch.Tensor) -> torch.Tensor:
        return (x - x) != 0

    @staticmethod
    def positive(cmax: torch.Tensor, cols: tuple[int, ...]) -> list[torch.Tensor]:
        flags = cmax > 0  # one kernel; each column's flag a view of it
        return [flags[c] for c in cols]

    @staticmethod
    def to_float(n: torch.Tensor) -> torch.Tensor:
        return n.float()

    @staticmethod
    def where(c: torch.Tensor, a: Value, b: Value) -> torch.Tensor:
        return torch.where(c, a, b)

    @staticmethod
    def clamp(x: torch.Tensor, lo: float | None, hi: float | None) -> torch.Tensor:
        return torch.clamp(x, min=lo, max=hi)

    @staticmethod
    def first(cases: list[tuple[torch.Tensor, Value]], default: Value) -> torch.Tensor:
        out: Any = default
        for c, v in reversed(cases):
            out = torch.where(c, v, out)
        return out  # type: ignore[no-any-return]

    @staticmethod
    def imin(x: torch.Tensor, k: int) -> torch.Tensor:
        return torch.clamp(x, max=k)

    @staticmethod
    def may(c: torch.Tensor) -> bool:
        return True  # the device decides; the host never looks

    @staticmethod
    def value(t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def store(t: torch.Tensor, value: torch.Tensor, old: torch.Tensor) -> None:
        t.copy_(value)

    sqrt_of = staticmethod(torch.sqrt)

    @staticmethod
    def columns(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # NaN propagates through amax: a NaN norm on any rank is NaN here
        return (g.amax(0), g.sum(0)) if g.shape[0] > 1 else (g[0], g[0])

    @staticmethod
    def rank_min(g: torch.Tensor, col: int, cmax: torch.Tensor) -> torch.Tensor:
        return g[:, col].amin(0) if g.shape[0] > 1 else g[0, col]

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(x, 2.0)

    @staticmethod
    def vector(values: list[torch.Tensor], flags: list[torch.Tensor], tail: list[torch.Tensor]) -> torch.Tensor:
        # the values and the tail in one stack, cut around the flags by the cat: four kernels where a stack each
        # made five (stop 58)
        n = len(values)
        floats = torch.stack([v.reshape(()) for v in values + tail]).float()
        return torch.cat([floats[:n], torch.stack(flags).float(), floats[n:]])
