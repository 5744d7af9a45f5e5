"""A non-fused optimizer off the CPU (``StepPipeline.unfused_fast``, stop 55): the tensor decision, as a fused one
takes it; the still-scaled gradients measured (``found_inf`` from their norms), the decision in the step graph's
replay where that is taken; the skip learnt by one read of the decision's flag (the step's one sync, where the plain
loop's GradScaler reads ``found_inf``); then one ``_foreach_mul_`` by GradScaler's ``1/scale`` and, on a step taken
with clipping, one by the clip coefficient, before the optimizer's own step.

CI has no GPU: these run that path on the CPU with CUDA's choices forced (``host_decision`` and ``norms_first``
off, ``unfused_fast`` on; the step graph's capture by the stand-in of ``_graphs.py``; the reports decoded steps
later, as on CUDA). The plain loop they are held against is torch's own: ``scaler.scale(loss).backward()``, with
clipping ``scaler.unscale_(opt)`` and ``clip_grad_norm_``, ``scaler.step(opt)``, ``scaler.update()``. The overflows
are genuine: the loss times 2**14 at a scale of 2**10, whose fp16 backward overflows. On CUDA:
``tests/gpu/test_gpu_unfused_fast.py``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch

import ampguard
from ampguard.pipeline import StepPipeline
from ampguard.stats import LossMeter

from . import _scenarios as S
from ._graphs import StandInGraphs
from ._models import NON_FUSED, assert_same, loss_of, make_data, make_model, snapshot
from .test_diagnosis_scenarios import EXPECTED

OVERFLOW_STEPS = {4, 9, 10}
MAX_NORM = 0.05  # small enough that most steps clip


def _forced(opt: Any, step_graph: bool) -> Any:
    """CUDA's choices for a non-fused optimizer, on the CPU; returns the step graph's stand-in (None: off)."""
    pipe = opt._pipeline
    assert pipe.host_decision and pipe.norms_first and not pipe.unfused_fast  # the CPU's own choices
    pipe.host_decision, pipe.norms_first, pipe.unfused_fast = False, False, True
    opt._lagged_reports = True  # its reports decoded steps later, as on CUDA
    if not step_graph:
        return None
    scaler = pipe.adapter.scaler
    state = [*(getattr(o, f.name) for o in (pipe.spikes, pipe.scale_state) for f in dataclasses.fields(o)),
             scaler._scale, scaler._growth_tracker]
    graphs = pipe.step_graph = StandInGraphs(False, "the step from the gradients to the decision", state=state)
    return graphs


def _run(kind: str, guarded: bool, *, clip: bool = False, step_graph: bool = False, steps: int = 16,
         config: dict[str, Any] | None = None, forced: bool = True,
         watch: Callable[[Any], None] | None = None, factors: dict[int, float] | None = None) -> dict[str, Any]:
    """A run of 16 steps, genuine overflows at OVERFLOW_STEPS: torch's plain loop, or guarded (``forced``: on this
    path; otherwise the CPU's own). ``clip``: torch's ``clip_grad_norm_`` (the guard's ``clip_grad_norm_``).
    ``watch``: called with the guard before its first step (spies). ``factors``: other steps' losses times these."""
    times = {i: 2.0**14 for i in OVERFLOW_STEPS} | (factors or {})
    torch.manual_seed(0)
    model = make_model(0)
    inner = NON_FUSED[kind](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    opt: Any = inner
    graphs = None
    if guarded:
        with mock.patch.dict(os.environ, {"AMPGUARD_STEP_GRAPH": "1" if step_graph else "0"}):
            opt = ampguard.wrap(inner, model=model, precision="fp16", scaler=scaler, config=config)
        graphs = _forced(opt, step_graph) if forced else None
        taken: list[int] = []
        pipe = opt._pipeline
        pipe._step_unscaling = lambda *a, _f=pipe._step_unscaling: taken.append(1) or _f(*a)
        if watch is not None:
            watch(opt)
    buffers = [torch.zeros(())]

    def kept(loss: torch.Tensor) -> torch.Tensor:  # one place for the kept loss, as CUDA's allocator gives it
        return buffers[0].copy_(loss.detach().reshape(()))

    scales, grads = [], []
    with mock.patch.object(LossMeter, "kept", staticmethod(kept)):
        for i, (x, y) in enumerate(make_data(steps)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model, x, y) * times.get(i, 1.0)
            scales.append(scaler.get_scale())
            if guarded:
                opt.backward(loss)
                if clip:
                    opt.clip_grad_norm_(MAX_NORM)
                opt.step()
            else:
                scaler.scale(loss).backward()
                if clip:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                scaler.step(opt)
                scaler.update()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.zero_grad(set_to_none=False)  # the gradients stay where they lie (the step graph's keys repeat)
    out = {"state": snapshot(model, inner), "scales": scales, "grads": grads, "scale": scaler.get_scale()}
    if guarded:
        opt.flush()
        out.update(opt=opt, taken=len(taken), graphs=graphs)
    return out


def _same_grads(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    for step, (xs, ys) in enumerate(zip(a, b)):  # .grad as the plain loop leaves it: unscaled (and clipped)
        assert all(torch.equal(x, y) or (not x.isfinite().all() and torch.equal(x.isfinite(), y.isfinite()))
                   for x, y in zip(xs, ys)), step


@pytest.mark.parametrize("step_graph", [False, True], ids=["stages", "step-graph"])
@pytest.mark.parametrize("kind", list(NON_FUSED))
def test_bitwise_the_plain_loop_through_genuine_overflows(kind: str, step_graph: bool,
                                                          unscale_calls: list[int]) -> None:
    plain = _run(kind, guarded=False, step_graph=step_graph)
    del unscale_calls[:]
    got = _run(kind, guarded=True, step_graph=step_graph)
    assert_same(plain["state"], got["state"])
    assert got["scales"] == plain["scales"] and got["scale"] == plain["scale"]
    _same_grads(plain["grads"], got["grads"])
    assert {r.step for r in got["opt"].history if r.skipped} == OVERFLOW_STEPS  # the genuine overflows, only
    assert got["taken"] == 16  # every step on this path
    assert not unscale_calls  # GradScaler's unscale and element check never ran: found_inf from the norms
    if step_graph:
        graphs = got["graphs"]
        assert graphs.captures == 1 and graphs.replays >= 10, (graphs.captures, graphs.replays)


@pytest.mark.parametrize("kind", list(NON_FUSED))
def test_torchs_clip_is_not_folded_and_stays_bitwise_the_plain_loop(kind: str, unscale_calls: list[int]) -> None:
    """``opt.clip_grad_norm_`` of a non-fused optimizer: GradScaler's ``unscale_`` and torch's own clip, as the plain
    loop calls them (the coefficient folded into the decision's would be another rounding: docs/design.md); the step
    then the tensor decision's, the skip read once."""
    plain = _run(kind, guarded=False, clip=True)
    plain_calls = len(unscale_calls)
    del unscale_calls[:]
    got = _run(kind, guarded=True, clip=True)
    assert_same(plain["state"], got["state"])
    assert got["scales"] == plain["scales"]
    _same_grads(plain["grads"], got["grads"])
    history = got["opt"].history
    assert {r.step for r in history if r.skipped} == OVERFLOW_STEPS
    assert sum(r.clip_coef < 1.0 for r in history) >= 8  # the clip engaged
    assert got["taken"] == 0 and len(unscale_calls) == plain_calls == 16


@pytest.mark.parametrize("step_graph", [False, True], ids=["stages", "step-graph"])
def test_the_guards_own_clip_unscales_then_clips_as_its_clip_stage_does(step_graph: bool) -> None:
    """``GuardConfig(clip_grad_norm=...)``: unscaled by ``1/scale``, then multiplied by the decision's coefficient,
    each a pass of its own, as the stages apart do after GradScaler's ``unscale_`` (the CPU's own path here, the
    host decision): the same weights and reports, bit for bit."""
    config = {"clip_grad_norm": MAX_NORM}
    want = _run("adamw_foreach", guarded=True, config=config, forced=False)
    got = _run("adamw_foreach", guarded=True, config=config, step_graph=step_graph)
    assert_same(want["state"], got["state"])
    assert _reports(got["opt"]) == _reports(want["opt"])
    _same_grads(want["grads"], got["grads"])
    assert got["taken"] == 16 and sum(r.clip_coef < 1.0 for r in got["opt"].history) >= 8


def _reports(opt: Any) -> list[str]:
    return [repr(dataclasses.astuple(dataclasses.replace(r, wall_time=0.0))) for r in opt.history]


def test_the_stages_and_the_step_graph_report_the_same_bit_for_bit() -> None:
    """Spikes skipped, ZClip and sampled numerics steps (the stages apart on those): the same reports and weights
    with the step graph as without it."""
    config = {"spikes": {"grad_zscore": 3.0, "warmup": 3, "action": "skip"}, "zclip": {"warmup": 3},
              "param_norms_every": 1, "numerics_every": 5}
    want = _run("adamw_foreach", guarded=True, config=config)
    got = _run("adamw_foreach", guarded=True, config=config, step_graph=True)
    assert_same(want["state"], got["state"])
    assert _reports(got["opt"]) == _reports(want["opt"])
    assert got["graphs"].replays >= 8
    assert any(r.clip_coef < 1.0 for r in got["opt"].history)  # ZClip clipped, on this path


def test_the_skip_is_known_on_the_host_once_the_step_read_it() -> None:
    """The step's one sync read the skip: a taken step's report waits (lagged, as a fused step's), the reader
    answering from the skip read; a skipped step's report is decoded at the end of its own step (its copy queued
    behind no optimizer kernel), so forensics arm for the next forward."""
    model = make_model(0)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True), model=model,
                        precision="fp16", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    _forced(opt, step_graph=False)
    for i, (x, y) in enumerate(make_data(6)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, x, y) * (2.0**14 if i == 4 else 1.0)
        opt.backward(loss)
        opt.step()
        pending = opt._reporter._pending
        if i == 4:  # skipped: decoded now, with every report before it
            assert not pending and opt.history.steps_reported == 5 and opt.history[4].skipped
        else:
            assert pending and pending[-1].step == i and pending[-1].skip is False
        assert opt.step_was_skipped is (i == 4)
        opt.zero_grad()
    opt.flush()
    assert [r.skipped for r in opt.history] == [False] * 4 + [True, False]


def test_the_skip_read_brings_the_step_graphs_payload_with_it() -> None:
    """Where the step graph made the payload, the skip read copies all of it (the decision at its head), and the
    reporter keeps that copy as it is: on CUDA no pinned copy of its own, no event, and nothing to wait for behind the
    optimizer's kernels (stop 57). Each step's report is still the stages' own (the test above)."""
    read: list[Any] = []
    kept: list[Any] = []

    def watch(opt: Any) -> None:
        pipe, reporter = opt._pipeline, opt._reporter
        pipe._learn_skip = lambda d, *a, _f=pipe._learn_skip: (_f(d, *a), read.append(d))[0]
        reporter.enqueue = lambda step, packed, *a, _f=reporter.enqueue, **k: (kept.append(packed),
                                                                               _f(step, packed, *a, **k))[1]

    got = _run("adamw_foreach", guarded=True, step_graph=True, steps=8, watch=watch)  # overflows at step 4 only
    graphs, opt = got["graphs"], got["opt"]
    assert graphs.replays >= 5 and len(read) == len(kept) == 8
    plain = 0
    for step, (decision, packed) in enumerate(zip(read, kept)):
        assert decision.packed is not None and decision.learnt == (step == 4), step  # made in the step graph
        if packed.layout.params:  # a parameter check's step: its payload packed anew, with the max|p| after it
            assert packed.vector is not decision.packed_host
            continue
        assert packed.vector is decision.packed_host, step  # the skip read's copy, kept as it is
        plain += 1
    assert plain >= 6
    assert [r.skipped for r in opt.history] == [False] * 4 + [True] + [False] * 3


def test_off_the_cpu_by_default_and_the_switch_gives_the_host_decision_back() -> None:
    model = make_model()
    other = torch.device("meta")  # any device but the CPU
    for env, host in (("", False), ("0", False), ("1", True)):
        with mock.patch.dict(os.environ, {"AMPGUARD_UNFUSED_HOST_DECISION": env}):
            pipe = StepPipeline(optimizer=torch.optim.AdamW(model.parameters(), foreach=True), adapter=None,
                                backend=ampguard.backends.LocalBackend(), config=ampguard.GuardConfig(),
                                device=other)
        assert pipe.host_decision is host, env
        assert pipe.spikes.count.device.type == ("cpu" if host else "meta")
    with mock.patch.dict(os.environ, {"AMPGUARD_UNFUSED_HOST_DECISION": "yes"}), \
            pytest.raises(ValueError, match="AMPGUARD_UNFUSED_HOST_DECISION='yes'"):
        StepPipeline(optimizer=torch.optim.AdamW(model.parameters(), foreach=True), adapter=None,
                     backend=ampguard.backends.LocalBackend(), config=ampguard.GuardConfig(), device=other)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_real_cause_is_named_one_step_later_as_before(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The diagnosis scenarios (real causes: an attention overflow, log of a negative, LayerNorm over a constant row,
    an inf input, an LR explosion, a frozen bad adapter) with CUDA's non-fused path forced (the tensor decision, the
    reports lagged): without a closure the cause is named on the step after the first bad one, as the host decision
    named it (tests/gpu/test_gpu_diagnosis.py's expectation; a lagged skipped step named it a step later still)."""
    wrap = ampguard.wrap

    def forced(*args: Any, **kwargs: Any) -> Any:
        opt = wrap(*args, **kwargs)
        pipe = opt._pipeline
        assert not pipe.fused
        pipe.host_decision, pipe.norms_first, pipe.unfused_fast = False, False, pipe.adapter is not None
        opt._lagged_reports = True
        return opt

    monkeypatch.setattr(ampguard, "wrap", forced)
    module, phase, cause, param, *_ = EXPECTED[name]
    result = S.run(name, closure=False)
    first_bad = min(result["skipped"])
    found = S.named(result)
    assert all(s >= first_bad + 1 for s in found), found
    assert found[first_bad + 1] == (module, phase, cause, param, ()), found
