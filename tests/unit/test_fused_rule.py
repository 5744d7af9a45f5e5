"""The fused rule (``AMPGUARD_FUSED_RULE=1``, stop 62): the step graph's local vector, decision and payload
(``StepPipeline._tail``) compiled by ``torch.compile`` into a few kernels, with division rounded to nearest and no fp
fusion, instead of ~45 ops each a kernel of the graph. The guarantee is the op-by-op rule's bits. Here on the CPU
(inductor's C++ backend; the tensor decision forced, as CUDA takes it, and the capture replaced by
tests/unit/_graphs.py's stand-in): a guarded run through genuine fp16 overflows, the factor detectors and clipping is
the op-by-op run, weights and every report; a compile that fails warns once and leaves the op-by-op rule. The CUDA
side (Triton's kernels, their bits on test_host_decision's random rows, and what they save) is
benchmarks/results/cpu_stop62/fused_rule.py's and tests/gpu/test_gpu_step_graph.py's.

Not with ZClip or the z-score detector on the CPU: their ``sqrt`` of a 0-d tensor is not correctly rounded in CPU
eager torch (``torch.sqrt(torch.tensor(1.0063227415084839))`` is 1.003156304, the float32 square root rounded to
nearest 1.0031564236, which inductor's C++ gives), so there the compiled rule is the more exact one and the bits
differ. CUDA's ``sqrtf`` is correctly rounded in both."""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from unittest import mock

import pytest
import torch

from ampguard import pipeline

from .test_step_graph import OVERFLOW_STEPS, _reports, _run

CONFIG = {"spikes": {"grad_factor": 3.0, "loss_factor": 2.0, "warmup": 3, "action": "skip"}, "clip_grad_norm": 1.0,
          "param_norms_every": 1, "numerics_every": 5}


@pytest.fixture
def fused(compile_state, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("tests.unit.test_step_graph.CONFIG", CONFIG)
    monkeypatch.setattr(pipeline, "FUSED_RULE_DEVICES", ("cuda", "cpu"))  # CUDA's alone outside the tests
    with mock.patch.dict(os.environ, {"AMPGUARD_FUSED_RULE": "1"}):  # read at wrap time
        yield


@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_a_run_with_the_fused_rule_is_the_op_by_op_run_bit_for_bit(fused, compile_calls: list[int],
                                                                     bf16: bool) -> None:
    with mock.patch.dict(os.environ, {"AMPGUARD_FUSED_RULE": "0"}):
        want, plain, _ = _run(step_graph=True, steps=15, bf16=bf16)
    assert not compile_calls  # the switch off: nothing compiled
    plain.close()  # its forensics, armed by an overflow, disarmed: it would hold the next run at force_eager
    calls = compile_calls  # each call of the compiled tail: 1 where it ran compiled (no forensics armed)
    got, guarded, graphs = _run(step_graph=True, steps=15, bf16=bf16)
    assert guarded._pipeline.fused_rule and not guarded._pipeline._compile_failed
    assert len(calls) >= 10 and graphs.replays >= 8  # the steps took the compiled tail, replayed
    # compiled up to the first non-finite step, whose forensics holds every compiled frame at force_eager (the
    # tail too: op by op, the same kernels as without the switch)
    assert sum(calls) >= 4, calls
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)
    skipped = {r.step for r in guarded.history if r.skipped}
    assert skipped >= (set() if bf16 else OVERFLOW_STEPS)
    assert any(r.clip_coef < 1.0 for r in guarded.history)
    guarded.close()  # forensics disarmed inside the test (compile_state)


def test_a_compile_that_fails_warns_once_and_leaves_the_op_by_op_rule(fused) -> None:
    with mock.patch.dict(os.environ, {"AMPGUARD_FUSED_RULE": "0"}):
        want, plain, _ = _run(step_graph=True, steps=8)

    def refused(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no Triton here\nsecond line")
        return call

    with mock.patch.object(torch, "compile", refused), pytest.warns(RuntimeWarning) as caught:
        got, guarded, _ = _run(step_graph=True, steps=8)
    mine = [w for w in caught if "torch.compile of the step's decision failed" in str(w.message)]
    assert len(mine) == 1
    assert "no Triton here)" in str(mine[0].message) and "AMPGUARD_FUSED_RULE" in str(mine[0].message)
    assert guarded._pipeline._compile_failed
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)
    plain.close(), guarded.close()


def test_guards_with_other_decision_constants_each_compile_their_own_rule(fused, compile_calls: list[int],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # stop 64, on an H100: tests/gpu with the rule on made one guard after another in one process, each with its own
    # config; dynamo keeps a code object's entries and counts its recompile limit (8) across them, so the ninth guard's
    # compile failed (FailOnRecompileLimitHit) and it warned. Here the limit is 1, and three guards differ in their
    # clip and detectors: with one shared _tail the second guard's compile failed
    for i, clip in enumerate((1.0, 0.5, 2.0)):
        config = {**CONFIG, "clip_grad_norm": clip, "spikes": {**CONFIG["spikes"], "loss_factor": 2.0 + i}}
        monkeypatch.setattr("tests.unit.test_step_graph.CONFIG", config)
        with mock.patch.dict(os.environ, {"AMPGUARD_FUSED_RULE": "0"}):
            want, plain, _ = _run(step_graph=True, steps=6)
        plain.close()
        del compile_calls[:]
        with warnings.catch_warnings(), torch._dynamo.config.patch(recompile_limit=1):
            warnings.simplefilter("error", RuntimeWarning)  # the failed compile's warning
            got, guarded, graphs = _run(step_graph=True, steps=6)
        assert not guarded._pipeline._compile_failed, i
        assert sum(compile_calls) >= 4, (i, compile_calls)  # steps that took the compiled tail
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert _reports(guarded) == _reports(plain)
        guarded.close()
        kept = weakref.ref(guarded._pipeline)  # its own compiled code goes with it (a sweep's guards are freed)
        del guarded, got, graphs
        gc.collect()
        assert kept() is None, i


@pytest.mark.parametrize("forced", [True, False], ids=["first-sighting-forced-eager", "first-sighting-compiled"])
def test_a_capture_never_compiles_the_rule(fused, monkeypatch: pytest.MonkeyPatch, forced: bool) -> None:
    # forced: the rule's first sighting run under force_eager (forensics armed by an overflow, once anything was
    # compiled in the process), the stance back to default before the capture (disarmed): without care the capture is
    # where dynamo compiles the tail, inside a CUDA stream capture. It takes the tail op by op there instead (same
    # bits). Not forced: the first sighting compiled it, and the capture runs the compiled tail (a cache hit under the
    # capture's fail_on_recompile stance), nothing op by op
    from torch._dynamo.utils import counters

    from . import _graphs

    with mock.patch.dict(os.environ, {"AMPGUARD_FUSED_RULE": "0"}):
        want, plain, _ = _run(step_graph=True, steps=6)
    plain.close()
    inside, compiled_inside, op_by_op = [False], [], []
    stance = [torch.compiler.set_stance("force_eager")] if forced else []
    capture = _graphs.StandInGraphs._capture
    tail = pipeline.StepPipeline._tail

    def counted_tail(self, *args, **kwargs):  # the op-by-op tail (the compiled one is a copy made before)
        op_by_op.append(inside[0])
        return tail(self, *args, **kwargs)

    def disarmed_then_captured(self, fn, device):
        if stance:
            stance.pop().__exit__(None, None, None)
        monkeypatch.setattr(pipeline.StepPipeline, "_tail", counted_tail)
        inside[0], before = True, counters["stats"]["unique_graphs"]
        try:
            return capture(self, fn, device)
        finally:
            inside[0] = False
            compiled_inside.append(counters["stats"]["unique_graphs"] - before)

    monkeypatch.setattr(_graphs.StandInGraphs, "_capture", disarmed_then_captured)
    monkeypatch.setattr(pipeline, "capturing", lambda device: inside[0])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            got, guarded, graphs = _run(step_graph=True, steps=6)
    finally:
        if stance:
            stance.pop().__exit__(None, None, None)
    assert compiled_inside and not any(compiled_inside), compiled_inside
    assert any(op_by_op) if forced else not any(op_by_op), op_by_op
    misses = guarded._pipeline.fused_rule_capture_misses  # counted where the capture took the tail op by op
    assert misses >= 1 if forced else misses == 0, misses
    assert graphs.replays >= 3 and not guarded._pipeline._compile_failed
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _reports(guarded) == _reports(plain)
    guarded.close()


def test_the_switch_leaves_the_cpu_op_by_op(compile_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    # FUSED_RULE_DEVICES (stop 64): the CPU's eager sqrt is not the compiled one's, and a CPU step would wait on a C++
    # compile; with the switch on, a CPU guard's step graph still takes the rule op by op (before, it compiled)
    monkeypatch.setattr("tests.unit.test_step_graph.CONFIG", CONFIG)
    with mock.patch.dict(os.environ, {"AMPGUARD_FUSED_RULE": "1"}):
        _, guarded, graphs = _run(step_graph=True, steps=6)
    assert guarded._pipeline.fused_rule and graphs.replays >= 3
    assert not compile_calls and guarded._pipeline._compiled_tail is None
    guarded.close()


def test_the_options_keep_division_and_multiply_add_as_eager_does() -> None:
    # the names the switch relies on exist in this torch's inductor (an unknown option fails the compile: the guard
    # would then warn and take the op-by-op rule)
    from torch._inductor import config

    for name, value in pipeline.FUSED_RULE_OPTIONS.items():
        obj = config
        for part in name.split("."):
            obj = getattr(obj, part)
        assert isinstance(obj, bool) and value is True
