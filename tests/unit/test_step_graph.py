"""The step graph (``AMPGUARD_STEP_GRAPH=1``, ``StepPipeline.measure``'s ``decide``): on the fused fast path with
the tensor decision and one rank, the measurement goes on to the local vector and the decision in one execution,
replayed as one CUDA graph. On the CPU, with the tensor decision forced (as CUDA takes it) and the capture
replaced by a stand-in whose ``replay()`` runs the captured function again into the captured outputs (as a CUDA
graph's replay runs its kernels again into its static tensors), a guarded run with it is the run without it,
bit for bit: weights, every report, through genuine fp16 overflows, ZClip's clipping, the z-score detector's
state, sampled numerics steps that fall back to the separate stages, and a loss whose address moves. The real
capture is tests/gpu/test_gpu_step_graph.py's.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
from unittest import mock

import pytest
import torch
from torch.amp.grad_scaler import OptState

import ampguard
from ampguard import pipeline
from ampguard.pipeline import STEP_GRAPH_MISSES
from ampguard.stats import LossMeter

from ._graphs import StandInGraphs
from ._models import loss_of, make_data, make_model

CONFIG = {"spikes": {"grad_zscore": 3.0, "warmup": 3, "action": "skip"}, "zclip": {"warmup": 3},
          "param_norms_every": 1, "numerics_every": 5}
OVERFLOW_STEPS = {4, 9, 10}  # the loss times 2**14: the fp16 backward overflows (scaled by GradScaler's 2**10)
NAN_STEP = 7  # bf16: a genuine NaN (LayerNorm with eps=0 over a constant row)


class _Graphs(StandInGraphs):
    """The step graph's stand-in: its capture puts back the ``state`` its shape-finding run wrote."""

    def __init__(self, state: list[torch.Tensor], fail: bool = False) -> None:
        super().__init__(fail, "the step from the gradients to the decision", "AMPGUARD_STEP_GRAPH=0", state=state)


class _SteadyScaler(torch.amp.GradScaler):
    """GradScaler whose ``unscale_`` leaves its per-device ``found_inf`` in one tensor per device (copied there),
    where torch's leaves a new copy each step: on CUDA the caching allocator gives a steady loop's small tensors
    back at their addresses, on the CPU malloc does not, and the host decision's step graph reads ``found_inf``
    where it lies. Otherwise torch's ``unscale_`` line for line. ``addresses``: how many places it takes in turn."""

    addresses = 1

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        assert state["stage"] is OptState.READY
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        found = self._unscale_grads_(optimizer, inv_scale, found_inf, False)  # per device: copies of found_inf
        places = self.__dict__.setdefault("_places", [{} for _ in range(self.addresses)])
        self._turn = getattr(self, "_turn", -1) + 1
        steady = places[self._turn % len(places)]  # in turn among ``addresses`` places
        state["found_inf_per_device"] = {dev: steady.setdefault(dev, torch.zeros_like(t)).copy_(t)
                                         for dev, t in found.items()}
        state["stage"] = OptState.UNSCALED


def _state(pipe: Any) -> list[torch.Tensor]:
    """What the step writes in place: the carried state, GradScaler's scale and growth tracker (if any)."""
    scaler = pipe.adapter.scaler if pipe.adapter is not None else None
    return [*(getattr(o, f.name) for o in (pipe.spikes, pipe.scale_state) for f in dataclasses.fields(o)),
            *(() if scaler is None else (scaler._scale, scaler._growth_tracker))]


def _count_through(pipe: Any, graphs: _Graphs) -> None:
    """``graphs.taken``: the steps that went through one of the step graph's functions (fused, unscaled, host copy),
    counted by wrapping them on ``pipe``."""
    graphs.taken = 0  # type: ignore[attr-defined]

    def counted(fn: Any) -> Any:
        def call(*args: Any) -> Any:
            graphs.taken += 1  # type: ignore[attr-defined]
            return fn(*args)
        return call
    for name in ("_through_decision", "_through_unscaled", "_through_host_copy"):
        setattr(pipe, name, counted(getattr(pipe, name)))


def _run(step_graph: bool, steps: int = 16, addresses: int = 1, bf16: bool = False, fail: bool = False,
         fused: bool = True, moving: int = 0, sentinel: bool = False) -> tuple[list[torch.Tensor], Any, Any]:
    """A guarded run. On the CPU a tensor's address is malloc's choice: the gradients are kept (zeroed in place)
    and the kept loss is copied into one of ``addresses`` buffers in turn, so that keys repeat as they do on
    CUDA's caching allocator (a CUDA loop's loss and gradients usually lie where they lay). ``bf16``: no
    GradScaler, a LayerNorm with ``eps=0`` first, and a batch with a constant row at NAN_STEP (its variance 0: a
    genuine NaN). ``fused=False``: foreach AdamW, the host decision as CUDA takes it (``host_copies``), fp16 with
    :class:`_SteadyScaler`. ``moving``: the first ``moving`` steps' gradients kept alive and set to None, so that
    each of those backwards writes new ones elsewhere (keys that do not repeat). ``sentinel``: ``sentinel="top"``
    (its value one more held input of the step graph since stop 55)."""
    model = make_model(0)
    if bf16:
        model = torch.nn.Sequential(torch.nn.LayerNorm(8, eps=0.0, elementwise_affine=False), *model)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, **({"fused": True} if fused else {"foreach": True}))
    scaler = None if bf16 else (torch.amp.GradScaler if fused else _SteadyScaler)("cpu", init_scale=2.0**10,
                                                                                  growth_interval=3)
    with mock.patch.dict(os.environ, {"AMPGUARD_STEP_GRAPH": "1" if step_graph else "0"}):  # read at wrap time
        opt = ampguard.wrap(inner, model=model, precision="bf16" if bf16 else "fp16", scaler=scaler,
                            config={**CONFIG, "sentinel": "top"} if sentinel else CONFIG)
    pipe = opt._pipeline
    if fused:
        pipe.host_decision = False  # the tensor decision, as on CUDA
    else:
        pipe.host_copies = True  # the host decision as CUDA takes it: the local vector on device, one copy
    opt._lagged_reports = True  # and its reports decoded steps later, as on CUDA (graph outputs rewritten meanwhile)
    graphs = None
    if step_graph:
        graphs = pipe.step_graph = _Graphs(_state(pipe), fail)
        _count_through(pipe, graphs)
    buffers = [torch.zeros(()) for _ in range(addresses)]
    at = [0]
    held: list[Any] = []

    def kept(loss: torch.Tensor) -> torch.Tensor:
        buf = buffers[at[0] % addresses]
        at[0] += 1
        return buf.copy_(loss.detach().reshape(()))

    with mock.patch.object(LossMeter, "kept", staticmethod(kept)):
        for i, (x, y) in enumerate(make_data(steps)):
            if bf16 and i == NAN_STEP:
                x = x.clone()
                x[0] = 1.0  # a constant row: LayerNorm(eps=0) divides 0 by 0
            with opt.autocast():
                loss = loss_of(model, x, y) * (2.0**14 if i in OVERFLOW_STEPS and not bf16 else 1.0)
            opt.backward(loss)
            opt.step()
            if i < moving:
                held.extend(p.grad for p in model.parameters())
            opt.zero_grad(set_to_none=i < moving)
    opt.flush()
    return [p.detach().clone() for p in model.parameters()], opt, graphs


def _reports(opt: Any) -> list[str]:
    """Each report's fields (NaN compares equal to NaN here; the shortest repr of a float is its bits)."""
    return [repr(dataclasses.astuple(dataclasses.replace(r, wall_time=0.0))) for r in opt.history]


def test_a_run_through_the_step_graph_is_the_run_without_it_bit_for_bit() -> None:
    want, plain, _ = _run(step_graph=False, steps=15)  # the last step (14) through the step graph
    got, guarded, graphs = _run(step_graph=True, steps=15)
    assert graphs.captures >= 1 and graphs.replays >= 8  # the steps went through the graph
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)
    assert not guarded.scaler._per_optimizer_states  # GradScaler's per-iteration records cleared, as its update does
    reports = guarded.history
    assert {r.step for r in reports if r.skipped} >= OVERFLOW_STEPS  # genuine overflows, skipped
    assert any(r.clip_coef < 1.0 for r in reports)  # ZClip clipped
    assert any(r.grad_zero_fraction is not None for r in reports)  # sampled numerics steps (the stages apart)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_a_sentinel_goes_through_the_step_graph_and_names_the_block_on_the_step(bf16: bool) -> None:
    """``sentinel="top"``: its value (which block's output went non-finite first) is one more of the step graph's
    held inputs (before stop 55 a sentinel kept every step on the stages apart). The run is the run without the step
    graph, bit for bit, and a genuine NaN (bf16: LayerNorm with eps=0 over a constant row) or overflow is named
    where the stages name it, on its own step."""
    want, plain, _ = _run(step_graph=False, steps=15, bf16=bf16, sentinel=True)
    got, guarded, graphs = _run(step_graph=True, steps=15, bf16=bf16, sentinel=True)
    assert graphs.taken >= 10 and graphs.captures >= 1 and graphs.replays >= 8, (graphs.taken, graphs.replays)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)
    named = [(a.step, a.module, a.phase) for a in guarded.anomalies if a.module is not None]
    assert named == [(a.step, a.module, a.phase) for a in plain.anomalies if a.module is not None]
    if bf16:
        assert (NAN_STEP, "0", "forward") in named  # the LayerNorm, block "0", on the NaN's own step


def test_without_a_scaler_the_run_is_the_run_without_it_bit_for_bit() -> None:
    """bf16, no GradScaler: the norms of the gradients as they are, the vector, the decision and the payload in
    one replay; a genuine NaN (LayerNorm with eps=0 over a constant row) skipped, the same as without it."""
    want, plain, _ = _run(step_graph=False, steps=15, bf16=True)
    got, guarded, graphs = _run(step_graph=True, steps=15, bf16=True)
    assert graphs.captures >= 1 and graphs.replays >= 8
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)
    assert guarded.history[NAN_STEP].skipped and not guarded.history[NAN_STEP - 1].skipped


@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_a_loss_that_moves_is_measured_where_it_lies(bf16: bool) -> None:
    """The loss in two places by turns (a user's forward allocates it where the allocator says): its value copied
    into the graph's own buffer each step (``StepPipeline._hold``), one key (two captures with its address in the
    key, as before stop 41; on CUDA the keys then cycled over more places than the graph keeps), each replay
    deciding on its own step's loss (a stale buffer would decide on the step before's: other losses, other
    spike flags, other reports)."""
    want, plain, _ = _run(step_graph=False, addresses=2, bf16=bf16)
    got, guarded, graphs = _run(step_graph=True, addresses=2, bf16=bf16)
    assert graphs.captures == 1 and graphs.replays >= 8
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_the_host_decisions_step_graph_is_the_run_without_it_bit_for_bit(bf16: bool) -> None:
    """A non-fused optimizer (foreach AdamW) decides on the host: after GradScaler's own unscale, the norms, the
    local vector, the gather and the host copy's vector in one replay (found_inf and the loss copied into the
    graph's buffers), then the one copy and the host decision, as without it, bit for bit."""
    want, plain, _ = _run(step_graph=False, steps=15, bf16=bf16, fused=False)
    got, guarded, graphs = _run(step_graph=True, steps=15, bf16=bf16, fused=False)
    assert graphs.captures >= 1 and graphs.replays >= 8 and graphs.taken >= 10
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)
    skipped = {r.step for r in guarded.history if r.skipped}
    assert (NAN_STEP in skipped) if bf16 else skipped >= OVERFLOW_STEPS


def test_found_inf_that_moves_is_read_where_it_lies(monkeypatch: pytest.MonkeyPatch) -> None:
    """GradScaler's found_inf in two places by turns (on CUDA a new tensor each unscale_, whose address seldom
    repeats: the graph keyed by it was never captured there): its value copied into the graph's own buffer each
    step, one key (two captures with the address in the key, as before), each replay the run without it. (The
    value is also in the norms' non-finite count: a stale copy would not show here.)"""
    monkeypatch.setattr(_SteadyScaler, "addresses", 2)
    want, plain, _ = _run(step_graph=False, fused=False)
    got, guarded, graphs = _run(step_graph=True, fused=False)
    assert graphs.captures == 1 and graphs.replays >= 8
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)


def test_a_non_fused_optimizer_never_takes_the_tensor_decisions_graph() -> None:
    """foreach AdamW with torch's own GradScaler on the CPU reads its norms first (``norms_first``: the fast
    path's measurement, then ``_foreach_mul_``), and decides on the host: with CUDA's host path forced
    (``host_copies``) and the step graph on, that measurement must not go on to the tensor decision (it did in a
    first draft: the scale written before the ``_foreach_mul_`` read it), and the host copy is the one copy."""
    runs = []
    for step_graph in (False, True):
        model = make_model(0)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        with mock.patch.dict(os.environ, {"AMPGUARD_STEP_GRAPH": "1" if step_graph else "0"}):
            opt = ampguard.wrap(inner, model=model, precision="fp16", scaler=scaler, config=CONFIG)
        pipe = opt._pipeline
        assert pipe.norms_first and pipe.host_decision
        pipe.host_copies = True
        taken: list[int] = []
        pipe._through_decision = lambda *a, _t=taken, _f=pipe._through_decision: _t.append(1) or _f(*a)
        for i, (x, y) in enumerate(make_data(12)):
            with opt.autocast():
                loss = loss_of(model, x, y) * (2.0**14 if i in OVERFLOW_STEPS else 1.0)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        opt.flush()
        assert not taken
        runs.append(([p.detach().clone() for p in model.parameters()], _reports(opt), opt.get_scale()))
    (want, want_reports, want_scale), (got, reports, scale) = runs
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and reports == want_reports and scale == want_scale


def test_keys_that_never_repeat_give_the_step_graph_up() -> None:
    """Gradients at new addresses every step: every run of the step graph is a first sighting, eager (the vector
    and the decision without their graphs); after STEP_GRAPH_MISSES of them the guard stops taking it, and the
    stages' own graphs take over. The run is the run without it throughout."""
    want, plain, _ = _run(step_graph=False, moving=24, steps=24)
    got, guarded, graphs = _run(step_graph=True, moving=24, steps=24)
    assert graphs.replays == 0 and graphs.misses == graphs.taken == STEP_GRAPH_MISSES  # then no more runs
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)


def test_a_step_graph_given_up_is_tried_again_once_the_keys_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients at new addresses for the first 18 steps (an allocator still settling longer than
    STEP_GRAPH_MISSES runs; before stop 41 a guard then gave the step graph up for good): given up after
    STEP_GRAPH_MISSES runs, tried again after STEP_GRAPH_REST steps (3 here), then captured and replayed on the
    steady steps; the run is the run without it throughout."""
    monkeypatch.setattr(pipeline, "STEP_GRAPH_REST", 3)
    want, plain, _ = _run(step_graph=False, moving=18, steps=32)
    got, guarded, graphs = _run(step_graph=True, moving=18, steps=32)
    assert graphs.captures == 1 and graphs.replays >= 8, (graphs.captures, graphs.replays, graphs.misses)
    assert graphs.taken < 32  # it rested
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)


def test_a_start_whose_gradients_move_for_ten_steps_keeps_the_step_graph() -> None:
    """Gradients at new addresses for the first 10 steps (9 misses among the steps it takes), then steady: what
    fp16 foreach AdamW from a scale that overflows did on an H100 (stop 42, ``benchmarks/gpu_graph_keys.py``: 8
    new places in its first 8 steps, then 2 by turns). With STEP_GRAPH_MISSES at 8 that guard rested from step 8
    for STEP_GRAPH_REST steps and missed the steady loop's start; the step graph is now taken throughout and
    replays from the first key seen twice."""
    want, plain, _ = _run(step_graph=False, moving=10, steps=24)
    got, guarded, graphs = _run(step_graph=True, moving=10, steps=24)
    sampled = len(range(0, 24, CONFIG["numerics_every"]))  # sampled numerics steps keep the stages apart
    assert graphs.taken == 24 - sampled and graphs.captures == 1 and graphs.replays >= 8, (
        graphs.taken, graphs.captures, graphs.replays, graphs.misses)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)


def test_a_failed_capture_warns_once_and_the_stages_take_over() -> None:
    with pytest.warns(RuntimeWarning, match="capture of the step from the gradients to the decision failed"):
        got, guarded, graphs = _run(step_graph=True, fail=True)
    want, plain, _ = _run(step_graph=False)
    assert graphs.failed and graphs.captures == 0 and graphs.taken == 2  # the first sighting, the failed capture
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)


def test_on_by_default_and_not_taken_on_the_host_decision() -> None:
    model = make_model(0)
    with mock.patch.dict(os.environ, {"AMPGUARD_STEP_GRAPH": "0"}):
        opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), fused=True), model=model, precision="fp16")
    assert not opt._pipeline.step_graph.enabled
    with mock.patch.dict(os.environ, {"AMPGUARD_STEP_GRAPH": ""}):
        opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), fused=True), model=model, precision="fp16")
    assert opt._pipeline.step_graph.enabled
    for x, y in make_data(3):  # the CPU's host decision: the stages apart
        opt.backward(loss_of(model, x, y))
        opt.step()
        opt.zero_grad()
    assert opt._pipeline.step_graph.captures == 0
