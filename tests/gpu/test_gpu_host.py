"""On CUDA: the host runs ahead of the device. A fused guarded ``step()`` waits on no event (the
previous step's report is decoded two steps later), and a run whose device work is slow keeps
several steps queued. Skipped without CUDA. Run: ``pytest -m gpu tests/gpu/test_gpu_host.py -v``."""

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


def test_fused_step_waits_on_no_event_and_reports_arrive() -> None:
    model, opt = _guarded()
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    waits = {"n": 0}
    original = torch.cuda.Event.synchronize

    def counting(self: torch.cuda.Event) -> None:
        waits["n"] += 1
        original(self)

    for i in range(8):
        with opt.autocast():
            loss = F.cross_entropy(model(x), y)
        opt.backward(loss)
        if i >= 2:  # after the warm-up (GradScaler's lazy init)
            with mock.patch.object(torch.cuda.Event, "synchronize", counting):
                torch.cuda._sleep(50_000_000)  # ~tens of ms of device work: the copies are still in flight
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    assert waits["n"] == 0, f"step() waited on {waits['n']} report copies"
    assert opt.last_report is not None and opt.last_report.step == 7  # a reader decodes on demand
    assert [r.step for r in opt.history] == list(range(8))
    opt.close()
