"""On CUDA: the host runs ahead of the device. A fused guarded ``step()`` never waits on the previous
step's work: its report is decoded two steps later, so when ``step()`` returns the device may still be
busy with the step before. The only wait left is the run-ahead bound: step N may wait for step N-2's
report copy (the same on every rank; see ``GuardedOptimizer._report_lag``). Skipped without CUDA.
Run: ``pytest -m gpu tests/gpu/test_gpu_host.py -v``."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _guarded() -> tuple[nn.Module, ampguard.GuardedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).cuda()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model,
                        precision="fp16", scaler=torch.amp.GradScaler("cuda"))
    return model, opt


def test_fused_step_never_waits_on_the_previous_step_and_reports_arrive() -> None:
    model, opt = _guarded()
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    waited: list[tuple[int, int]] = []  # (the step whose step() waited, the step whose copy it waited on)
    original = torch.cuda.Event.synchronize
    ahead: list[bool] = []
    prev_done: torch.cuda.Event | None = None
    for i in range(10):
        with opt.autocast():
            loss = F.cross_entropy(model(x), y)
        opt.backward(loss)
        torch.cuda._sleep(50_000_000)  # tens of ms of device work per step: the device is the bottleneck
        steps_of = {id(p.event): p.step for p in opt._outcome.records._pending if p.event is not None}

        def counting(event: torch.cuda.Event, i: int = i, steps_of: dict[int, int] = steps_of) -> None:
            waited.append((i, steps_of.get(id(event), -1)))
            original(event)

        with mock.patch.object(torch.cuda.Event, "synchronize", counting):
            opt.step()
        if prev_done is not None and i >= 3:
            ahead.append(not prev_done.query())  # the previous step's work still running: the host is ahead
        prev_done = torch.cuda.Event()
        prev_done.record()
        opt.zero_grad()
    assert all(waited_on <= i - 2 for i, waited_on in waited), waited  # never the previous step's copy
    assert all(ahead), f"step() returned after the previous step's work had finished: {ahead}"
    assert opt.last_report is not None and opt.last_report.step == 9  # a reader decodes on demand
    assert [r.step for r in opt.history] == list(range(10))
    opt.close()


def test_a_reader_of_step_was_skipped_every_step_waits_for_the_decision_not_the_optimizer() -> None:
    """Issue 26: the transformers Trainer reads ``step_was_skipped`` after every step. That read waited for the
    step's payload, copied after the optimizer's kernels, so the device drained at every step. After reads waited
    for two steps' payloads in a row, the guard copies each decision's skip flag ahead of the inner step: the reads
    wait on that copy's event and never on a payload's, and every answer is its report's (a real fp16 overflow, an
    input past fp16's range, among them)."""
    model, opt = _guarded()
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    original = torch.cuda.Event.synchronize
    answers: list[bool] = []
    waits: list[tuple[int, str]] = []
    # Two unread steps first: a process's first steps take the host longer than the device's sleep (CUDA's lazy
    # set-up, the step graph's capture, the fused rule's compile: seconds), and a read of a step whose copy has
    # landed waits for nothing (stop 65, an H100, the test alone: step 0's read waited for nothing, so the flag came a
    # step late)
    for i in range(10):
        with opt.autocast():
            loss = F.cross_entropy(model(x * (1e5 if i == 7 else 1.0)), y)
        opt.backward(loss)
        torch.cuda._sleep(100_000_000)  # the device busy (~50 ms): the step's copies are still on their way when read
        opt.step()
        if i < 2:
            opt.zero_grad()
            continue
        last = opt._outcome.records._pending[-1]
        kinds = {id(last.event): "payload"} | ({id(last.early[1]): "early"} if last.early is not None else {})

        def counting(event: torch.cuda.Event, i: int = i, kinds: dict[int, str] = kinds) -> None:
            waits.append((i, kinds.get(id(event), "other")))
            original(event)

        with mock.patch.object(torch.cuda.Event, "synchronize", counting):
            answers.append(opt.step_was_skipped)
        opt.zero_grad()
    assert answers == [r.skipped for r in opt.history[2:]] and answers[5] and not answers[6], answers
    assert [w for w in waits if w[0] < 4] == [(2, "payload"), (3, "payload")], waits  # before it was on
    # after it: every read that waits, waits on the flag's copy, never on a payload. A read may wait for nothing where
    # its step took the host longer than the device's sleep (stop 65, an H100, a fresh process: one read of six, the
    # step that first copied the flag or captured its graph); most do wait
    later = [w for w in waits if w[0] >= 4]
    assert all(kind == "early" for _, kind in later) and len(later) >= 4 and len({i for i, _ in later}) == len(later), (
        waits)
    opt.close()


def test_accelerates_prepared_scheduler_waits_for_nothing_on_the_fused_path() -> None:
    """Issue 26: accelerate's ``scheduler.step()`` read ``step_was_skipped``, one wait for the whole optimizer step a
    step where the plain accelerate loop waits for none (H100: guarded 1.14x plain). The guard steps the prepared
    scheduler itself now: ``scheduler.step()`` waits on no event and raises nothing under sync debug mode "error";
    the LR the updates see still holds on the skipped step."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(mixed_precision="fp16")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt, sched = acc.prepare(model, inner, torch.optim.lr_scheduler.LambdaLR(inner, lambda k: 0.5**k))
    opt = ampguard.wrap(opt, accelerator=acc, model=model)
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    original = torch.cuda.Event.synchronize
    waited: list[int] = []
    seen: list[float] = []
    inner.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    for i in range(8):
        loss = F.cross_entropy(model(x * (1e5 if i == 4 else 1.0)), y)
        acc.backward(loss)
        opt.step()

        def counting(event: torch.cuda.Event, i: int = i) -> None:
            waited.append(i)
            original(event)

        with mock.patch.object(torch.cuda.Event, "synchronize", counting):
            torch.cuda.set_sync_debug_mode("error")
            try:
                sched.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
    assert waited == [], waited
    skipped = [r.skipped for r in opt.history]
    assert skipped[4] and sum(skipped) >= 1
    assert seen == [1e-3 * 0.5 ** sum(not k for k in skipped[:s]) for s in range(8)], (seen, skipped)
    opt.close()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
