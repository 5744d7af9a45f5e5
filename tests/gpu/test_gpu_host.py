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
