"""The step decision, replayed from a CUDA graph (:class:`DecisionGraph`).

On CUDA the decision is ~70 tiny kernels; captured once into a CUDA graph, each later step
replays them in one launch (the fused path; ``AMPGUARD_CUDA_GRAPH=0`` keeps it eager). Elsewhere, and where
capture fails, the decision runs eagerly.

**A process-wide effect, kept because it is necessary:** the Python garbage collector is off
while the decision is captured (``gc.disable()``, restored in ``finally``, and only if it was on).
A collection inside the capture frees whatever cyclic garbage is about, and a destructor that
calls CUDA (a freed tensor's allocator call, an event) invalidates the capture: seen on an H200,
torch 2.11, ``tests/gpu/test_gpu.py`` ("operation failed due to a previous error during
capture" with the collector on, a clean capture with it off). torch's ``torch.cuda.graph`` does
not switch it off itself. Safe: the capture records a few dozen kernels (milliseconds), happens
once per process and configuration (the second fused decision, and again only if the gathered
shape or the scaler's factors change), and a collection the pause skips runs at the next
allocation threshold after it.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DecisionGraph", "MeasureGraph", "captured"]


def captured(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``(graph, out)``: ``fn()``'s kernels recorded (not run) in a new CUDA graph, and what it returned (the graph's
    static output), with the garbage collector paused for the capture (module docstring). Raises what the capture
    raises; the caller falls back to eager. A one-time sync."""
    gc_was_on = gc.isenabled()
    graph = torch.cuda.CUDAGraph()
    gc.disable()  # process-wide, for the capture only: see the module docstring
    try:
        with torch.cuda.graph(graph):
            out = fn()
    finally:
        if gc_was_on:
            gc.enable()
    return graph, out


class DecisionGraph:
    """The decision, replayed from a CUDA graph on CUDA (``AMPGUARD_CUDA_GRAPH=0``: eager): ~70 tiny
    kernels become one launch. The first decision of the process runs eagerly (lazy init);
    capture happens on the next one. A failed capture falls back to eager, with one warning."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._graph: tuple[Any, Any, torch.Tensor, Any] | None = None
        self._failed = False
        self._ran_eagerly = False

    def run(self, fn: Callable[[torch.Tensor], Any], gathered: torch.Tensor, key: Any) -> Any:
        if gathered.device.type != "cuda" or not self.enabled or self._failed:
            return fn(gathered)
        key = (tuple(gathered.shape), key)
        if self._graph is None or self._graph[0] != key:
            if not self._ran_eagerly:
                self._ran_eagerly = True
                return fn(gathered)
            try:
                static_in = gathered.clone()
                graph, static_out = captured(lambda: fn(static_in))
                self._graph = (key, graph, static_in, static_out)
            except Exception as exc:  # capture is an optimisation: never fail a step over it
                self._failed = True
                warnings.warn(f"ampguard: CUDA graph capture of the step decision failed ({exc}); running it "
                              "eagerly (set AMPGUARD_CUDA_GRAPH=0 to silence this)", RuntimeWarning,
                              stacklevel=4)
                return fn(gathered)
        _, graph, static_in, static_out = self._graph
        static_in.copy_(gathered)
        graph.replay()
        return static_out


class MeasureGraph:
    """The step's measurement, replayed from CUDA graphs on CUDA: the per-tensor norms of the gradients (the fused
    fast path's ``1/scale`` and ``found_inf`` with them) and this rank's local vector, ~20 eager ops and their
    launches, become one launch (:meth:`ampguard.pipeline.StepPipeline.measure_gather`).

    The gradients are read where they lie: a graph is keyed by the host-only facts that fix what its kernels read
    (the gradients' addresses, the scale's, which optional inputs are present and their shapes) and replays only
    while the step's gradients sit at those addresses. The tensor inputs (the loss, the sentinel's value, the fp8
    flag...) are copied into the graph's own buffers first. A key is captured when it comes back within
    :attr:`RECENT` steps (its first step runs eagerly: lazy initialisation; gradients whose addresses never repeat
    are never captured); at most :attr:`MAX_CAPTURES` captures a process (then eager: an allocator that keeps
    moving the gradients would cost a capture a step) and :attr:`KEEP` graphs kept. Each capture is one host sync,
    so a run pays at most :attr:`MAX_CAPTURES` of them, in the steps where the gradients' addresses settle. A failed
    capture falls back to eager, with one warning. The outputs are the graph's static tensors, overwritten by the
    next replay: what a step hands on (the payload, the decision's input) is copied on the stream before that."""

    MAX_CAPTURES = 8
    KEEP = 4
    RECENT = 4

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._graphs: dict[Any, tuple[Any, tuple[torch.Tensor | None, ...], Any]] = {}
        self._seen: list[Any] = []
        """The last :attr:`RECENT` keys run eagerly: a key is captured when seen again among them (the allocator
        may hand a step's gradients a few address sets in turn: the reports in flight hold memory for two steps)."""
        self._captures = 0
        self._failed = False
        self.error: str | None = None
        """Why the capture failed (None: it did not)."""
        self.eager = 0
        """Steps measured eagerly through :meth:`run` (a key not captured)."""
        self.replays = 0
        """Steps measured by a replay (tests and benchmarks read it)."""

    @property
    def usable(self) -> bool:
        """Worth building a key for (on CUDA, the caller checks the device)."""
        return self.enabled and not self._failed and (self._captures < self.MAX_CAPTURES or bool(self._graphs))

    def run(self, fn: Callable[..., Any], inputs: tuple[torch.Tensor | None, ...], key: Any) -> Any:
        """``fn(*inputs)``, from a graph where ``key`` (with the inputs' shapes) has one, or is seen a second time."""
        if self._failed:
            return fn(*inputs)
        key = (key, tuple(None if t is None else (t.shape, t.dtype, t.device) for t in inputs))
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen or self._captures >= self.MAX_CAPTURES:
                self._seen = [*self._seen[1 - self.RECENT:], key]
                self.eager += 1
                return fn(*inputs)
            try:
                static = tuple(None if t is None else t.clone() for t in inputs)
                graph, out = captured(lambda: fn(*static))
            except Exception as exc:  # capture is an optimisation: never fail a step over it
                self._failed = True
                self.error = repr(exc)
                self._graphs.clear()
                warnings.warn(f"ampguard: CUDA graph capture of the step's measurement failed ({exc}); running it "
                              "eagerly (set AMPGUARD_CUDA_GRAPH=0 to silence this)", RuntimeWarning, stacklevel=4)
                return fn(*inputs)
            self._captures += 1
            if len(self._graphs) >= self.KEEP:
                del self._graphs[next(iter(self._graphs))]  # the oldest: its pool goes with it
            entry = self._graphs[key] = (graph, static, out)
        graph, static, out = entry
        for s, t in zip(static, inputs):
            if s is not None:
                s.copy_(t)  # type: ignore[arg-type]
        graph.replay()
        self.replays += 1
        return out
