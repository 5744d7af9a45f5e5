"""The one layout of a step's report vector: :func:`pack` on the device, :meth:`Layout.unpack`
once on the host.

Everything the host report needs from one step travels as ONE float32 vector (one copy)::

    decision (DECISION_K) | gathered (world x LOCAL_K) | norms (n) | numerics (0 or 2+G) | indicators (0 or 2M)
        | params (0 or P) | fp8 (0 or 5C)

- ``decision``: :class:`~ampguard.stats.Dec`, the same on every rank;
- ``gathered``: every rank's local vector (:class:`~ampguard.stats.Loc`), the step's one collective;
- ``norms``: this rank's per-tensor gradient norms, in ``GradGroups.index`` order;
- ``numerics``: a step sampled by ``GuardConfig.numerics_every``: :meth:`ampguard.numerics.Numerics.measure`;
- ``indicators``: a sampled step's leading indicators (:meth:`ampguard.indicators.Indicators.after_step`);
- ``params``: on a step checked by ``GuardConfig.param_check_every``, max|p| of every parameter after
  the update (:func:`ampguard.integrity.amax_per_tensor`), in ``param_groups`` order;
- ``fp8``: with fp8 monitoring on, every step, the ``[C, 5]`` rows of the model's C torchao float8 casts
  (:meth:`ampguard.fp8.Fp8Monitor.collect`), flattened.

:class:`Layout` is the header: the counts of each part, known on the host from shapes (nothing
extra rides the vector, no sync to learn them), kept beside the vector until it is decoded.
Every reader takes its slice from it: the report (:class:`Unpacked`) and the host decision's
one copy (:class:`HostCopy`, which brings the statistics section to the host before the decision
exists, so a host decision's payload is built from that copy, with nothing to copy again).
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .scaling import ScalerView
from .stats import DECISION_K, LOCAL_K

__all__ = ["HostCopy", "Landing", "Layout", "Packed", "Unpacked", "pack", "pinned_view", "unpacked_on_host"]


class Layout(NamedTuple):
    """The header of one step's payload: how many floats each part holds (see the module docstring).
    (Named tuples, here and below: built every step, and a tuple is built in C.)"""

    world: int
    """Ranks in the gathered matrix."""
    norms: int
    """Per-tensor norms (gradients this rank held)."""
    numerics: int = 0
    """The sampled numerics (0: not sampled)."""
    indicators: int = 0
    """The leading indicators (0: not sampled, or off)."""
    params: int = 0
    """The parameters' max|p| (0: not a checked step)."""
    fp8: int = 0
    """The fp8 casts' rows, flattened (0: fp8 monitoring off)."""

    @classmethod
    def of(cls, gathered: torch.Tensor, norms: torch.Tensor, numerics: torch.Tensor | None = None,
           indicators: torch.Tensor | None = None, params: torch.Tensor | None = None,
           fp8: torch.Tensor | None = None) -> Layout:
        return cls(gathered.shape[0], norms.numel(), 0 if numerics is None else numerics.numel(),
                   0 if indicators is None else indicators.numel(), 0 if params is None else params.numel(),
                   0 if fp8 is None else fp8.numel())

    @property
    def statistics(self) -> slice:
        """The section after the decision and before the indicators: what a host decision copies."""
        return slice(DECISION_K, DECISION_K + self.world * LOCAL_K + self.norms + self.numerics)

    @property
    def size(self) -> int:
        return self.statistics.stop + self.indicators + self.params + self.fp8

    def unpack(self, values: Sequence[float]) -> Unpacked:
        """Cut ``values`` (the whole vector, as host floats) into its parts, once."""
        if len(values) != self.size:  # internal: packed by pack() with this very header
            raise ValueError(f"payload of {len(values)} floats, its layout {self} says {self.size}")
        decision, rows, params = self.head(values)
        at = DECISION_K + self.world * LOCAL_K
        numerics_at = at + self.norms
        indicators_at = self.statistics.stop
        params_at = indicators_at + self.indicators
        return Unpacked(decision, rows, values[at:numerics_at], values[numerics_at:indicators_at],
                        values[indicators_at:params_at], params, values[params_at + self.params:])

    def head(self, values: Sequence[float]) -> tuple[Sequence[float], list[Sequence[float]], Sequence[float]]:
        """``(decision, rows, params)``: the parts of :meth:`unpack` that say whether a report asks for something
        (``ampguard.reporter.Reporter.quiet``), without the per-tensor norms and the other parts, so a read of them
        grows with the ranks and, on a checked step only, the parameters."""
        at = DECISION_K + self.world * LOCAL_K
        params_at = self.statistics.stop + self.indicators
        return (values[:DECISION_K], [values[k : k + LOCAL_K] for k in range(DECISION_K, at, LOCAL_K)],
                values[params_at:params_at + self.params])


class Unpacked(NamedTuple):
    """One step's payload on the host, cut by its :class:`Layout`."""

    decision: Sequence[float]
    """Indexed by :class:`~ampguard.stats.Dec`."""
    rows: list[Sequence[float]]
    """Every rank's local vector, indexed by :class:`~ampguard.stats.Loc`."""
    norms: Sequence[float]
    """This rank's per-tensor norms: the k-th is parameter ``GradGroups.index[k]``'s."""
    numerics: Sequence[float]
    """``[zero fraction, headroom, zero fraction per param group...]``, or empty."""
    indicators: Sequence[float]
    """``[module grad norms..., module update ratios...]``, or empty."""
    params: Sequence[float] = ()
    """max|p| of every parameter after the update (``param_groups`` order), or empty."""
    fp8: Sequence[float] = ()
    """The fp8 casts' rows, flattened (5 floats a cast, :meth:`ampguard.fp8.Fp8Monitor.collect`), or empty."""


class Landing:
    """A step graph's payload copied to the host by the graph itself (``AMPGUARD_EARLY_SKIP``, stop 59): each run of
    the graph copies the payload into ``pinned`` (a float32 device-to-host copy node) and records ``event`` (an
    external event node) after it, so the host launches no copy and records no event a step. Every run overwrites
    ``pinned``: its floats are copied out into :attr:`values`, the step's own, before the next run is launched
    (:meth:`synchronize`, by the pipeline; the graph's end passed long before on a step that launched its optimizer,
    forward and backward since) or when the reporter reads them first. The copy is one ``from_buffer_copy`` of a
    ctypes view made once a buffer: no tensor op (on the H100's host, stop 59, a landing filled by ``torch.empty`` and
    ``copy_`` put ~55 us into the step; stop 60 timed a new ctypes array and a ``memmove`` at 16-21 us there). The
    reporter takes a landing where it takes a copy's event (:meth:`query`, :meth:`synchronize`) and reads
    :attr:`values`."""

    __slots__ = ("event", "pinned", "values", "view")

    def __init__(self, pinned: torch.Tensor, event: Any, view: ctypes.Array[ctypes.c_float] | None = None) -> None:
        self.pinned, self.event = pinned, event
        self.view = view
        """A ctypes array over ``pinned``'s own floats (:func:`pinned_view`, made once a buffer by its owner), which
        :meth:`synchronize` copies in one call; None: made on the first fill."""
        self.values: ctypes.Array[ctypes.c_float] | None = None
        """The payload's floats once landed (a ctypes array: a sequence of Python floats); None before."""

    def query(self) -> bool:
        """Whether :attr:`values` holds the payload: copied now if the graph has passed its copy (no wait)."""
        if self.values is None and self.event.query():
            self._land()
        return self.values is not None

    def synchronize(self) -> None:
        """:attr:`values` filled, after a wait for the graph's copy if it is still on its way."""
        if self.values is None:
            self.event.synchronize()
            self._land()

    def _land(self) -> None:
        view = self.view
        if view is None:
            view = self.view = pinned_view(self.pinned)
        # one call: a new array of the view's type, a copy of its bytes (0.28 us on the 2-core CPU, warm, against
        # 0.99 for a new array and a memmove; stop 60 timed the fill at 16-21 us inside an H100 training step)
        self.values = view.__class__.from_buffer_copy(view)


def pinned_view(pinned: torch.Tensor) -> ctypes.Array[ctypes.c_float]:
    """A ctypes float array over a contiguous float32 host buffer's memory (no copy): valid while ``pinned`` lives,
    so its owner keeps both."""
    return (ctypes.c_float * pinned.numel()).from_address(pinned.data_ptr())


class Packed(NamedTuple):
    """A step's payload: the vector (on device, or on the host after a host decision) and its header."""

    vector: torch.Tensor
    layout: Layout
    landing: Landing | None = None
    """Where the step graph copies ``vector`` (the device payload) to the host itself; None: the reporter copies."""


def pack(decision: torch.Tensor, gathered: torch.Tensor, norms: torch.Tensor, numerics: torch.Tensor | None = None,
         indicators: torch.Tensor | None = None, params: torch.Tensor | None = None,
         fp8: torch.Tensor | None = None, *, copied: HostCopy | None = None) -> Packed:
    """The step's payload: one ``torch.cat`` of its parts, in :class:`Layout` order (no sync).
    ``copied``: a host decision's copy, whose statistics section is already on the host: the
    payload is then built there from it and the host ``decision`` (nothing copied twice, nothing
    to wait for); a sampled step's indicators, computed after the inner step, are then copied
    to the host (off the CPU: a wait for the inner step, on sampled steps only), and so are a checked
    step's ``params`` and the fp8 rows."""
    layout = Layout.of(gathered, norms, numerics, indicators, params, fp8)
    if copied is None or copied.statistics is None:
        parts = [decision, *_statistics(gathered, norms, numerics)]
    else:
        parts = [decision, copied.statistics]
        indicators = None if indicators is None else indicators.float().cpu()
        params = None if params is None else params.float().cpu()
        fp8 = None if fp8 is None else fp8.float().cpu()
    parts += [t.reshape(-1).to(parts[0].device) for t in (indicators, params, fp8) if t is not None]
    return Packed(torch.cat(parts), layout)


def unpacked_on_host(decision: torch.Tensor, gathered: torch.Tensor, norms: torch.Tensor,
                     numerics: torch.Tensor | None = None, indicators: torch.Tensor | None = None,
                     params: torch.Tensor | None = None, fp8: torch.Tensor | None = None) -> Unpacked:
    """What :meth:`Layout.unpack` reads back from :func:`pack`'s vector, made from the parts themselves
    when every one is a CPU tensor (the CPU's host decision): a ``tolist`` a part, where :func:`pack` would
    concatenate them into a new tensor for the report to read back as a list (``benchmarks/RESULTS.md``,
    "Stop 36"). The same values: :func:`pack`'s ``cat`` widens each part to the widest dtype, which changes
    no value of a narrower float part."""
    def host(t: torch.Tensor | None) -> list[float]:
        return [] if t is None else t.reshape(-1).tolist()  # type: ignore[no-any-return]

    return Unpacked(decision.tolist(), gathered.float().tolist(), norms.tolist(), host(numerics), host(indicators),
                    host(params), host(fp8))


def _statistics(gathered: torch.Tensor, norms: torch.Tensor, numerics: torch.Tensor | None) -> list[torch.Tensor]:
    """The statistics section's parts, in :class:`Layout` order (:func:`pack` and :class:`HostCopy`)."""
    parts = [gathered.reshape(-1).float(), norms]
    if numerics is not None:
        parts.append(numerics.to(norms.device))
    return parts


@dataclasses.dataclass(slots=True)
class HostCopy:
    """What a host decision reads, brought to the host in one copy (off the CPU: the step's one
    sync): the payload's statistics section (gathered matrix, this rank's norms and sampled
    numerics, :attr:`Layout.statistics`), and the scaler's scale and growth tracker (so the
    decision reads no device tensor one value at a time)."""

    gathered: torch.Tensor
    """``[world_size, LOCAL_K]`` float32, on the CPU."""
    statistics: torch.Tensor | None
    """The payload's statistics section, on the CPU (None where nothing was copied: the CPU,
    where :func:`pack` lays it out from the tensors themselves)."""
    view: ScalerView | None
    """The scaler's view, its scale and growth tracker as CPU tensors (None without a scaler)."""

    @classmethod
    def read(cls, gathered: torch.Tensor, norms: torch.Tensor, numerics: torch.Tensor | None,
             view: ScalerView | None, device: torch.device, *, copy: bool | None = None) -> HostCopy:
        """``norms``, ``numerics``: the step's per-tensor norms and sampled numerics (None: not
        sampled). ``copy``: bring the values over in
        one copy (default: unless they are on the CPU already; a test forces it on CPU tensors to
        run the path CUDA takes)."""
        if not (gathered.device.type != "cpu" if copy is None else copy):
            return cls(gathered, None, view)
        flat = cls.flat(gathered, norms, numerics, view, device).cpu()  # SYNC off the CPU: the one
        return cls.of_flat(flat, gathered, norms, numerics, view)

    @staticmethod
    def flat(gathered: torch.Tensor, norms: torch.Tensor, numerics: torch.Tensor | None, view: ScalerView | None,
             device: torch.device) -> torch.Tensor:
        """What :meth:`read` copies, on ``device``, in one vector: the statistics section, then the scale and
        the growth tracker as float32 (:meth:`of_flat` cuts it). No sync."""
        parts = _statistics(gathered, norms, numerics)
        if view is not None:
            parts.append(view.scale.reshape(1).float())
            if _exact(view):
                parts.append(view.growth_tracker.reshape(1).float())
        return torch.cat([p.to(device, non_blocking=True) for p in parts])

    @classmethod
    def of_flat(cls, flat: torch.Tensor, gathered: torch.Tensor, norms: torch.Tensor, numerics: torch.Tensor | None,
                view: ScalerView | None) -> HostCopy:
        """The copy from :meth:`flat`'s vector on the host (``gathered``, ``norms``, ``numerics``, ``view``: what
        it was made of, for the sizes and the scaler's factors)."""
        n = gathered.numel() + norms.numel() + (0 if numerics is None else numerics.numel())
        if view is not None:
            tracker = flat[n + 1 :].int() if _exact(view) else view.growth_tracker.reshape(1).cpu()
            view = ScalerView(flat[n : n + 1], tracker, view.growth_factor, view.backoff_factor, view.growth_interval)
        return cls(flat[: gathered.numel()].view(gathered.shape), flat[:n], view)


def _exact(view: ScalerView) -> bool:
    """The growth tracker (< growth_interval) rides the host copy as a float32, exact up to 2**24; a larger interval
    (not a realistic one) reads it on its own."""
    return view.growth_interval <= 2**24
