"""On CUDA: healthy reports wait for their batch (``ampguard.reporter.REPORT_BATCH``, stop 45), each read once in
its pinned buffer after its copy's event fired, with no sync; a report that asks for something (a real fp16
overflow) is decoded at its own fixed point with every report before it; the exporters get every report, in order,
by ``close()``. The device is drained before each ``step()`` so every copy has landed (the batches engage where the
host is the bottleneck; a copy still in flight is decoded, and waited for, as before). Skipped without CUDA.
tests/unit/test_report_lag.py runs the same on the CPU. Run: ``pytest -m gpu tests/gpu/test_gpu_report_batch.py``."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard
from ampguard.reporter import REPORT_BATCH

from ..unit.test_report_lag import _Seen  # an exporter that notes when each report reached it

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _run(steps: int, overflow_at: int | None = None) -> tuple[_Seen, list[int], list[int]]:
    """``(exports, pending payloads after each step, the steps whose step() waited on an event)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).cuda()
    seen = _Seen()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cuda", init_scale=1024.0), exporters=[seen])  # no overflow
    seen.opt = opt
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    pending, waited = [], []
    original = torch.cuda.Event.synchronize

    for i in range(steps):
        def counting(event: torch.cuda.Event, i: int = i) -> None:
            waited.append(i)
            original(event)

        with opt.autocast():  # x 1e6 overflows fp16 at the autocast cast itself: a non-finite loss, skipped
            loss = F.cross_entropy(model(x * (1e6 if i == overflow_at else 1.0)), y)
        opt.backward(loss)
        torch.cuda.synchronize()  # every earlier copy has landed
        with mock.patch.object(torch.cuda.Event, "synchronize", counting):
            opt.step()
        opt.zero_grad()
        pending.append(len(opt._outcome.records._pending))
    opt.close()
    return seen, pending, waited


def test_healthy_reports_wait_for_their_batch_without_a_sync() -> None:
    _run(8)  # warm-up: captures, pinned buffers
    seen, pending, waited = _run(40)
    assert [step for _, step in seen.at] == list(range(40))
    assert max(pending) <= REPORT_BATCH + 1 and max(pending) >= REPORT_BATCH // 2, pending
    assert len({at for at, _ in seen.at[:32]}) <= 4  # a few batches, not a fixed point each
    assert waited == []  # each copy had landed: read in place, never waited for


def test_an_overflow_mid_batch_is_decoded_at_its_own_fixed_point() -> None:
    seen, _, _ = _run(12, overflow_at=7)
    at = dict((step, when) for when, step in seen.at)
    assert at[7] == 9  # step 9's step() decodes step 7's report (the report lag): step_count 9 at the export
    assert all(at[s] == at[7] for s in range(7))
    assert [step for _, step in seen.at] == list(range(12))


def test_the_batches_add_no_sync() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).cuda()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cuda", init_scale=1024.0))
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")

    def one() -> None:
        with opt.autocast():
            loss = F.cross_entropy(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()

    for _ in range(10):
        one()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3 * REPORT_BATCH):  # batches read and decoded in place, several times over
            one()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    opt.close()
