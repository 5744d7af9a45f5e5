"""The step graph's early skip flag (``AMPGUARD_EARLY_SKIP=1``, stop 59): a non-fused optimizer's skip read waits for
the flag the rule hands over as soon as it made it (:func:`ampguard.policies.rule`'s ``on_skip``: a copy into a pinned
buffer and an external event recorded after it, nodes of the captured graph on CUDA), not for the whole graph.

CI has no GPU: these run CUDA's non-fused path on the CPU as ``tests/unit/test_unfused_fast.py`` does (the tensor
decision, the step graph's capture by the stand-in of ``_graphs.py``), with a CPU buffer for the pinned one and a
stand-in for the external event that counts its records and waits. The overflows are genuine (the loss times 2**14
at a scale of 2**10). What a capture makes of the copy and the event, and what the wait saves, only a device shows:
``benchmarks/results/cpu_stop58/early_event.py``, ``benchmarks/host_time.py --early-arm``.
"""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import pytest
import torch

import ampguard
from ampguard.ops import HOST, TensorOps
from ampguard.payload import Landing, pinned_view
from ampguard.pipeline import StepPipeline
from ampguard.policies import SpikeState, rule
from ampguard.scaling import ScaleState
from ampguard.stats import LOCAL_K, Dec, Loc, LossMeter

from . import test_step_graph as SG
from ._models import assert_same, loss_of, make_data, make_model
from .test_unfused_fast import OVERFLOW_STEPS, _reports, _run


class StandInEvent:
    """``torch.cuda.Event(external=True)``'s calls the early flag and the payload's landing make: ``record`` (in the
    graph: an event record node), ``query`` and ``synchronize`` (on the CPU the copy has always arrived); each wait
    notes the buffer's first value as it then is."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf, self.records, self.seen = buf, 0, []

    def record(self) -> None:
        self.records += 1

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.seen.append(bool(self.buf[0]))


def _early(events: list[StandInEvent], landings: list[StandInEvent] | None = None) -> Any:
    def watch(opt: Any) -> None:
        pipe = opt._pipeline
        flag = torch.zeros(1, dtype=torch.bool)  # pinned on CUDA
        event = StandInEvent(flag)
        events.append(event)
        pipe.early_skip, pipe._new_flag = True, lambda: (flag, event)  # what AMPGUARD_EARLY_SKIP=1 makes on CUDA

        def new_slot(size: int) -> tuple[torch.Tensor, StandInEvent]:  # the payload's pinned buffer and its event
            buf = torch.zeros(size)
            landed = StandInEvent(buf)
            if landings is not None:
                landings.append(landed)
            return buf, landed
        pipe._new_slot = new_slot
    return watch


def test_the_skip_read_takes_each_steps_own_early_flag_bitwise_the_plain_loop() -> None:
    """Each step's read waited once, on the event, and read that step's own skip (the genuine overflows, only); the
    weights, scales and reports are the default path's (which test_unfused_fast.py holds to torch's plain loop), bit
    for bit; the step graph was captured and replayed with the copy and the record inside it."""
    events: list[StandInEvent] = []
    want = _run("adamw_foreach", guarded=True, step_graph=True)
    got = _run("adamw_foreach", guarded=True, step_graph=True, watch=_early(events))
    assert_same(want["state"], got["state"])
    assert got["scales"] == want["scales"] and got["scale"] == want["scale"]
    assert _reports(got["opt"]) == _reports(want["opt"])
    (event,) = events
    assert event.seen == [i in OVERFLOW_STEPS for i in range(16)]  # one wait a step, its own flag
    graphs = got["graphs"]
    assert graphs.captures == 1 and graphs.replays >= 10
    assert event.records == 16 + graphs.captures  # every run hands the flag over (the stand-in's capture runs once)


def test_the_graph_lands_the_payload_and_the_reporter_reads_it_as_it_is() -> None:
    """With the early flag the step graph also copies its payload to the host itself (:class:`ampguard.payload.Landing`:
    a copy into a pinned buffer and an event recorded after it, nodes of the graph); the skip read copies no payload
    (:attr:`Decision.packed_host` stays None), and the reporter takes the landing, launching no copy of its own. Each
    landing is filled before the next run overwrites the buffer: the reports are the default path's bit for bit (the
    test above, whose reports are decoded from these landings)."""
    events: list[StandInEvent] = []
    landings: list[StandInEvent] = []
    read: list[Any] = []
    kept: list[Any] = []

    def watch(opt: Any) -> None:
        _early(events, landings)(opt)
        pipe, reporter = opt._pipeline, opt._reporter
        pipe._learn_skip = lambda d, *a, _f=pipe._learn_skip: (_f(d, *a), read.append(d))[0]
        reporter.enqueue = lambda step, packed, *a, _f=reporter.enqueue, **k: (kept.append(packed),
                                                                               _f(step, packed, *a, **k))[1]

    got = _run("adamw_foreach", guarded=True, step_graph=True, steps=8, watch=watch)
    assert len(read) == len(kept) == 8
    landed = 0
    for step, (decision, packed) in enumerate(zip(read, kept)):
        assert decision.early is not None and decision.packed_host is None, step
        assert decision.learnt == (step in OVERFLOW_STEPS), step
        if packed.layout.params:  # a parameter check's step: packed anew, with the max|p| after it
            assert packed.landing is None
            continue
        assert packed.landing is decision.landing is not None, step
        assert decision.landing.values is not None, step  # filled: before the next run, or by the reporter's read
        landed += 1
    assert landed >= 6
    (slot_event,) = landings  # one buffer for the one payload size, recorded by every run
    assert slot_event.records == 8 + got["graphs"].captures
    assert [r.skipped for r in got["opt"].history] == [i in OVERFLOW_STEPS for i in range(8)]


def test_a_spike_skipped_step_hands_over_the_final_skip() -> None:
    """The flag is the rule's final skip, spikes included (``Spikes(action="skip")``: made after the detectors), so
    the read skips what the report says was skipped; ZClip and sampled numerics steps as the default path has them."""
    config = {"spikes": {"grad_zscore": 3.0, "warmup": 3, "action": "skip"}, "zclip": {"warmup": 3},
              "param_norms_every": 1, "numerics_every": 5}
    events: list[StandInEvent] = []
    reads: list[tuple[int, bool]] = []

    def watch(opt: Any) -> None:
        _early(events)(opt)
        pipe = opt._pipeline

        def learn(d: Any, *a: Any, _f: Any = pipe._learn_skip) -> bool:
            skipped = _f(d, *a)
            if d.early is not None:
                reads.append((opt.step_count, skipped))
            return skipped
        pipe._learn_skip = learn

    spikes = {12: 40.0}  # a genuine spike: the loss, and so every gradient, 40 times larger (no overflow at 2**10)
    want = _run("adamw_foreach", guarded=True, config=config, step_graph=True, factors=spikes)
    got = _run("adamw_foreach", guarded=True, config=config, step_graph=True, watch=watch, factors=spikes)
    assert_same(want["state"], got["state"])
    assert _reports(got["opt"]) == _reports(want["opt"])
    history = got["opt"].history
    assert len(reads) >= 8 and len(events[0].seen) == len(reads)
    assert all(history[step].skipped is skipped for step, skipped in reads), reads
    spiked = {r.step for r in history if r.skipped and r.reason.value in ("grad_spike", "loss_spike")}
    assert spiked & {step for step, _ in reads}, (spiked, reads)  # a spike skipped through the flag


@pytest.mark.parametrize("ops", [HOST, None], ids=["host", "tensor"])
@pytest.mark.parametrize("action", ["skip", "warn"])
def test_the_rule_hands_on_skip_its_final_skip(ops: Any, action: str) -> None:
    """``rule(on_skip=...)`` is called once, with the flag the decision vector then holds as ``Dec.SKIP``: a non-finite
    loss, and a spike that skips only where the detector's action is ``skip``; on host floats and on tensors."""
    o = TensorOps(torch.device("cpu")) if ops is None else ops
    config = ampguard.GuardConfig(spikes=ampguard.Spikes(grad_zscore=3.0, warmup=3, action=action))
    device = torch.device("cpu")
    spikes, scale_state = SpikeState.fresh(device), ScaleState.fresh(device)
    norms = [1.0, 1.1, 0.9, 1.0, 50.0, 1.0, 1.0]
    got: list[bool] = []
    for i, norm in enumerate(norms):
        g = torch.zeros(1, LOCAL_K)
        g[0, Loc.LOSS] = float("nan") if i == 5 else 2.0
        g[0, Loc.LOSS_NONFINITE] = 1.0 if i == 5 else 0.0
        g[0, Loc.GRAD_NORM] = norm
        seen: list[Any] = []
        vector, _ = rule(o, g, config=config, spikes=spikes, scale_state=scale_state, scaler=None,
                         grads_sharded=False, on_skip=seen.append)
        (flag,) = seen
        skip = bool(flag) if ops is HOST else bool(flag.item())
        assert skip == (vector[Dec.SKIP] > 0), i
        got.append(skip)
    assert got[5]  # the non-finite loss
    assert got[4] is (action == "skip")  # the spike: skipped only where its action says so


def test_off_by_default_off_the_cpu_and_the_switch_is_checked() -> None:
    model = make_model()
    other = torch.device("meta")  # any device but CUDA: the flag is a CUDA event's
    for env in ("", "0", "1"):
        with mock.patch.dict(os.environ, {"AMPGUARD_EARLY_SKIP": env}):
            pipe = StepPipeline(optimizer=torch.optim.AdamW(model.parameters(), foreach=True), adapter=None,
                                backend=ampguard.backends.LocalBackend(), config=ampguard.GuardConfig(),
                                device=other)
        assert pipe.early_skip is False and pipe._early_flag() == (None, None), env
    with mock.patch.dict(os.environ, {"AMPGUARD_EARLY_SKIP": "on"}), \
            pytest.raises(ValueError, match="AMPGUARD_EARLY_SKIP='on'"):
        StepPipeline(optimizer=torch.optim.AdamW(model.parameters(), foreach=True), adapter=None,
                     backend=ampguard.backends.LocalBackend(), config=ampguard.GuardConfig(), device=other)


def _bf16_foreach(early: bool) -> tuple[list[torch.Tensor], Any, list[StandInEvent], list[StandInEvent]]:
    """bf16, no GradScaler, foreach AdamW on CUDA's path (the tensor decision in the step graph's replay, its skip
    read), a genuine NaN at NAN_STEP (LayerNorm with eps=0 over a constant row); ``early``: the early flag on."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(8, eps=0.0, elementwise_affine=False), *make_model(0))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    with mock.patch.dict(os.environ, {"AMPGUARD_STEP_GRAPH": "1"}):
        opt = ampguard.wrap(inner, model=model, precision="bf16")
    pipe = opt._pipeline
    pipe.host_decision, opt._lagged_reports = False, True  # CUDA's choices, on the CPU
    pipe.step_graph = SG._Graphs(SG._state(pipe))
    events: list[StandInEvent] = []
    landings: list[StandInEvent] = []
    if early:
        _early(events, landings)(opt)
    loss_buf = torch.zeros(())
    with mock.patch.object(LossMeter, "kept", staticmethod(lambda loss: loss_buf.copy_(loss.detach().reshape(())))):
        for i, (x, y) in enumerate(make_data(12)):
            if i == SG.NAN_STEP:
                x = x.clone()
                x[0] = 1.0
            with opt.autocast():
                loss = loss_of(model, x, y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=False)
    opt.flush()
    return [p.detach().clone() for p in model.parameters()], opt, events, landings


def test_without_a_scaler_the_early_flag_and_the_landing_are_the_run_without_them() -> None:
    """The same through the step graph's other decision (``_through_unscaled``: bf16, no GradScaler): each step's
    read is its own flag (the genuine NaN skipped), the payloads land, the run is the one without them bit for bit."""
    want, plain, _, _ = _bf16_foreach(early=False)
    got, guarded, events, landings = _bf16_foreach(early=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)
    assert guarded.history[SG.NAN_STEP].skipped
    (event,) = events
    assert event.seen == [i == SG.NAN_STEP for i in range(12)]
    assert guarded._pipeline.step_graph.replays >= 8 and len(landings) == 1 and landings[0].records >= 12


def test_a_landing_fills_a_copy_of_its_buffer_through_a_view_made_once() -> None:
    """The fill (stop 60): one ``from_buffer_copy`` of a ctypes view over the buffer, the view made once a buffer by
    its owner (``StepPipeline._new_slot``) or on the first fill: the values are the buffer's floats at the fill, bit
    for bit, and a copy (the next run overwrites the buffer; the landing keeps its step's floats)."""
    buf = torch.tensor([1.5, float("nan"), -0.0, 3.0e38, float("inf")])
    view = pinned_view(buf)
    for given in (view, None):
        landing = Landing(buf, StandInEvent(buf), given)
        landing.synchronize()
        assert landing.values is not None and (given is None or landing.view is view)
        got = torch.tensor(landing.values[:])
        assert torch.equal(got.view(torch.int32), buf.view(torch.int32))  # bits: NaN and -0.0 too
        buf.add_(1.0)  # the next run's payload
        assert torch.equal(torch.tensor(landing.values[:]).view(torch.int32), got.view(torch.int32))
