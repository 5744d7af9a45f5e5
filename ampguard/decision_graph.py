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

__all__ = ["DecisionGraph", "captured"]


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
                              stacklevel=7)  # run < decide < step < _eager's two wrappers < torch's step wrapper < loop
                return fn(gathered)
        _, graph, static_in, static_out = self._graph
        static_in.copy_(gathered)
        graph.replay()
        return static_out
