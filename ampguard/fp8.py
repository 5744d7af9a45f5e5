"""Per-layer statistics of torchao float8 casts, measured on device.

:class:`Fp8Monitor` puts a forward pre-hook (input and weight, as the layer is about to cast them: under FSDP2 the
weight is whole then) and a forward hook on each torchao ``Float8Linear`` of a model; the grad_output cast comes
through the taps below in eager mode, or from the forward hook a gradient hook on the layer's output where the taps
cannot tell the layer (no module backward hook, which would wrap every input and output; inside ``torch.compile``,
where a gradient hook would break the graph, a probe: :class:`_GradProbe`), and
measures, per role (``input``, ``weight``, ``grad_output``, :data:`FP8_ROLES`):

- ``amax``: ``torch.linalg.vector_norm(x, ord=inf)`` of the high-precision tensor the layer casts (with rowwise
  scaling the largest over rows); inside ``torch.compile``, the same value from the ops torchao runs on it
  (``_torchao_reduction``), which AOTAutograd's common-subexpression elimination merges with torchao's own;
- ``scale``: torchao's dynamic scale for the layer's config, ``finfo(fp8).max / clamp(amax, min=1e-12)`` in
  float64 rounded to float32 (and down to a power of 2 where the config says so); rowwise: the smallest over rows;
- on sampled steps (every ``numerics_every``-th): the underflow fraction (elements non-zero in high precision and
  zero after the cast, as Transformer Engine defines it) and the dynamic range ``log2(amax / min nonzero |x|)``,
  both on a row sample of at most :data:`SAMPLE_ELEMENTS` elements of a larger tensor (every k-th row, cast with
  its own scale: an estimate); the amax and the scale of a sampled step stay over the whole tensor.

Saturation is None: torchao 0.18 scales float8 training dynamically only (the scale comes from this tensor's own
amax, so nothing is clamped); there is no static or delayed scale that could saturate.

In eager mode the amax is torchao's own: the monitor's hooks open a *visit* (this module, the roles it wants) and two
taps, put on ``torchao.float8.float8_linear.hp_tensor_to_float8_dynamic`` (which names the role) and
``torchao.float8.float8_utils.tensor_to_amax`` (which computes the amax) while a monitor exists and taken off when the
last one closes, hand the monitor the amax tensor torchao has just reduced (:class:`_Taps`), kept in its dtype until
collect() converts them all. A grad_output cast is told by the layer's own ``linear_mm_config`` (one object per
``Float8Linear``, which torchao's backward passes to the cast), so no gradient hook is registered in eager mode: one
on each layer's output cost ~17-24 us a layer on this CPU (``benchmarks/results/cpu_stop50/``). Measuring the amax
again cost a second read of every cast tensor: 144 ``AbsMax`` reductions, 3.5 ms a step on GPT-2 124M fp8 on an
H100 (``benchmarks/RESULTS.md``, "Stop 48"). On a sampled step the taps hand over the cast's scale too: a
tensorwise cast's row sample is copied into one buffer the step's casts share (one kernel a cast,
:class:`_Batched`) and collect() measures them all together; a rowwise cast's statistics take 7
kernels on its sample (:class:`_Sampled`), finished with the others in collect(). Where a tensor is not cast there
(an input already in fp8, a DTensor, FSDP2's float8 all-gather of the weight) the hook measures it with
:func:`cast_stats`, as before.

Everything stays on device (no ``.item()``, no host sync); :meth:`Fp8Monitor.collect` returns one float32 tensor
and :meth:`Fp8Monitor.decode` turns its host copy into :class:`~ampguard.records.Fp8Cast` records. The hooks read
the tensors and never write them: a monitored run is bitwise the unmonitored one. torchao is imported only here,
and only when a monitor is made (its version checked against ``ampguard._versions.TESTED``).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._versions import require
from .module_hooks import Hook
from .records import FP8_ROLES, Fp8Cast
from .stats import local_tensor

__all__ = ["SAMPLE_ELEMENTS", "WIDTH", "Fp8Monitor", "float8_modules", "is_float8_linear", "layer_cast_stats"]

_EPS = 1e-12  # torchao.float8.float8_utils.EPS
WIDTH = 5
"""Floats per cast in :meth:`Fp8Monitor.collect`: order (k >= 1: the k-th cast measured this step; NaN: did not run),
amax, scale, underflow, dynamic range."""


def float8_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The torchao ``Float8Linear`` modules of ``model``, by qualified name (empty without torchao's float8)."""
    return [(name, m) for name, m in model.named_modules() if is_float8_linear(m)]


def is_float8_linear(module: torch.nn.Module) -> bool:
    """``module`` is a torchao ``Float8Linear`` (never imports torchao for a model that cannot hold one)."""
    import sys

    if "torchao.float8" not in sys.modules:
        return False
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def _cast_config(module: Any, role: str) -> Any:
    return getattr(module.config, f"cast_config_{role}")


def _dtype(module: Any, role: str) -> torch.dtype:
    from torchao.float8.config import e4m3_dtype

    dtype = _cast_config(module, role).target_dtype
    return dtype if dtype is not None else e4m3_dtype


def _pow2(module: Any) -> bool:
    return bool(module.config.round_scales_to_power_of_2)


def _rowwise(module: Any, role: str) -> bool:
    from torchao.float8.config import ScalingGranularity

    return _cast_config(module, role).scaling_granularity is ScalingGranularity.AXISWISE


def _scale(amax: torch.Tensor, fmax: float | torch.Tensor, pow2: bool | torch.Tensor) -> torch.Tensor:
    """torchao's dynamic scale from float32 amaxes: ``fmax / clamp(amax, min=1e-12)`` in float64, then float32, rounded
    down to a power of 2 where ``pow2`` (a bool, or a bool mask over the amaxes) says so."""
    scale = (fmax / torch.clamp(amax.double(), min=_EPS)).float()
    if isinstance(pow2, torch.Tensor):
        return torch.where(pow2, torch.exp2(torch.floor(torch.log2(scale))), scale)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def _torchao_reduction(x: torch.Tensor, role: str, *, rowwise: bool, dim: int = -1) -> torch.Tensor:
    """torchao 0.18's ``tensor_to_amax`` of the ``role`` tensor ``x`` (the input already in the autocast dtype) as
    ``Float8Linear`` runs it, with the same aten ops on the same tensor: ``torch.max(torch.abs(x))`` (0-dim); rowwise
    ``torch.amax(torch.abs(x), dim, keepdim=True)``. The weight is cast as ``self.weight.t()``, rowwise reduced over
    dim 0 (``[1, out]``); the input as it comes, over dim -1 (``[..., 1]``); grad_output as ``reshape(-1, n)``, over
    ``dim`` (-1 for grad_input's cast, 0 for grad_weight's: :func:`_grad_output_reduction`). In ``x``'s dtype.
    Under ``torch.compile``, AOTAutograd's common-subexpression elimination (``torch._functorch.config.cse``)
    merges these ops with torchao's, so they cost no second read of ``x`` (tests/unit/test_fp8_compile_cse.py);
    eagerly they are a second reduction, and an ``abs`` copy of ``x``."""
    if role == "weight":
        x, dim = x.t(), 0
    elif role == "grad_output":
        x = x.reshape(-1, x.shape[-1])
    else:
        dim = -1
    return torch.amax(torch.abs(x), dim=dim, keepdim=True) if rowwise else torch.max(torch.abs(x))


def _torchao_amax(x: torch.Tensor, role: str, *, rowwise: bool, dim: int = -1) -> torch.Tensor:
    """The amax of :func:`_torchao_reduction`, after ``amax_to_scale``'s ``amax.to(torch.float64)`` (torchao's next op,
    merged too): a 0-dim float64 tensor holding a float32 value, bitwise ``vector_norm(x, inf, dtype=float32)``.
    Rowwise, the largest row amax is one more reduction, over one value a row.

    Never torchao's reduction itself: a node whose result is a graph output is not merged (``fx_graph_cse`` keeps
    nodes that alias an output), and inductor removes a copy (a ``clone``, a float32-to-float32 ``to``) before the
    CSE runs, so the tensor returned is a conversion (tensorwise) or a reduction (rowwise) of torchao's nodes."""
    amax = _torchao_reduction(x, role, rowwise=rowwise, dim=dim).to(torch.float64)
    return amax.amax() if rowwise else amax


SAMPLE_ELEMENTS = 1 << 16
"""Elements of a cast the monitor's underflow and dynamic range are measured on (:func:`cast_stats`'s ``sample``): a
tensor of more is measured on every k-th row, the fewest k that keeps it at most this many (plus one row). The amax,
the scale and the non-finite flag are always over the whole tensor."""


def sample_rows(n_rows: int, n_cols: int, sample: int | None) -> int:
    """The row stride :func:`cast_stats` measures the underflow and the range at: 1 (every row) for a tensor of at
    most ``sample`` elements or ``sample`` None, else the fewest k with ``ceil(n_rows / k)`` rows of at most
    ``sample`` elements (one row at least)."""
    if sample is None or n_rows * n_cols <= sample:
        return 1
    keep = max(1, sample // max(n_cols, 1))
    return -(-n_rows // keep)


@torch.no_grad()
def cast_stats(x: torch.Tensor, dtype: torch.dtype, *, rowwise: bool, pow2: bool,
               row_amax: torch.Tensor | None = None, sample: int | None = None) -> torch.Tensor:
    """``[1, amax, scale, underflow, dynamic_range]`` of one cast of ``x`` to ``dtype`` by torchao's dynamic
    scaling, on ``x``'s device: a sampled step's whole statistics (:meth:`Fp8Monitor.collect` puts the cast's order
    in the first column). ``row_amax``: the amaxes of ``x``'s rows (``x.reshape(-1, n)``), float32 ``[rows, 1]``
    (tensorwise ``[1, 1]``), where the caller has them (under compile: torchao's own, merged with its reduction);
    computed here otherwise.

    ``sample`` (None: every element): the underflow and the smallest non-zero ``|x|`` of the range are measured on
    every k-th row (:func:`sample_rows`), cast with those rows' own scales, so a large tensor costs a read of at most
    ``sample`` elements more than its amax; an estimate of the whole tensor's fraction (rows are a block's tokens or
    a weight's output features). The amax, the scale and the non-finite flag stay over every row."""
    rows = x.detach().reshape(-1, x.shape[-1]) if x.dim() > 0 else x.detach().reshape(1, 1)
    if row_amax is None:  # max |x| is exact in x's own dtype: float32 accumulation changes nothing, and copies nothing
        row_amax = (torch.linalg.vector_norm(rows, ord=math.inf, dim=-1, keepdim=True, dtype=torch.float32) if rowwise
                    else torch.linalg.vector_norm(rows, ord=math.inf, dtype=torch.float32).reshape(1, 1))
    scales = _scale(row_amax, torch.finfo(dtype).max, pow2)
    amax, scale = row_amax.amax(), scales.amin()
    if rowwise:  # a NaN row: amax() propagates it; the scale of that row is NaN and amin() propagates it too
        amax = torch.where(row_amax.isnan().any(), torch.full_like(amax, math.nan), amax)
    stride = sample_rows(rows.shape[0], rows.shape[1], sample)
    if stride > 1:
        rows = rows[::stride]
        if rowwise:
            scales = scales[::stride]
    hp = rows.float()
    fmax = torch.finfo(dtype).max
    cast = (hp * scales).clamp(-fmax, fmax).to(dtype).float()
    nonzero = hp != 0
    underflow = (nonzero & (cast == 0)).sum().float() / max(hp.numel(), 1)
    smallest = torch.where(nonzero, hp.abs(), torch.full_like(hp, math.inf)).amin()
    dynamic_range = torch.log2(amax / smallest)
    return torch.stack([torch.ones_like(amax), amax, scale, underflow, dynamic_range])


def _merged_cast_stats(x: torch.Tensor, role: str, dtype: torch.dtype, *, rowwise: bool, pow2: bool,
                       sample: int | None = None) -> torch.Tensor:
    """:func:`cast_stats` with the row amaxes taken by torchao's own reduction (:func:`_torchao_reduction`), which a
    compiled graph's CSE merges with torchao's: a sampled cast inside ``torch.compile`` reads ``x`` once more, not
    twice."""
    with torch.no_grad():
        row_amax = _torchao_reduction(x, role, rowwise=rowwise).reshape(-1, 1).float()
    return cast_stats(x, dtype, rowwise=rowwise, pow2=pow2, row_amax=row_amax, sample=sample)


def layer_cast_stats(module: torch.nn.Module, role: str, x: torch.Tensor) -> torch.Tensor:
    """:func:`cast_stats` of ``x`` cast as the ``Float8Linear`` ``module`` casts it for ``role`` (its fp8 dtype,
    tensorwise or rowwise, power-of-2 scales or not)."""
    return cast_stats(x, _dtype(module, role), rowwise=_rowwise(module, role), pow2=_pow2(module))


class _Sampled:
    """A sampled cast's statistics before collect() finishes them (for all casts at once): torchao's amax (its dtype)
    and smallest scale (float32), and on the row sample ``rows`` (``n`` elements): how many non-zero elements cast to
    0 (``underflowed``: ``|x * scale|`` at most half the fp8 dtype's smallest subnormal, which the cast rounds to 0,
    ties to even) and the smallest non-zero ``|x|`` (``rows``' dtype). 7 kernels on the sample, where
    :func:`cast_stats` ran ~30 a cast: on GPT-2 124M fp8 (144 casts) a sampled step's launches were ~70 ms of an
    H100's host time (stop 49).

    The zeros are made Inf before the product, so only non-zero elements are counted, whatever the scale: counting
    the small products and subtracting the zeros (stop 49) went negative where the scale was NaN (``0 * NaN`` is no
    small product): a NaN gradient's cast read an underflow of -0.47."""

    __slots__ = ("amax", "n", "scale", "smallest", "underflowed")

    def __init__(self, amax: torch.Tensor, scale: torch.Tensor, underflowed: torch.Tensor, smallest: torch.Tensor,
                 n: int) -> None:
        self.amax, self.scale, self.underflowed, self.smallest, self.n = amax, scale, underflowed, smallest, n

    @staticmethod
    def of(rows: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, row_scales: torch.Tensor,
           dtype: torch.dtype) -> _Sampled:
        """``row_scales``: the scale of each row of ``rows`` (``[rows, 1]``), or of all (``[1]``: a dimensioned
        float32 tensor, so ``|x| * row_scales`` is float32 in one kernel, as torchao multiplies)."""
        a = rows.abs()
        a = a.masked_fill(a == 0, math.inf)  # Inf * scale is never small (Inf, or NaN for a scale of 0)
        return _Sampled(amax, scale, (a * row_scales <= _half_tiny(dtype)).sum(), a.amin(), rows.numel())

    @property
    def device(self) -> torch.device:
        return self.amax.device

    def finish(self) -> torch.Tensor:
        """``[1, amax, scale, underflow, dynamic_range]``, float32: :func:`cast_stats`' row, bitwise."""
        amax = self.amax.float()
        underflow = self.underflowed.float() / max(self.n, 1)
        return torch.stack([torch.ones_like(amax), amax, self.scale, underflow,
                            torch.log2(amax / self.smallest.float())])


class _Batched:
    """A sampled tensorwise cast whose row sample the monitor copied into its step buffer (the slot's row, ``n``
    elements; one kernel), with torchao's amax (its dtype) and scale (0-dim float32): collect() measures every such
    cast's underflow and range at once (:meth:`Fp8Monitor._collect_buffer`)."""

    __slots__ = ("amax", "n", "scale")

    def __init__(self, amax: torch.Tensor, scale: torch.Tensor, n: int) -> None:
        self.amax, self.scale, self.n = amax, scale, n

    @property
    def device(self) -> torch.device:
        return self.amax.device


def _thresholds(scale: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """Per cast, the largest float32 ``T`` with ``float32(T * scale) <= half`` (``half``: :func:`_half_tiny` of the
    cast's fp8 dtype): ``|x| <= T`` exactly where the cast of ``x`` is 0 (the product is monotone in ``|x|``). The
    bound ``half * (1 + 2**-24) / scale`` (a tie at ``half`` rounds to it: ``half`` is a power of 2, even) rounded down
    is within one float32 step of ``half / scale``: the largest of the three that passes. A scale of 0 (an infinite
    amax): every finite ``x`` casts to 0 (``T`` the largest float32; an Inf makes NaN); a NaN scale: none does
    (``T`` 0, so no non-zero ``|x|`` is at most it)."""
    t0 = half / scale
    up = torch.nextafter(t0, torch.full_like(t0, math.inf))
    down = torch.nextafter(t0, torch.zeros_like(t0))
    bound = torch.where(up * scale <= half, up, torch.where(t0 * scale <= half, t0, down))
    bound = torch.where(scale == 0, torch.finfo(torch.float32).max, bound)
    return torch.where(scale.isnan(), 0.0, bound)


def _half_tiny(dtype: torch.dtype) -> float:
    """Half the smallest subnormal of the fp8 ``dtype``: a float32 value cast to it is 0 exactly when its magnitude
    is at most this (round to nearest, ties to even: 0 is even)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


def _worst(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Two forwards' statistics of a cast in one step (gradient accumulation): the largest amax, underflow and range,
    the smallest scale."""
    return torch.stack([old[0], torch.maximum(old[1], new[1]), torch.minimum(old[2], new[2]),
                        torch.fmax(old[3], new[3]), torch.fmax(old[4], new[4])])


def _places(n: int, order: Sequence[Any], where: Sequence[tuple[int, Any]]) -> list[int]:
    """Per slot of ``n``, its place in ``cat`` of the groups of amaxes of each dtype in ``order`` (each in the order
    ``where`` lists them, ``(slot, dtype)``), then one zero: the place of a slot not in ``where``."""
    offsets, at = {}, 0
    for dtype in order:
        offsets[dtype] = at
        at += sum(kind is dtype for _, kind in where)
    places = [at] * n
    for slot, kind in where:
        places[slot] = offsets[kind]
        offsets[kind] += 1
    return places


class _GradProbe(torch.autograd.Function):
    """The identity on a ``Float8Linear``'s output in the forward; in the backward, the amax of the gradient arriving
    there (the tensor torchao casts as grad_output) becomes the gradient of ``probe``, a 0-dim float64 leaf the
    monitor owns and no optimizer holds. A pure function of the graph (nothing written outside it), so
    ``torch.compile`` traces it into the compiled backward where a gradient hook would break the graph. The amax is
    :func:`_torchao_amax` over ``(rowwise, dim)`` (:func:`_grad_output_reduction`): torchao's own ops on the same
    tensor, which the compiled backward's CSE merges with torchao's grad_output reduction."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, probe: torch.Tensor, reduction: tuple[bool, int]) -> torch.Tensor:
        ctx.reduction = reduction
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        rowwise, dim = ctx.reduction
        return grad, _torchao_amax(grad, "grad_output", rowwise=rowwise, dim=dim), None


class _GradStatsProbe(torch.autograd.Function):
    """:class:`_GradProbe` on a sampled step: in the backward, the whole statistics of the cast torchao makes of the
    gradient (:func:`cast_stats`: ``[1, amax, scale, underflow, dynamic_range]``) become the gradient of ``probe``, a
    ``[5]`` float64 leaf the monitor owns (the underflow and the range on the monitor's row sample). Summed over the
    forwards of a step (gradient accumulation): the first entry then counts them, and :meth:`Fp8Monitor._take_probes`
    divides the underflow and the range by it."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, probe: torch.Tensor,
                spec: tuple[torch.dtype, bool, bool, int | None]) -> torch.Tensor:
        ctx.spec = spec
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        dtype, rowwise, pow2, sample = ctx.spec
        stats = _merged_cast_stats(grad, "grad_output", dtype, rowwise=rowwise, pow2=pow2, sample=sample)
        return grad, stats.double(), None


def _grad_output_reduction(module: Any, input_grad: bool) -> tuple[bool, int]:
    """``(rowwise, dim)`` of a grad_output reduction torchao 0.18's backward keeps for ``module``: grad_input's cast
    (``cast_config_grad_output``, rowwise over dim -1) where the input needs a gradient, else grad_weight's
    (``cast_config_grad_output_for_grad_weight``, rowwise over dim 0) where the weight does; a cast whose scaling
    is disabled reduces nothing. The amax is the same whichever it mirrors; only the merge depends on it (the
    first layer's input, or a frozen weight: torchao's other cast is dead code in the compiled backward)."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    config = module.config
    candidates = [(config.cast_config_grad_output, -1)] if input_grad else []
    if module.weight.requires_grad:
        candidates.append((config.cast_config_grad_output_for_grad_weight, 0))
    for cast, dim in candidates:
        if cast.scaling_type is not ScalingType.DISABLED:
            return cast.scaling_granularity is ScalingGranularity.AXISWISE, dim
    return False, -1


class _Taps:
    """torchao's own amax of a cast, handed to the monitor whose visit asks for it (the module docstring). Two
    wrappers, each passing everything through unless a visit asks for the cast's role: ``cast`` in place of
    ``float8_linear.hp_tensor_to_float8_dynamic`` (the cast of one role; it marks the next amax as wanted), ``amax``
    in place of ``float8_utils.tensor_to_amax`` (which ``tensor_to_scale`` looks up there at each call). Put in
    place while a monitor exists (``users``), taken off by the last ``close()``; a hook delegates only while both are
    in place (:meth:`ready`: someone else's patch over them makes the hooks measure as before)."""

    def __init__(self) -> None:
        self.users = 0
        self.visit: tuple[Any, list[tuple[Fp8Monitor, int, set[str]]]] | None = None
        """(module, [(monitor, module index, roles wanted), ...]): opened by a hook as its layer is about to cast
        (:meth:`open`: one entry a monitor of that layer), closed by the next layer's."""
        self.target: str | None = None
        """The role of the cast whose amax the next ``tensor_to_amax`` computes, while ``cast`` runs it."""
        self.owners: dict[int, tuple[Any, list[tuple[Fp8Monitor, int]]]] = {}
        """``id(linear_mm_config)`` -> (that config, [(monitor, module index), ...]): whose grad_output a backward's
        cast is (:meth:`own`)."""
        self.last_grad: Any = None
        """A weak reference to the tensor of the last grad_output cast taken through :attr:`owners`: the second cast of
        the same tensor in the same backward (torchao's dim-1 one, for the weight's gradient) is not taken again."""
        self.amax: torch.Tensor | None = None
        """That amax, as ``tensor_to_amax`` returned it, until the cast returns."""
        self.roles: dict[int, str] = {}
        """``id`` of each of torchao's ``GemmInputRole`` members (and of None, its default: the input) -> the role's
        name: told by identity, where ``role.value`` is an enum property and ``hash(role)`` a Python call (a cast
        each)."""
        self.modules: tuple[Any, Any] | None = None
        self.originals: tuple[Any, Any] | None = None
        self.wrappers: tuple[Any, Any] | None = None

    def install(self) -> None:
        from torchao.float8 import float8_linear, float8_utils

        self.users += 1
        if self.ready():
            return
        if not (callable(getattr(float8_linear, "hp_tensor_to_float8_dynamic", None))
                and callable(getattr(float8_utils, "tensor_to_amax", None))):
            return  # a torchao without them: not ready, the hooks measure every cast themselves
        self.modules = (float8_linear, float8_utils)
        roles = getattr(float8_linear, "GemmInputRole", None)
        self.roles = {id(None): "input"} | {id(role): str(role.value) for role in (roles or ())}
        originals = tuple(getattr(f, "__wrapped__", f) if getattr(f, "_ampguard_tap", False) else f  # not twice
                          for f in (float8_linear.hp_tensor_to_float8_dynamic, float8_utils.tensor_to_amax))
        self.originals, self.wrappers = originals, (self._cast(originals[0]), self._amax(originals[1]))
        float8_linear.hp_tensor_to_float8_dynamic, float8_utils.tensor_to_amax = self.wrappers

    def own(self, monitor: Fp8Monitor) -> list[bool]:
        """Register ``monitor``'s modules whose ``linear_mm_config`` no other module of it shares (other monitors of
        the same module are registered beside it): their grad_output casts come to it through the taps, with no
        gradient hook. Returns, per module, whether it was registered."""
        configs = [getattr(module, "linear_mm_config", None) for _, module in monitor.modules]
        shared = Counter(id(c) for c in configs)
        owned = []
        for index, config in enumerate(configs):
            entry = self.owners.get(id(config))
            ok = config is not None and shared[id(config)] == 1 and (entry is None or entry[0] is config)
            if ok:
                if entry is None:
                    entry = self.owners[id(config)] = (config, [])
                entry[1].append((monitor, index))
            owned.append(ok)
        return owned

    def disown(self, monitor: Fp8Monitor) -> None:
        for key, (_, takers) in list(self.owners.items()):
            takers[:] = [t for t in takers if t[0] is not monitor]
            if not takers:
                del self.owners[key]
        self.last_grad = None

    def open(self, module: Any, monitor: Fp8Monitor, index: int, wanted: set[str]) -> None:
        """``monitor``'s visit of ``module``: joins the visit other monitors of the same module opened for this call,
        or replaces the last module's."""
        visit = self.visit
        if visit is not None and visit[0] is module:
            visit[1].append((monitor, index, wanted))
        else:
            self.visit = (module, [(monitor, index, wanted)])

    def remove(self) -> None:
        self.users -= 1
        self.visit = self.target = self.amax = None
        if self.users > 0 or self.modules is None or self.originals is None:
            return
        if self.ready():  # ours still: put torchao's back (a patch made over ours is left as it is)
            self.modules[0].hp_tensor_to_float8_dynamic, self.modules[1].tensor_to_amax = self.originals
        self.modules = self.originals = self.wrappers = None

    def ready(self) -> bool:
        """Both wrappers in place."""
        m, w = self.modules, self.wrappers
        return (m is not None and w is not None and getattr(m[0], "hp_tensor_to_float8_dynamic", None) is w[0]
                and getattr(m[1], "tensor_to_amax", None) is w[1])

    def _cast(self, original: Any) -> Any:
        is_compiling = torch.compiler.is_compiling
        roles = self.roles

        def hp_tensor_to_float8_dynamic(hp_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if is_compiling():  # first: a compiled region reads nothing of the taps
                return original(hp_tensor, *args, **kwargs)
            role = kwargs.get("gemm_input_role", args[3] if len(args) > 3 else None)
            name = roles.get(id(role))
            if name is None:  # a role torchao's GemmInputRole did not list at install
                name = str(getattr(role, "value", ""))
            visit = self.visit
            if visit is not None:
                takers = []
                for monitor, index, wanted in visit[1]:
                    if name in wanted:  # the first cast of each role in a visit: the forward's, the backward's dim-0
                        wanted.discard(name)
                        takers.append((monitor, index))
                if takers:
                    return self._take(original, takers, name, hp_tensor, args, kwargs)
            if name != "grad_output" or not self.owners:  # the backward's weight and input casts among them
                return original(hp_tensor, *args, **kwargs)
            return self._grad_output(original, hp_tensor, args, kwargs)
        return _marked(hp_tensor_to_float8_dynamic, original)

    def _grad_output(self, original: Any, hp_tensor: torch.Tensor, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
        """Outside a visit's roles, a grad_output cast: that of a registered layer (:meth:`own`, told by the
        ``linear_mm_config`` torchao's backward passes), the first of its tensor, is taken for that layer's monitor;
        anything else passes through."""
        if type(hp_tensor) is not torch.Tensor:
            return original(hp_tensor, *args, **kwargs)
        config = kwargs.get("linear_mm_config", args[1] if len(args) > 1 else None)
        owner = self.owners.get(id(config))
        if owner is None or owner[0] is not config:
            return original(hp_tensor, *args, **kwargs)
        last = self.last_grad
        if last is not None and last() is hp_tensor:  # the dim-1 cast of the grad_output just taken
            self.last_grad = None
            return original(hp_tensor, *args, **kwargs)
        self.last_grad = weakref.ref(hp_tensor)  # weak: the gradient is freed with the layer's backward
        return self._take(original, owner[1], "grad_output", hp_tensor, args, kwargs)

    def _take(self, original: Any, takers: Sequence[tuple[Fp8Monitor, int]], name: str, hp_tensor: torch.Tensor,
              args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run torchao's cast with :attr:`target` set, and hand its amax to each (monitor, module index) of
        ``takers`` as the cast returns."""
        self.target, self.amax = name, None
        try:
            result = original(hp_tensor, *args, **kwargs)
        finally:
            self.target = None
        amax, self.amax = self.amax, None
        if amax is not None:
            for monitor, index in takers:
                monitor._took(index, name, amax, hp_tensor, result)
        return result

    def _amax(self, original: Any) -> Any:
        def tensor_to_amax(*args: Any, **kwargs: Any) -> torch.Tensor:
            amax: torch.Tensor = original(*args, **kwargs)
            # the amax of the cast a visit asked for: handed over as the cast returns (target is set only by an eager
            # _take, never inside a compiled region: is_compiling is read only then, where it costs a call a cast)
            if self.target is not None and not torch.compiler.is_compiling():
                self.target, self.amax = None, amax
            return amax
        return _marked(tensor_to_amax, original)


def _marked(wrapper: Any, original: Any) -> Any:
    """A tap, marked as one, with the function it wraps (a later install wraps that, not the tap)."""
    wrapper._ampguard_tap = True
    wrapper.__wrapped__ = original
    return wrapper


_TAPS = _Taps()
_PLAIN = (torch.nn.Parameter, torch.Tensor)
"""A weight of these types is cast by the layer's forward, through the taps (FSDP2's float8 all-gather: not)."""
_ROLE_INDEX = {role: i for i, role in enumerate(FP8_ROLES)}
"""A role's place among a layer's three slots (:data:`FP8_ROLES`' order)."""


class Fp8Monitor:
    """Measures every fp8 cast of the ``Float8Linear`` modules of ``model`` (see the module docstring).

    Use: ``begin_step(step)`` before the forward, ``collect()`` after the backward (an ``[n_casts, 5]`` device
    tensor, ``n_casts = 3 * len(modules)`` ordered module by module, role by role), ``nonfinite(collected)`` for a
    0-dim device flag (1.0 where an amax or scale is non-finite or a scale is 0), ``decode(host_rows)`` for the
    records. Several forwards in one step (gradient accumulation) keep the largest amax and underflow and the
    smallest scale. ``close()`` removes the hooks."""

    def __init__(self, model: torch.nn.Module, *, numerics_every: int = 10) -> None:
        if not isinstance(numerics_every, int) or numerics_every < 1:
            raise ValueError(
                f"numerics_every must be an int >= 1 (the underflow is measured every that many steps); "
                f"got {numerics_every!r}")
        require("torchao")
        import torchao.float8  # noqa: F401  (registers Float8Linear for float8_modules)

        self.modules = float8_modules(model)
        if not self.modules:
            raise ValueError(
                "fp8 monitoring found no torchao Float8Linear in the model: convert it first with "
                "torchao.float8.convert_to_float8_training(model), or leave fp8 monitoring off")
        self.numerics_every = numerics_every
        self.sample: int | None = SAMPLE_ELEMENTS
        """Elements of a cast its underflow and range are measured on (:func:`cast_stats`; None: all of them)."""
        self.names: list[tuple[str, str]] = [(name, role) for name, _ in self.modules for role in FP8_ROLES]
        self._slots: list[Any] = [None] * len(self.names)
        """Per cast this step: its 5 statistics or a :class:`_Sampled` (sampled steps), or its amax alone (other
        steps)."""
        self._orders: list[float] = [math.nan] * len(self.names)
        """Per cast: k where it was the k-th cast measured this step (NaN: not run), known on the host."""
        self._rounded: dict[int, torch.dtype] = {}
        """Casts whose amax was taken before the autocast dtype's rounding (rounded in collect())."""
        self._taken: dict[torch.dtype, list[torch.Tensor]] | None = {}
        """The amaxes taken from torchao this step, by dtype, in the order taken (None: a slot was replaced)."""
        self._where: list[tuple[int, torch.dtype]] = []
        """(slot, dtype) of each amax in ``_taken``, in the order taken."""
        self._buffer: torch.Tensor | None = None
        """A sampled step's row samples of its tensorwise casts, a row a cast (:class:`_Batched`)."""
        self._widths: dict[int, int] = {}
        """Per tensorwise slot, the elements of its last sample: the next sampled step's buffer is as wide as the
        largest (a buffer as wide as the sample size measured padding: 64x the work on 1024-element casts)."""
        self._width = 0
        self._sampled = False
        self._order = 0  # casts measured this step: each cast's rank in the order they ran
        self.compiled = False
        """A forward ran inside ``torch.compile`` with a DTensor output: its grad_output casts are not measured
        (warned once)."""
        self.probed = False
        """A forward ran inside ``torch.compile``: its grad_output amaxes come back through the probes."""
        self._probes = [torch.zeros((), dtype=torch.float64, device=next(m.parameters()).device, requires_grad=True)
                        for _, m in self.modules]
        """Per module, a 0-dim leaf whose gradient a compiled backward sets to the grad_output amax
        (:class:`_GradProbe`; summed over the forwards of a step: with gradient accumulation under compile, an upper
        bound)."""
        self._stat_probes = [torch.zeros(5, dtype=torch.float64, device=p.device, requires_grad=True)
                             for p in self._probes]
        """Per module, the ``[5]`` leaf of :class:`_GradStatsProbe`: a sampled step's grad_output statistics under
        ``torch.compile``."""
        self._warned = False
        self._consts: dict[Any, torch.Tensor] = {}
        """Device constants of :meth:`collect`, made once per device and pattern (a pinned copy, no sync)."""
        self._dtypes = [_dtype(m, role) for _, m in self.modules for role in FP8_ROLES]
        """Per slot, the fp8 dtype of its cast; with ``_rowwise`` and ``_pow2``, the cast's config, read once."""
        self._rowwise = [_rowwise(m, role) for _, m in self.modules for role in FP8_ROLES]
        self._fmax = [torch.finfo(dtype).max for dtype in self._dtypes]
        self._pow2 = [_pow2(m) for _, m in self.modules for _ in FP8_ROLES]
        self._handles: list[Any] = []
        _TAPS.install()
        self._tapping = True
        self._owned = _TAPS.own(self)
        """Per module: its grad_output casts come through the taps by its ``linear_mm_config`` (:meth:`_Taps.own`),
        with no gradient hook in eager mode."""
        for index, (_, module) in enumerate(self.modules):
            # before the forward: the input and the weight as the layer casts them (under FSDP2 the weight is then
            # unsharded; after the forward it is a shard again); after it: the gradient hook for grad_output
            self._handles.append(module.register_forward_pre_hook(Hook(self._pre_forward_hook(index))))
            self._handles.append(module.register_forward_hook(Hook(self._forward_hook(index))))

    def _measure(self, module: Any, index: int, role: str, x: torch.Tensor, cast_to: torch.dtype | None) -> None:
        """``x``: the tensor the layer casts, or its high-precision original when ``cast_to`` (the autocast dtype)
        says the layer casts ``x.to(cast_to)`` first."""
        slot = 3 * index + FP8_ROLES.index(role)
        x = local_tensor(x)  # a DTensor (a shard, or tensor-parallel activations): this rank's part
        old = self._ran(slot)
        if not self._sampled:
            # One reduction: amax, in float32 (rounding is monotone, so the amax of x.to(cast_to) is the amax of x
            # rounded to cast_to: done in collect(), for all casts at once). The scale, from the amax, there too.
            if cast_to is not None and cast_to != x.dtype:
                self._rounded[slot] = cast_to
            if torch.compiler.is_compiling():  # torchao's own reduction, which AOTAutograd's CSE merges with it
                with torch.no_grad():
                    amax = _torchao_amax(x.to(cast_to) if cast_to is not None else x, role,
                                         rowwise=_rowwise(module, role))
            else:
                amax = torch.linalg.vector_norm(x.detach(), ord=math.inf, dtype=torch.float32)
            self._slots[slot] = amax if old is None else torch.maximum(old, amax)
            return
        hp = x.to(cast_to) if cast_to is not None else x  # the tensor torchao casts (only the input is cast first)
        dtype, rowwise, pow2 = _dtype(module, role), _rowwise(module, role), _pow2(module)
        if torch.compiler.is_compiling():  # the row amaxes torchao's (merged with its reduction)
            stats = _merged_cast_stats(hp, role, dtype, rowwise=rowwise, pow2=pow2, sample=self.sample)
        else:
            stats = cast_stats(hp, dtype, rowwise=rowwise, pow2=pow2, sample=self.sample)
        if old is not None:  # a second forward in the step: the worst of both
            stats = _worst(self._as_row(slot, old), stats)
        self._slots[slot] = stats

    def _took(self, index: int, role: str, amax: torch.Tensor, hp: torch.Tensor, cast: Any) -> None:
        """A cast a visit asked for (:class:`_Taps`): ``amax`` torchao's, of ``hp``, the tensor it cast (the input in
        the autocast dtype; the weight transposed), into ``cast``. Unsampled: the slot's amax, as :meth:`_measure`
        makes it (rowwise: the largest over rows; no rounding), in the dtype torchao reduced it in (exact: the largest
        ``|x|`` is one of ``x``'s values). Sampled: the rest of the cast's statistics too (:meth:`_sample`)."""
        slot = 3 * index + _ROLE_INDEX[role]
        if amax.requires_grad:
            amax = amax.detach()
        if amax.dim():  # rowwise: the largest over rows
            amax = amax.amax()
        if self._sampled:
            self._sample(index, slot, role, amax, hp, cast)
            return
        old = self._ran(slot)
        if old is not None:  # a second forward in the step: the larger (collect() then groups the slots itself)
            self._taken = None
            self._slots[slot] = torch.maximum(old.float(), amax.float())
            return
        # Kept in torchao's dtype (bfloat16 for a bfloat16 tensor), grouped by it as taken: collect() converts each
        # group in one kernel, where a conversion here was a launch a cast (96 a step on GPT-2 124M fp8)
        self._slots[slot] = amax
        if self._taken is not None:
            dtype = amax.dtype
            group = self._taken.get(dtype)
            if group is None:
                group = self._taken[dtype] = []
            group.append(amax)
            self._where.append((slot, dtype))

    def _sample(self, index: int, slot: int, role: str, amax: torch.Tensor, hp: torch.Tensor, cast: Any) -> None:
        """A sampled step's statistics of a cast the taps handed over, from torchao's own amax and scale (the scale
        ``cast._scale``: rowwise, per row of the input or the weight; a rowwise grad_output's, taken over either dim,
        is measured on the sample's rows), as :class:`_Sampled`: the counts and the smallest ``|x|`` of the row
        sample, finished for all casts at once in collect(). A cast with no ``_scale``: :func:`cast_stats` whole."""
        module: Any = self.modules[index][1]
        x = module.weight.detach() if role == "weight" else hp.detach()  # the weight's rows, as the hooks read it
        scale = getattr(cast, "_scale", None)
        old = self._ran(slot)
        dtype, rowwise, pow2 = self._dtypes[slot], self._rowwise[slot], self._pow2[slot]
        sampled = None
        if isinstance(scale, torch.Tensor) and x.dim() > 0 and scale.dtype == torch.float32:
            rows = x.reshape(-1, x.shape[-1])
            n_rows = rows.shape[0]
            stride = sample_rows(n_rows, rows.shape[1], self.sample)
            if not rowwise and scale.numel() == 1:
                sample = rows[::stride]
                if old is None and self._buffered(slot, sample):
                    self._slots[slot] = _Batched(amax, scale.reshape(()), sample.numel())
                    return
                sampled = _Sampled.of(sample, amax, scale.reshape(()), scale.reshape(1), dtype)
            elif rowwise and role != "grad_output" and scale.numel() == n_rows:
                sampled = _Sampled.of(rows[::stride], amax, scale.amin(), scale.reshape(-1, 1)[::stride], dtype)
            elif rowwise:
                rows = rows[::stride]
                row_amax = torch.linalg.vector_norm(rows, ord=math.inf, dim=-1, keepdim=True, dtype=torch.float32)
                sampled = _Sampled.of(rows, amax, scale.amin(), _scale(row_amax, self._fmax[slot], pow2), dtype)
        if sampled is not None and old is None:
            self._slots[slot] = sampled  # finished in collect()
            return
        stats = sampled.finish() if sampled is not None else cast_stats(
            x, dtype, rowwise=rowwise, pow2=pow2, sample=self.sample)
        if old is not None:
            stats = _worst(self._as_row(slot, old), stats)
        self._slots[slot] = stats

    def _ran(self, slot: int) -> torch.Tensor | None:
        """A cast of ``slot`` ran: its value so far this step (None the first time, when its order is counted)."""
        old = self._slots[slot]
        if old is None:
            self._order += 1
            self._orders[slot] = float(self._order)
        return old

    def _buffered(self, slot: int, sample: torch.Tensor) -> bool:
        """Copy ``sample`` into row ``slot`` of this step's buffer (made at the first: ``[n_casts, width]`` float32,
        Inf where nothing is written; ``width`` the largest sample of the last sampled step, at most the sample size:
        37.7 MB for GPT-2 124M's 144 casts at 2^16 elements), one kernel; False where it does not fit (the first
        sampled step, a sample larger than the last step's, no sample size, another device)."""
        n = sample.numel()
        self._widths[slot] = n
        if self.sample is None or n > self._width or n == 0:
            return False
        buffer = self._buffer
        if buffer is None:
            buffer = self._buffer = torch.full((len(self.names), self._width), math.inf, dtype=torch.float32,
                                               device=sample.device)
        elif buffer.device != sample.device:
            return False
        buffer[slot, :n].view(sample.shape).copy_(sample)
        return True

    def _delegates(self) -> bool:
        """Whether this cast is measured through the taps (:class:`_Taps`): eager, the taps in place."""
        return not torch.compiler.is_compiling() and _TAPS.ready()

    def _pre_forward_hook(self, index: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            eager = not torch.compiler.is_compiling()
            if eager:
                visit = _TAPS.visit
                if visit is not None and visit[0] is not module:
                    _TAPS.visit = None  # the last layer's visit ends where this one starts (another monitor's joins it)
            if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
                return  # an evaluation's forward (no step follows it), or an input the layer does not cast
            # Delegated: a plain tensor is cast inside the layer's forward, whose amax the taps hand over (no read
            # here); a DTensor, an fp8 input or FSDP2's float8 all-gather of the weight is measured here.
            x, weight = args[0], module.weight
            delegates = eager and _TAPS.ready()
            if delegates and type(x) is torch.Tensor and type(weight) in _PLAIN:  # the usual eager step: all delegated
                _TAPS.open(module, self, index, {"input", "weight"})
                return
            # As torchao 0.18's Float8Linear.forward: the input cast to CUDA autocast's dtype where CUDA autocast is
            # on (torch.is_autocast_enabled() with no device: CUDA's; CPU autocast casts nothing there), the weight
            # never (its fp32 master is scaled as it is).
            cast_to = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
            wanted = set()
            if delegates and type(x) is torch.Tensor:
                wanted.add("input")
            else:
                self._measure(module, index, "input", x, cast_to)
            if delegates and type(weight) in _PLAIN:
                wanted.add("weight")
            else:
                self._measure(module, index, "weight", weight, None)
            if delegates:
                _TAPS.open(module, self, index, wanted)
        return hook

    def _forward_hook(self, index: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...], output: Any) -> Any:
            eager = not torch.compiler.is_compiling()
            if eager:
                _TAPS.visit = None
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None  # an evaluation's forward (no step follows it), or an output no gradient reaches
            if eager:
                if self._owned[index] and type(output) is torch.Tensor and _TAPS.ready():
                    return None  # its grad_output cast comes through the taps, told by the layer's linear_mm_config
                output.register_hook(self._backward_hook(module, index))  # the grad_output cast, in the backward
                return None
            if hasattr(output, "placements"):  # a DTensor output (tensor parallel) inside torch.compile
                self.compiled = True
                return None
            # A gradient hook registered inside a compiled region breaks its graph (dynamo cannot trace a hook that
            # writes the monitor's state): the probe, a pure function, carries the amax out as a gradient instead.
            self.probed = True
            if self._sampled:  # the underflow and the range too (a second compiled variant: sampled or not)
                spec = (_dtype(module, "grad_output"), _rowwise(module, "grad_output"), _pow2(module), self.sample)
                return _GradStatsProbe.apply(output, self._stat_probes[index], spec)
            input_grad = bool(args) and isinstance(args[0], torch.Tensor) and args[0].requires_grad
            return _GradProbe.apply(output, self._probes[index], _grad_output_reduction(module, input_grad))
        return hook

    def _backward_hook(self, module: Any, index: int) -> Any:
        def hook(grad_output: torch.Tensor) -> None:  # a hook on the layer's output: its gradient, as cast
            if self._delegates() and type(grad_output) is torch.Tensor:  # cast by the layer's backward, next
                _TAPS.open(module, self, index, {"grad_output"})
                return
            self._measure(module, index, "grad_output", grad_output, None)
        return hook

    def _take_probes(self, device: torch.device) -> None:
        """The grad_output statistics the probes carried out of a compiled backward, in backward order (the reverse
        of the modules'), as the slots of those casts: the amax (:class:`_GradProbe`; the scale from it), or on a
        sampled step all of them (:class:`_GradStatsProbe`; over several forwards of a step the amax is the sum of
        theirs, an upper bound, and the underflow and the range their mean). Each probe's gradient is cleared for the
        next step."""
        for index in range(len(self.modules) - 1, -1, -1):
            probe, stat_probe = self._probes[index], self._stat_probes[index]
            amax, stats = probe.grad, stat_probe.grad
            probe.grad = stat_probe.grad = None
            if amax is None and stats is None:
                continue
            slot = 3 * index + FP8_ROLES.index("grad_output")
            if self._ran(slot) is not None:  # measured by the eager hook (a forward outside the compiled region)
                continue
            if stats is not None:  # a sampled step (the probe of a step is one or the other: _sampled is fixed)
                stats = stats.to(device, torch.float32)
                n = stats[0].clamp_min(1.0)
                scale = _scale(stats[1], self._fmax[slot], self._pow2[slot])
                self._slots[slot] = torch.stack([torch.ones_like(scale), stats[1], scale, stats[3] / n, stats[4] / n])
                continue
            assert amax is not None  # internal: stats is None here, and not both are
            amax = amax.to(device, torch.float32)  # a float32 value in float64 (or, accumulated, a sum of them)
            if not self._sampled:
                self._slots[slot] = amax
                continue
            scale = _scale(amax, self._fmax[slot], self._pow2[slot])
            nan = self._const(device, ("nan",), [math.nan])[0]
            self._slots[slot] = torch.stack([torch.ones_like(scale), amax, scale, nan, nan])

    def begin_step(self, step: int) -> None:
        """Start a step: forget the last one's casts; ``step`` decides whether this one is sampled."""
        _TAPS.visit = None
        self._slots = [None] * len(self.names)
        self._orders = [math.nan] * len(self.names)
        self._rounded = {}
        self._order = 0
        self._taken = {}
        self._where = []
        self._buffer = None
        self._sampled = step % self.numerics_every == 0
        if self._sampled:
            self._width = max(self._widths.values(), default=0)
        if self.probed:  # a probe's gradient from a step that was never collected
            for probe in (*self._probes, *self._stat_probes):
                probe.grad = None

    def collect(self) -> torch.Tensor:
        """``[n_casts, 5]`` float32 on device: order, amax, scale, underflow, dynamic range (``order`` k: the k-th
        cast measured this step; a cast that did not run, e.g. a frozen layer's grad_output, has order NaN and amax 0,
        so :meth:`nonfinite` reads the amaxes alone). An unsampled step makes it in 6 small kernels, 2 more where CUDA's
        autocast rounds the inputs and 4 more with scales rounded to powers of 2: each is a launch that costs the host
        more than its work costs the device."""
        _TAPS.visit = None  # the backward is over: no cast of this step is left to take
        if self.compiled and not self._warned:
            self._warned = True
            warnings.warn("ampguard fp8 monitoring inside torch.compile does not measure the grad_output casts of a "
                          "Float8Linear whose output is a DTensor (tensor parallel). A non-finite grad_output still "
                          "shows in the gradients the guard checks.", stacklevel=2)
        device = next((s.device for s in self._slots if s is not None), None)
        if device is None:
            device = next(self.modules[0][1].parameters()).device
        if self.probed:
            self._take_probes(device)
        if self._sampled:
            return self._collect_sampled(device)
        # An unsampled step: one stack of the amaxes, then every scale at once (torchao's formula, as cast_stats)
        amax = self._amaxes(device)
        for dtype in set(self._rounded.values()):  # the autocast dtype's rounding (exact in float32: where promotes)
            mask = self._const(device, ("round", dtype, *sorted(self._rounded.items(), key=lambda kv: kv[0])),
                               [self._rounded.get(k) is dtype for k in range(len(self._slots))], torch.bool)
            amax = torch.where(mask, amax.to(dtype), amax)
        pow2 = self._const(device, ("pow2",), self._pow2, torch.bool) if any(self._pow2) else False
        scale = _scale(amax, self._const(device, ("fmax",), self._fmax, torch.float64), pow2)
        order = self._const(device, ("order", *self._orders), self._orders)
        none = self._const(device, ("nans", len(self._slots)), [math.nan] * len(self._slots))
        return torch.stack([order, amax, scale, none, none], 1)

    def _collect_sampled(self, device: torch.device) -> torch.Tensor:
        """collect() of a sampled step. Where every cast that ran came through the taps, their statistics are
        finished at once (:meth:`_collect_buffer`, or :class:`_Sampled`'s counts stacked), in a few tens of kernels
        however many casts; beside casts measured otherwise, each is finished on its own."""
        slots = self._slots
        absent = self._const(device, ("absent", WIDTH), [math.nan, 0.0] + [math.nan] * (WIDTH - 2))
        present = [i for i, s in enumerate(slots) if s is not None]
        raws = [slots[i] for i in present]
        if raws and all(isinstance(r, _Batched) for r in raws):
            return self._in_slot_order(device, self._collect_buffer(device, present, raws), present, absent)
        if raws and all(isinstance(r, _Sampled) for r in raws):
            sampled: list[_Sampled] = raws
            rows = self._sampled_rows(device, present, sampled, torch.stack([r.scale for r in sampled]),
                                      torch.stack([r.underflowed for r in sampled]),
                                      self._stack_float(device, [r.smallest for r in sampled]))
            return self._in_slot_order(device, rows, present, absent)
        rows = torch.stack([self._as_row(i, s) if s is not None else absent for i, s in enumerate(slots)])
        return torch.cat([self._const(device, ("order", *self._orders), self._orders).unsqueeze(1), rows[:, 1:]], 1)

    def _collect_buffer(self, device: torch.device, present: list[int], batched: list[_Batched]) -> torch.Tensor:
        """``[len(present), 5]`` rows of the casts whose samples are in the buffer, at once (~30 kernels however
        many casts): the non-zero ``|x|`` at most its cast's :func:`_thresholds` (exactly the elements the cast makes
        0), over the elements written (the rest are Inf: never counted, never the smallest). As in
        :meth:`_Sampled.of`, the zeros are made Inf first, so only non-zero elements are counted."""
        buffer = self._buffer
        assert buffer is not None  # internal: a _Batched slot wrote it
        if len(present) < buffer.shape[0]:
            buffer = buffer.index_select(0, self._const(device, ("rows", *present), present, torch.int64))
        magnitudes = buffer.abs_()  # in place, zeros made Inf: a second collect() reads the same counts
        magnitudes.masked_fill_(magnitudes == 0, math.inf)
        scale = torch.stack([b.scale for b in batched])
        halves = self._const(device, ("half", *present), lambda: [_half_tiny(self._dtypes[i]) for i in present])
        underflowed = (magnitudes <= _thresholds(scale, halves).unsqueeze(1)).sum(1)
        return self._sampled_rows(device, present, batched, scale, underflowed, magnitudes.amin(1))

    def _sampled_rows(self, device: torch.device, present: list[int], casts: Sequence[_Sampled | _Batched],
                      scale: torch.Tensor, underflowed: torch.Tensor, smallest: torch.Tensor) -> torch.Tensor:
        """``[len(present), 5]``: order, torchao's amaxes, ``scale``, the ``underflowed`` count over each cast's
        sample, ``log2(amax / smallest)``."""
        counts = [max(c.n, 1) for c in casts]
        underflow = underflowed.float() / self._const(device, ("n1", *counts), counts)
        amax = self._stack_float(device, [c.amax for c in casts])
        orders = [self._orders[i] for i in present]
        return torch.stack([self._const(device, ("order", *orders), orders), amax, scale, underflow,
                            torch.log2(amax / smallest.float())], 1)

    def _in_slot_order(self, device: torch.device, values: torch.Tensor, present: list[int],
                       absent: torch.Tensor) -> torch.Tensor:
        """``values`` (a row per slot in ``present``) with ``absent`` at every other slot, in slot order: one gather
        (none where every slot is present)."""
        n = len(self._slots)
        if len(present) == n:
            return values
        place = self._const(device, ("present", n, *present), lambda: _places(n, [None], [(i, None) for i in present]),
                            torch.int64)
        return torch.cat([values, absent.unsqueeze(0)]).index_select(0, place)

    def _as_row(self, slot: int, value: Any) -> torch.Tensor:
        """A slot's sampled statistics as its 5 values, whichever way they were taken."""
        if isinstance(value, _Batched):
            return self._finish_buffered(slot, value)
        return value.finish() if isinstance(value, _Sampled) else value

    def _finish_buffered(self, slot: int, cast: _Batched) -> torch.Tensor:
        """One buffered cast's row on its own (beside casts measured otherwise): its sample as :class:`_Sampled`."""
        assert self._buffer is not None  # internal: a _Batched slot wrote it
        sample = self._buffer[slot, :cast.n].reshape(1, -1)
        return _Sampled.of(sample, cast.amax, cast.scale, cast.scale.reshape(1), self._dtypes[slot]).finish()

    def _stack_float(self, device: torch.device, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """0-dim ``tensors`` of one or more dtypes as float32 ``[n]``, in order: a stack and a conversion per dtype,
        joined and put back in order by one gather where there are several."""
        kinds = [t.dtype for t in tensors]
        order = tuple(dict.fromkeys(kinds))
        if len(order) == 1:
            return torch.stack(list(tensors)).float()
        parts = [torch.stack([t for t in tensors if t.dtype is dtype]).float() for dtype in order]
        where = list(enumerate(kinds))
        place = self._const(device, ("order of", *kinds), lambda: _places(len(tensors), order, where), torch.int64)
        return torch.cat(parts).index_select(0, place)

    def _amaxes(self, device: torch.device) -> torch.Tensor:
        """The unsampled slots' amaxes, float32 ``[n_casts]`` (0 where a cast did not run): one stack where they share
        a dtype; else a stack and a conversion per dtype (torchao's bfloat16 amaxes beside the float32 weights', the
        compiled probes' float64), joined, and put back in slot order by one gather."""
        taken, where, slots = self._taken, self._where, self._slots
        fast = taken is not None and len(where) == self._order  # every slot taken from torchao (the usual eager step)
        dtypes = tuple(taken) if taken is not None and fast else {s.dtype for s in slots if s is not None}
        if len(dtypes) <= 1:  # one stack, in slot order
            zero = self._const(device, ("zero",), [0.0], next(iter(dtypes), torch.float32))[0]
            return torch.stack([s if s is not None else zero for s in slots]).float()
        if taken is None or not fast:  # slots measured by the hooks, or a second forward's
            present = [i for i, s in enumerate(slots) if s is not None]
            zero = self._const(device, ("zero",), [0.0])[0]
            return self._in_slot_order(device, self._stack_float(device, [slots[i] for i in present]), present, zero)
        order = tuple(taken)
        parts = [torch.stack(group).float() for group in taken.values()]
        parts.append(self._const(device, ("zero",), [0.0]))
        key = ("place", len(self._slots), order, tuple(where))
        place = self._const(device, key, lambda: _places(len(self._slots), order, where), torch.int64)
        return torch.cat(parts).index_select(0, place)

    def _const(self, device: torch.device, key: tuple[Any, ...],
               values: Sequence[float | bool] | Callable[[], Sequence[float | bool]],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``values`` (or what calling it returns) as a tensor on ``device``, made once per key (a pinned copy, not
        waited for); a model's casts run in the same order every step, so the keys repeat. Kept: at most 64."""
        full = (device, dtype, *key)
        t = self._consts.get(full)
        if t is None:
            if len(self._consts) >= 64:
                self._consts.clear()
            host = torch.tensor(list(values() if callable(values) else values), dtype=dtype)
            if device.type == "cuda":
                host = host.pin_memory()
            t = self._consts[full] = host.to(device, non_blocking=True)
        return t

    def nonfinite(self, collected: torch.Tensor) -> torch.Tensor:
        """0-dim float32 on device: 1.0 where a cast that ran has a non-finite amax or a non-finite or zero scale.
        The amaxes alone tell: torchao's scale ``fmax / clamp(amax, 1e-12)`` (rounded down to a power of 2 or not)
        is finite and positive for every finite amax, NaN for a NaN and 0 for an infinite one; a cast that did not
        run has amax 0 (:meth:`collect`). ``amax - amax`` is 0 where finite and NaN elsewhere: 4 small kernels."""
        amax = collected[:, 1]
        return (amax - amax).ne(0).any().float()

    def decode(self, rows: Sequence[Sequence[float]]) -> tuple[Fp8Cast, ...]:
        """The records of the casts that ran, from the host copy of :meth:`collect`, in the order they ran (the
        forward's casts, then the backward's: the first non-finite one is where the non-finite values entered)."""
        casts = []
        for (module, role), (order, amax, scale, underflow, dynamic_range) in zip(self.names, rows):
            if not order >= 1:  # a cast that did not run this step (NaN)
                continue
            casts.append((order, Fp8Cast(module=module, role=role, amax=float(amax), scale=float(scale),
                                 underflow=None if math.isnan(underflow) else float(underflow),
                                 saturation=None,
                                 dynamic_range=None if math.isnan(dynamic_range) else float(dynamic_range))))
        return tuple(cast for _, cast in sorted(casts, key=lambda c: c[0]))

    @staticmethod
    def describe(cast: Fp8Cast) -> str:
        """``"blocks.3.mlp.fc1, grad_output: amax inf → scale 0"``: the message of a non-finite cast."""
        return f"{cast.module}, {cast.role}: amax {cast.amax:g} → scale {cast.scale:g}"

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._tapping:
            self._tapping = False
            _TAPS.disown(self)
            _TAPS.remove()
