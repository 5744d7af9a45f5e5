"""Device-side statistics of one step, and the layout of the vectors that carry them.

Off the CPU everything here runs on the gradients' device with foreach kernels and never reads
a value back to the host: no ``.item()``, no ``bool(tensor)``, no data-dependent Python branch.
On the CPU (no device to wait for) :func:`local_vector` reads its 0-d inputs as host floats.

Per rank, one *local vector* of ``LOCAL_K`` floats is all-gathered each step (the one
collective per step). Every rank then derives the same *decision vector* from the
gathered ``[world_size, LOCAL_K]`` matrix, so every rank takes the same decision.
"""

from __future__ import annotations

import array
import dataclasses
import math
import operator
from collections import defaultdict
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any, Protocol

import torch

from .errors import GuardStateError
from .ops import TensorOps, device_constants
from .vocab import SkipReason

try:  # the helper clip_grad_norm_ itself uses; private, hence the fallback
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
except ImportError:  # pragma: no cover
    _group_tensors_by_device_and_dtype = None  # type: ignore[assignment]

_IS = operator.is_
_DTYPE = operator.attrgetter("dtype")
_IS_CUDA = operator.attrgetter("is_cuda")
_LAYOUT = operator.attrgetter("layout")

__all__ = [
    "DECISION_K",
    "LOCAL_K",
    "REASONS",
    "Dec",
    "GradGroups",
    "Loc",
    "LossMeter",
    "cpu_amax",
    "cpu_amax_ok",
    "cpu_norms",
    "grads_by_device_and_dtype",
    "host_tensor",
    "local_tensor",
    "local_vector",
    "origin_ranks",
    "per_tensor_norms",
    "sparse_values",
    "total_and_nonfinite",
]


def _count(layout: type) -> int:
    """How many slots a layout class names (its int attributes, numbered 0..n-1)."""
    slots = sorted(v for k, v in vars(layout).items() if k.isupper() and isinstance(v, int))
    if slots != list(range(len(slots))):  # pragma: no cover - layout invariant
        raise AssertionError(f"{layout.__name__}: slots {slots} are not 0..n-1")
    return len(slots)


# Plain int class attributes, not an IntEnum: the host reads these slots some forty times a step,
# and an IntEnum member's lookup costs about ten times a plain class attribute's.
class Loc:
    """Indices into the per-rank local vector."""

    LOSS = 0
    """The loss of this optimizer step on this rank (see ``GuardedOptimizer.observe_loss``)."""
    LOSS_NONFINITE = 1
    """1.0 when any micro-batch loss of this step was NaN/inf."""
    GRAD_NORM = 2
    """L2 norm of this rank's (unscaled) gradients, or of its shard (FSDP)."""
    NONFINITE_TENSORS = 3
    """Number of this rank's gradient tensors holding NaN/inf."""
    FOUND_INF = 4
    """GradScaler's found_inf summed over devices (0 without a scaler)."""
    PRE_REDUCTION = 5
    """1.0 when this rank's own contribution was non-finite before reduction."""
    NO_GRADS = 6
    """1.0 when no parameter received a gradient on this rank since the last step (a detached output)."""
    SENTINEL = 7
    """The sentinel's first non-finite slot this step (-1: none or off; 0: the model's input;
    k+1: block k), see :mod:`ampguard.forensics.sentinel`."""
    HEADROOM = 8
    """This rank's log2(65504 / max|scaled grad|) on a step sampled by ``GuardConfig.numerics_every``
    (fp16), NaN on other steps: the headroom scale policy decides on the minimum over ranks."""
    FP8_NONFINITE = 9
    """1.0 when one of this rank's torchao float8 casts had a non-finite amax or a non-finite or zero scale
    this step (:meth:`ampguard.fp8.Fp8Monitor.nonfinite`; 0 when fp8 monitoring is off)."""
    PARAMS_NONFINITE = 10
    """1.0 when this rank's parameters were non-finite after its last checked update
    (``GuardConfig.param_check_every``), carried into the next step's vector so every rank learns it on the same
    step (0 on one process, and where the check is off)."""


LOCAL_K = _count(Loc)


class Dec:
    """Indices into the decision vector (identical on every rank). Values first, then 0/1 flags,
    then the detectors' thresholds, so the vector is assembled with three stacks."""

    LOSS = 0  # mean loss over ranks
    GRAD_NORM = 1  # global gradient norm
    NONFINITE_TENSORS = 2  # summed over ranks
    CLIP_COEF = 3
    SCALE = 4
    NEXT_SCALE = 5
    REASON = 6  # index into REASONS
    SKIP = 7  # 1.0: the inner optimizer does not step
    LOSS_NONFINITE = 8  # any rank
    GRAD_NONFINITE = 9  # any rank (non-finite tensors or GradScaler found_inf)
    GRAD_SPIKE = 10
    LOSS_SPIKE = 11
    BACKOFF = 12  # 1.0 when the scale was backed off this step
    GROWTH = 13  # 1.0 when the scale grew this step
    FLOOR = 14  # 1.0 when a backoff hit min_scale
    NO_GRADS = 15  # 1.0 when some rank had no gradient at all
    REBASELINE = 16  # 1.0 when the spike detectors' statistics were re-based on a run of flagged steps
    ZCLIP_REBASELINE = 17  # 1.0 when ZClip's statistics were re-based on a run of clipped steps
    SPIKE_THRESHOLD = 18  # the norm above which a gradient spike is flagged (NaN: no gradient detector)
    CLIP_THRESHOLD = 19  # ZClip: the largest norm this step let through (NaN: ZClip off; inf: warm-up)


DECISION_K = _count(Dec)

#: ``Dec.REASON`` values, as written by :func:`ampguard.policies.decide`.
REASONS: tuple[SkipReason | None, ...] = (
    None, SkipReason.NONFINITE_LOSS, SkipReason.NONFINITE_GRAD, SkipReason.GRAD_SPIKE, SkipReason.LOSS_SPIKE,
    SkipReason.NO_GRADIENTS, SkipReason.NONFINITE_FP8,
)


@dataclasses.dataclass(slots=True)
class GradGroups:
    """The gradients of one step, grouped by (device, dtype) as ``clip_grad_norm_`` groups them,
    with the index (in ``param_groups`` order) of the parameter each gradient belongs to. The
    indices travel with the gradients through the grouping, so a norm can never be given the
    name of another parameter (frozen and unused parameters have no gradient and no entry)."""

    tensors: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
    index: list[int]
    """``index[k]`` is the parameter of the k-th norm of :func:`per_tensor_norms` (group order)."""
    own: bool = True
    """The tensors are the parameters' ``.grad`` objects themselves (not a shard's local tensor or
    a sparse gradient's values): their identities and version counters are the gradients'."""

    def with_index(self) -> Iterator[tuple[list[torch.Tensor], list[int]]]:
        """Each (device, dtype) group's gradients with their parameters' indices, in group order."""
        k = 0
        for grads in self.tensors.values():
            yield grads, self.index[k : k + len(grads)]
            k += len(grads)


def grads_by_device_and_dtype(params: Sequence[torch.Tensor]) -> GradGroups:
    """The params' gradients grouped exactly as ``clip_grad_norm_`` groups them (same helper,
    same order), so norms derived from them are bitwise clip_grad_norm_'s; each with the index
    of its parameter in ``params``."""
    return _grouped([p.grad for p in params])


def sparse_values(params: Sequence[torch.Tensor]) -> tuple[GradGroups, GradGroups] | None:
    """The params' gradients grouped as :func:`grads_by_device_and_dtype` groups them, each sparse
    one by its values, as GradScaler checks and unscales them: ``(views, coalesced)``. ``views``:
    the gradients' own values (a view: clipping them clips the gradient; uncoalesced ones are left
    so, as GradScaler leaves float32 ones, so the optimizer steps on what it would have); and
    ``coalesced``: the values of the coalesced gradients (duplicate indices summed: a copy where
    the gradient is not coalesced), whose norms are the gradients' norms. None when no gradient
    is sparse."""
    grads = [p.grad for p in params]
    if not any(g is not None and g.is_sparse for g in grads):
        return None
    views = [None if g is None else g._values() if g.is_sparse else g for g in grads]
    summed = [None if g is None else g.coalesce()._values() if g.is_sparse else g for g in grads]
    views_groups, summed_groups = _grouped(views), _grouped(summed)
    views_groups.own = summed_groups.own = False
    return views_groups, summed_groups


def _grouped(every: Sequence[torch.Tensor | None]) -> GradGroups:
    # Sharded (DTensor, FSDP2) gradients: this rank's shard, as a plain tensor sharing its storage.
    # Norms are then local (decide() adds the squares across ranks) and no op dispatches a collective.
    # Every step, on the host: each test below is one pass in C (map over an attribute getter) where it can be,
    # not a Python expression per gradient (GPT-2's 292 gradients: 95 -> 81 us on the 2-core CPU, stop 39).
    grads: list[torch.Tensor]
    if any(map(_IS, every, repeat(None))):
        present = [i for i, g in enumerate(every) if g is not None]
        grads = [every[i] for i in present]  # type: ignore[misc]
    else:  # every parameter has a gradient (the usual case)
        present, grads = list(range(len(every))), list(every)  # type: ignore[arg-type]
    if not grads:  # a backward that reached no parameter: nothing to group (torch's helper refuses [])
        return GradGroups({}, [])
    own = True
    if set(map(type, grads)) != {torch.Tensor}:
        grads = [local_tensor(g) for g in grads]
        own = False
    # One (device, dtype) for all (the usual case): the helper's answer, in order, without it. The three
    # attributes are each the same for all exactly when the triple is.
    if (len(set(map(_DTYPE, grads))) == 1 and len(set(map(_IS_CUDA, grads))) == 1
            and len(set(map(torch.Tensor.get_device, grads))) == 1):
        return GradGroups({(grads[0].device, grads[0].dtype): grads}, present, own)
    if _group_tensors_by_device_and_dtype is not None:
        # with_indices: the helper reports where each tensor came from, so the index survives
        # whatever order it groups in.
        grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
        tensors: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {
            key: list(ts[0]) for key, (ts, _) in grouped.items()  # type: ignore[arg-type,misc]
        }
        index = [present[k] for _, (_, idx) in grouped.items() for k in idx]
        return GradGroups(tensors, index, own)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)  # pragma: no cover
    where: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)  # pragma: no cover
    for i, g in zip(present, grads):  # pragma: no cover - torch without the helper
        groups[(g.device, g.dtype)].append(g)
        where[(g.device, g.dtype)].append(i)
    return GradGroups(dict(groups), [i for key in groups for i in where[key]])  # pragma: no cover


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) tensor, as a plain tensor sharing its storage; any
    other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def per_tensor_norms(groups: GradGroups, device: torch.device) -> torch.Tensor:
    """L2 norm of every gradient tensor, in group order, stacked on ``device``: a single read of
    the gradients.

    Off the CPU: one ``torch._foreach_norm`` per (device, dtype) group, the order and the kernels
    of ``torch.nn.utils.clip_grad_norm_``, so the total norm derived from this vector is bitwise
    the one clip_grad_norm_ would compute. On the CPU, float32 gradients: ``sqrt(dot(g, g))``
    (:func:`cpu_norms`), which is within float32 rounding of clip_grad_norm_'s, not bitwise.
    """
    parts: list[torch.Tensor] = []
    for (dev, dtype), grads in groups.tensors.items():
        if dev.type == "cpu" and dtype == torch.float32:
            n = cpu_norms(grads)
        else:
            n = torch.stack(torch._foreach_norm(grads, 2.0))  # one stack per group, no per-tensor copies
        if n.dtype != torch.float32:
            n = n.float()
        if dev != device:
            n = n.to(device=device, non_blocking=True)
        parts.append(n)
    if not parts:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def cpu_norms(grads: Sequence[torch.Tensor], unscale_by: torch.Tensor | None = None) -> torch.Tensor:
    """L2 norms of float32 CPU tensors as ``sqrt(dot(g, g))`` (BLAS, float32 accumulation).

    Why not ``_foreach_norm`` (as ``clip_grad_norm_``): on a 2-core x86 CPU, right after a
    backward, its reduction kernel took 3-5x as long as the dot product over the same gradients
    and left the fused optimizer's next pass over them slower (``benchmarks/RESULTS.md``, CPU).
    The dot product is also the more accurate of the two there (relative error against a float64
    norm: 2e-6..1e-5 for the dot, 1e-5..4e-5 for ``vector_norm``, on benchmarks/overhead.py's
    models). As with torch's kernels, the squares are summed in float32: a norm above ~1.8e19
    comes out infinite. Scaling by a power of two commutes with it exactly (barring over- or
    underflow), so the fused fast path's scaled norms times ``1/scale`` are these norms.

    ``unscale_by`` (a 0-d float32 tensor: GradScaler's ``1/scale``): also multiply each tensor in place by it right
    after its own dot, while it is still in the core's cache: the same norms (each dot reads the values before the
    multiply) and the same unscaled values as a ``_foreach_mul_(grads, unscale_by)`` after them (on the CPU that op
    is one ``mul_`` per tensor), for one pass over the gradients from main memory instead of two. On mlp-small's 8
    gradients right after a backward, on the 2-core CPU: 281-302 us against 320-336 for the norms then the multiply
    (stop 67, ``benchmarks/results/cpu_stop67/interleave_micro.py``, two runs). Dense tensors only
    (:func:`all_strided`): a sparse one fails its dot after the tensors before it were multiplied."""
    dot = torch.dot
    if unscale_by is None:
        # One flat view per gradient, not one per operand; ``flatten`` hands a 1-D tensor back as it is
        # (``reshape`` builds a view even then: ~1 us a tensor here). The same dot either way.
        return torch.stack([dot(f, f) for f in [g.flatten() for g in grads]]).sqrt_()
    squares = []
    for g in grads:
        f = g.flatten()
        squares.append(dot(f, f))
        g.mul_(unscale_by)
    return torch.stack(squares).sqrt_()


def all_strided(tensors: Sequence[torch.Tensor]) -> bool:
    """Every tensor dense (strided layout): none sparse, whose norms no kernel here takes."""
    return set(map(_LAYOUT, tensors)) == {torch.strided}


_CPU_AMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def cpu_amax_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`cpu_amax` takes tensors of this device and dtype (real floating point, on the CPU)."""
    return device.type == "cpu" and dtype in _CPU_AMAX_DTYPES


def cpu_amax(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """max|x| of each non-empty, dense, real CPU tensor (:func:`cpu_amax_ok`), stacked, as
    ``torch._foreach_norm(tensors, inf)`` gives it (a max is exact: the same value; NaN wherever a
    tensor holds one), from one ``aminmax`` per tensor: on the 2-core CPU ``_foreach_norm(inf)``
    took 2.8 ms over mlp-small's parameters (0.7M floats) where this takes 0.1 ms
    (benchmarks/RESULTS.md). No copy of a tensor. ``abs``: +0.0 for an all-zero tensor, as the norm
    gives it (``maximum(0.0, -0.0)`` may keep either zero). The parameter check
    (:func:`ampguard.integrity.amax_per_tensor`) and the sampled headroom (:mod:`ampguard.numerics`)."""
    pairs = [torch.aminmax(t) for t in tensors]
    return torch.maximum(torch.stack([mx for _, mx in pairs]), torch.stack([mn for mn, _ in pairs]).neg_()).abs_()


def host_tensor(values: Sequence[float]) -> torch.Tensor:
    """A float32 CPU tensor of ``values`` over a fresh array of its own: ``array("f")`` rounds each
    value to float32 (to nearest, as a float32 cast), and ``torch.frombuffer`` costs about half of
    ``torch.tensor`` parsing a list. The host decision's vector and the host local vector."""
    return torch.frombuffer(array.array("f", values), dtype=torch.float32)


def local_vector(
    *,
    loss: torch.Tensor | None,
    tensor_norms: torch.Tensor,
    found_inf: torch.Tensor | None,
    pre_reduction: torch.Tensor | None,
    device: torch.device,
    no_grads: bool = False,
    sentinel: torch.Tensor | None = None,
    headroom: torch.Tensor | None = None,
    fp8: torch.Tensor | None = None,
    params_bad: torch.Tensor | None = None,
    norm_share: float | None = None,
    host: bool | None = None,
    reductions: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Pack this rank's statistics into the ``LOCAL_K`` vector (:class:`Loc`). ``loss``: this
    step's loss on device (None: no loss was given for this step). ``no_grads``: no parameter
    received a gradient on this rank (known on the host, from the gradients' version counters).
    ``headroom``: this rank's sampled headroom (None: not sampled, NaN). ``fp8``: the fp8 monitor's
    non-finite flag (None: monitoring off, 0). ``params_bad``: this rank's parameters were non-finite after its
    last checked update (None: not known, 0). ``norm_share``: the factor on this rank's norm where several
    ranks hold the same gradient shard (HSDP: ``1/sqrt(replicas)``, so the sum of squares over ranks counts each
    shard once); None: 1. ``reductions``: :func:`total_and_nonfinite` of ``tensor_norms``, made already (on the
    device path only; None: made here).

    The layout is written once, here; ``host`` picks how its values are made: on the CPU
    (default there) read as host floats and packed by one buffer (a 0-d tensor read costs
    nothing there, and each tiny tensor op microseconds), elsewhere stacked on device (no sync).
    Both give the same float32 values; the total norm is the same torch reduction either way
    (bitwise ``clip_grad_norm_``'s)."""
    on_host = device.type == "cpu" if host is None else host
    x: _PackOps = _HOST if on_host else _DeviceOps(device)
    count = None
    total: torch.Tensor | None
    if reductions is not None and not on_host:
        total, count = reductions
    else:
        total = torch.linalg.vector_norm(tensor_norms, 2.0) if tensor_norms.numel() else None
    if total is not None and norm_share is not None:
        total = total * norm_share
    value = x.value(loss, math.nan)
    grad_norm = x.value(total, 0.0)
    return x.pack([
        value,  # Loc.LOSS
        x.const(0.0) if loss is None else x.nonfinite(value),  # Loc.LOSS_NONFINITE
        grad_norm,  # Loc.GRAD_NORM
        x.count_nonfinite(tensor_norms, grad_norm) if count is None else count,  # Loc.NONFINITE_TENSORS
        x.value(found_inf, 0.0),  # Loc.FOUND_INF
        x.value(pre_reduction, 0.0),  # Loc.PRE_REDUCTION
        x.const(1.0 if no_grads else 0.0),  # Loc.NO_GRADS
        x.value(sentinel, -1.0),  # Loc.SENTINEL
        x.value(headroom, math.nan),  # Loc.HEADROOM
        x.value(fp8, 0.0),  # Loc.FP8_NONFINITE
        x.value(params_bad, 0.0),  # Loc.PARAMS_NONFINITE
    ])


def total_and_nonfinite(norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The total norm of per-tensor ``norms`` (non-empty) and how many are not finite, on their device: the
    device path's :func:`local_vector` ops, by the same kernels."""
    return torch.linalg.vector_norm(norms, 2.0), _DeviceOps.count_nonfinite(norms, norms)


class _PackOps(Protocol):
    """How :func:`local_vector` makes its values: each is a host float (:class:`_HostOps`) or a 0-d
    tensor on the device (:class:`_DeviceOps`), one kind per execution."""

    def value(self, t: torch.Tensor | None, default: float) -> Any: ...
    def const(self, v: float) -> Any: ...
    def nonfinite(self, v: Any) -> Any: ...
    def count_nonfinite(self, norms: torch.Tensor, total: Any) -> Any: ...
    def pack(self, values: list[Any]) -> torch.Tensor: ...


class _HostOps:
    """:func:`local_vector`'s values as host floats, packed by one float32 buffer."""

    @staticmethod
    def value(t: torch.Tensor | None, default: float) -> float:
        return default if t is None else t.item()  # type: ignore[no-any-return]

    @staticmethod
    def const(v: float) -> float:
        return v

    @staticmethod
    def nonfinite(v: float) -> float:
        return 0.0 if math.isfinite(v) else 1.0

    @staticmethod
    def count_nonfinite(norms: torch.Tensor, total: float) -> float:
        # A non-finite tensor norm makes the total non-finite: only then are they counted.
        return 0.0 if math.isfinite(total) else float(sum(not math.isfinite(n) for n in norms.tolist()))

    pack = staticmethod(host_tensor)


_HOST = _HostOps()


class _DeviceOps:
    """:func:`local_vector`'s values as 0-d tensors on ``device``, stacked: no sync."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def value(self, t: torch.Tensor | None, default: float) -> torch.Tensor:
        # ShardedGradScaler's found_inf is [1]: every value is made 0-d
        return self.const(default) if t is None else t.to(self.device).reshape(())

    def const(self, v: float) -> torch.Tensor:
        c = device_constants(self.device)
        return c.nan if math.isnan(v) else {0.0: c.zero, 1.0: c.one, -1.0: c.minus_one}[v]

    nonfinite = staticmethod(TensorOps.nonfinite)  # a bool (two kernels, not torch.isfinite's four): pack makes it 0/1

    @staticmethod
    def count_nonfinite(norms: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        return TensorOps.nonfinite(norms).sum(dtype=torch.float32)  # exact: a count below 2**24

    @staticmethod
    def pack(values: list[torch.Tensor]) -> torch.Tensor:
        # Every part float32 first: torch.cat (under stack) copies mixed dtypes part by part, a copy (and on
        # CUDA a launch) each (the H200's profile of a guarded step: 11 narrow + copy_ a step), and concatenates
        # one dtype in one kernel. The same float32 values either way.
        return torch.stack([v if v.dtype == torch.float32 else v.float() for v in values])


class LossMeter:
    """The loss of the optimizer step being prepared, summed on device over its micro-batches.

    ``reduction="mean"`` (``opt.backward(loss)``: each micro-batch's loss is a full loss) reports
    the mean; ``"sum"`` (a framework that divides each micro-batch's loss by the accumulation steps
    before backward) reports the sum, which is then the loss of the whole batch. No sync.
    """

    __slots__ = ("count", "reduction", "total")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0
        self.reduction: str | None = None

    def check(self, reduction: str) -> None:
        """Raise, changing nothing, when ``reduction`` differs from this step's earlier losses'."""
        if self.reduction is not None and reduction != self.reduction:
            raise GuardStateError(
                f"this step's losses were given with reduction={self.reduction!r} and now {reduction!r}: give every "
                "micro-batch loss of one step the same way (opt.backward(loss) means 'mean'). Nothing was changed."
            )

    @staticmethod
    def kept(loss: torch.Tensor) -> torch.Tensor:
        """What :meth:`add` keeps of ``loss``: detached, float32, 0-d (no copy of a float32 scalar)."""
        detached = loss.detach()
        if detached.dtype != torch.float32:
            detached = detached.float()
        return detached if detached.dim() == 0 else detached.reshape(())

    def add(self, loss: torch.Tensor, reduction: str, kept: torch.Tensor | None = None) -> None:
        """``kept``: :meth:`kept` of ``loss``, already taken (before the backward: right after one, each
        tensor op costs several times as much on the CPU)."""
        self.check(reduction)
        detached = self.kept(loss) if kept is None else kept
        self.total = detached if self.total is None else self.total + detached
        self.count += 1
        self.reduction = reduction

    def value(self) -> torch.Tensor | None:
        if self.total is None or self.count == 1 or self.reduction == "sum":
            return self.total
        return self.total / self.count


def origin_ranks(rows: Sequence[Sequence[float]]) -> tuple[int, ...]:
    """Ranks where the non-finite values originated, from every rank's local vector (host floats)."""
    loss_bad = {r for r, row in enumerate(rows) if row[Loc.LOSS_NONFINITE] > 0}
    pre = {r for r, row in enumerate(rows) if row[Loc.PRE_REDUCTION] > 0}
    # Counted tensors first: with sharded (DTensor) gradients GradScaler's found_inf is already
    # reduced across ranks (DTensor's unscale all-reduces it), so only the counts are local.
    post = {r for r, row in enumerate(rows) if row[Loc.NONFINITE_TENSORS] > 0} or {
        r for r, row in enumerate(rows) if row[Loc.FOUND_INF] > 0
    }
    origin = loss_bad | pre
    # corrupted after reduction on some ranks only (when nothing was non-finite before it: with
    # sharded gradients a rank's bad contribution lands in whichever ranks own those shards)
    if post and not pre and len(post) < len(rows):
        origin |= post
    if not origin:
        origin = post
    return tuple(sorted(origin))
