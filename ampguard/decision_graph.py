"""The step decision, replayed from a CUDA graph (:class:`DecisionGraph`), and the fused fast path's
measurement of the gradients, replayed from one captured over the gradients' addresses
(:class:`MeasureGraph`).

On CUDA the decision is a few tens of tiny kernels (stop 52: 27 in bf16, 62 with a GradScaler, besides the norms;
~70 before it); captured once into a CUDA graph, each later step replays them in one launch (the fused path;
``AMPGUARD_CUDA_GRAPH=0`` keeps it eager). Elsewhere, and where capture fails, the decision runs eagerly.

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

import contextlib
import gc
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["DecisionGraph", "MeasureGraph", "captured"]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The garbage collector off for the length of a capture (process-wide: see the module docstring), back on
    after it only if it was on."""
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc_was_on:
            gc.enable()


def captured(fn: Callable[[], Any], stream: torch.cuda.Stream | None = None) -> tuple[Any, Any]:
    """``(graph, out)``: ``fn()``'s kernels recorded (not run) in a new CUDA graph, and what it returned (the graph's
    static output), with the garbage collector paused for the capture (module docstring). Recorded on a side stream
    (``stream``, or a new one on the current device) that first waits for the current stream, which then waits for
    it, with ``capture_error_mode="thread_local"``: not through ``torch.cuda.graph``, whose entry calls
    ``torch.cuda.synchronize()`` (a host sync in the step that captures; torch's sync debug mode does not flag it:
    the one sync stops 38-40's check counted was torch's own one-time notice, not this) and
    ``torch.cuda.empty_cache()`` (which hands every cached block back to the driver in the middle of a training
    step). Raises what the capture raises; the caller falls back to eager. No sync."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device) if stream is None else stream
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with _collector_paused(), torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return graph, out


class DecisionGraph:
    """The decision, replayed from a CUDA graph on CUDA (``AMPGUARD_CUDA_GRAPH=0``: eager): its few tens
    of tiny kernels become one launch. The first decision of the process runs eagerly (lazy init);
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


class MeasureGraph:
    """The measurement of the gradients on CUDA (per-tensor norms and their reductions; on the fused fast
    path of the still-scaled gradients, times ``1/scale``, with GradScaler's ``found_inf`` from them),
    replayed from a CUDA graph captured over the gradients where they lie. ``torch._foreach_norm`` over a
    model's gradients costs the host ~2.6 us a tensor (it makes one output tensor each; then they are
    stacked): 1.08 ms for GPT-2 350M's 292 on the H200's host, against ~17 us for a replay of the same
    kernels (``benchmarks/host_ops.py``, ``benchmarks/RESULTS.md``, "Stop 38").

    A replay reads the addresses it was captured on, so a graph is keyed by what it computes (``kind``),
    the gradients' dtype (one for all: the caller measures one (device, dtype) group) and every gradient's
    ``data_ptr`` (and the scale's, the count): it replays only when each gradient
    lies exactly where it lay at capture, which in a steady training loop (``zero_grad(set_to_none=True)``
    included) the caching allocator usually gives back step after step. A key is captured the second
    time it is seen (a first sighting runs eagerly; gradients that move every step are never captured, so
    they pay no capture; :attr:`MAX_KEYS_SEEN` sightings are remembered), at most :attr:`MAX_GRAPHS` graphs are
    kept (least recently used dropped), and a capture spends one of at most :attr:`MAX_CAPTURES` credits, which
    every run earns back at :attr:`CREDIT_PER_RUN` (captures that find no credit: eager). The capture is made on a
    side stream with ``capture_error_mode="thread_local"``, without ``torch.cuda.graph``'s synchronize
    and ``empty_cache`` (which would hand the cached blocks back and move the next backward's
    gradients). The replayed values are the eager ones, bit for bit (the same kernels on the same
    inputs). The shapes are not in the key (one attribute read a gradient): a gradient's shape is its parameter's
    (autograd and the ``.grad`` setter refuse any other), and a parameter's shape does not change under the
    optimizer, whose state has its shape; its dtype can (``model.to(torch.bfloat16)`` swaps ``param.data`` under the
    same Parameter), hence the dtype. A failed capture falls back to eager for good, with one warning. The
    outputs are the graph's own tensors, rewritten by the next replay: every consumer within the step copies them (the
    gathered vector, the report's payload)."""

    MAX_GRAPHS = 24
    """Graphs kept. The gradients of a steady CUDA loop take a few places in turn, and inside the transformers
    Trainer many: on an H100 (stop 42, ``benchmarks/gpu_graph_keys.py``) the bf16 fused step graph and the stages'
    measurement took three in turn, and two graphs kept, least recently used dropped, captured again every step (7
    captures in 24 steps); inside the Trainer (stop 62, ``benchmarks/results/gpu_stop62/fw_graph_keys.txt``) GPT-2
    124M's 98 small gradients took 18 places in a cycle of 18 steps, and with 4 kept (16 keys remembered) it never
    replayed. (Presumably the small blocks the Trainer's loop keeps across a step or two move them: the batch it
    prefetches, ``num_items_in_batch``, the loss and the clip's norm, which the CPU shows living into the next step,
    ``benchmarks/results/cpu_stop63/survivors.py``; the CUDA allocator's part is not traced.) A graph holds its
    outputs (a few floats a tensor: allocated memory, counted in a step's peak) and a private pool of the capture's
    small temporaries (reserved, not allocated: about one 2 MiB segment of the caching allocator's small pool for a
    measurement, so ~48 MiB reserved at most, where a loop's gradients take 24 places or more; a loop whose
    gradients take three holds three)."""
    MAX_KEYS_SEEN = 4 * MAX_GRAPHS
    """Keys seen once and remembered for their second sighting (oldest forgotten): more than a cycle's places, so a
    key comes back before it is forgotten."""
    MAX_CAPTURES = 32
    """Captures a guard may make in a row (its credits when it starts, and at most): a loop whose gradients take
    more places than :attr:`MAX_GRAPHS` would otherwise capture every step (a capture costs the host more than an
    eager run). At least :attr:`MAX_GRAPHS`, so that a cycle that fits them is captured in its second turn (with 8,
    stop 62's cycle of 18 would have taken ~1300 steps to be captured whole, at one capture in 128 runs)."""
    CREDIT_PER_RUN = 1 / 128
    """Credit each run earns back (replayed or eager), up to :attr:`MAX_CAPTURES`: at most one capture in 128 runs
    once the credits are spent. Before stop 44 the credits were for life: a long fp16 run whose gradients moved
    once in a while (each overflow arms forensics, whose hooks move them; an evaluation or a checkpoint between
    steps) spent its 8 captures in its first few such events and measured eagerly for the rest of the run."""

    def __init__(self, enabled: bool, what: str = "the gradient measurement",
                 switch: str = "AMPGUARD_CUDA_GRAPH=0") -> None:
        self.enabled = enabled
        self.what, self.switch = what, switch
        """What a failed capture's warning names, and the switch that silences it."""
        self._graphs: OrderedDict[tuple[Any, ...], tuple[Any, Any]] = OrderedDict()
        self._seen: OrderedDict[tuple[Any, ...], None] = OrderedDict()
        self._failed = False
        self._stream: torch.cuda.Stream | None = None
        self.captures = 0
        self.replays = 0
        self.credit = float(self.MAX_CAPTURES)
        """Captures this object may make now (:attr:`CREDIT_PER_RUN`)."""
        self.misses = 0
        """Runs since the last replay that ran eagerly (a key seen for the first time, or none left to capture)."""

    def try_again(self, tries: int, after: int) -> None:
        """After a rest (the caller's: it stopped running this object once ``misses`` reached ``after``): count the
        misses so that ``tries`` more runs without a replay bring them back to ``after``."""
        self.misses = after - tries

    @property
    def failed(self) -> bool:
        """A capture failed: every later run is eager."""
        return self._failed

    def run(self, kind: Hashable, fn: Callable[[], Any], grads: Sequence[torch.Tensor],
            scale: torch.Tensor | None = None) -> Any:
        """``fn()`` (its kernels read only ``grads`` and ``scale``; ``kind``, any hashable, names what it computes:
        one graph per kind and addresses), eagerly or replayed: see the class."""
        device = grads[0].device
        if not self.enabled or self._failed or not self.capturable(device):
            return fn()
        key = (kind, grads[0].dtype, 0 if scale is None else scale.data_ptr(), len(grads),
               *map(torch.Tensor.data_ptr, grads))
        self.credit = min(self.credit + self.CREDIT_PER_RUN, float(self.MAX_CAPTURES))
        hit = self._graphs.get(key)
        if hit is not None:
            self._graphs.move_to_end(key)
            hit[0].replay()
            self.replays += 1
            self.misses = 0
            return hit[1]
        if key not in self._seen or self.credit < 1:
            self.misses += 1
            self._seen[key] = None
            if len(self._seen) > self.MAX_KEYS_SEEN:
                self._seen.popitem(last=False)
            return fn()
        try:
            graph, out = self._capture(fn, device)
        except Exception as exc:  # capture is an optimisation: never fail a step over it
            self._failed = True
            warnings.warn(f"ampguard: CUDA graph capture of {self.what} failed ({exc}); running it eagerly (set "
                          f"{self.switch} to silence this)", RuntimeWarning, stacklevel=2)
            return fn()
        self.captures += 1
        self.credit -= 1
        self._seen.pop(key, None)
        self._graphs[key] = (graph, out)
        if len(self._graphs) > self.MAX_GRAPHS:
            self._graphs.popitem(last=False)
        graph.replay()
        self.replays += 1
        self.misses = 0
        return out

    @staticmethod
    def capturable(device: torch.device) -> bool:
        """Whether a graph can be captured on ``device`` (CUDA)."""
        return device.type == "cuda"

    def _capture(self, fn: Callable[[], Any], device: torch.device) -> tuple[Any, Any]:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.device(device):
            return captured(fn, self._stream)
