"""Reading never acts: a rank that reads its reports early changes nothing about when the
escalation ladder's on_abort (here a collective) runs, or when training stops."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import ampguard
from ampguard import faults

from ._common import spawn

pytestmark = pytest.mark.distributed


def _run(rank: int, world: int, reader_rank: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    calls: list[int] = []

    def on_abort(opt: Any, diagnosis: str) -> None:
        calls.append(opt.step_count)
        dist.barrier()  # a collective, as a user's "save a checkpoint before stopping" is

    ladder = ampguard.Escalation(rollback_after=2, snapshot_every=None)
    config = ampguard.GuardConfig(escalation=ladder, forensics=False)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)  # fused: the step does not sync
    opt = ampguard.wrap(inner, model=model, precision="bf16", config=config,
                        on_abort=on_abort)
    opt._lagged_reports = True  # the fused-CUDA schedule (reports decoded one step late), here on CPU
    faults.inject(opt, model, faults.loss("nan", steps=[3, 4]))
    g = torch.Generator().manual_seed(rank)
    stopped_at = None
    for _ in range(8):
        x = torch.randn(4, 8, generator=g)
        opt.backward(model(x).square().mean())
        try:
            opt.step()
        except ampguard.NonFiniteError:
            stopped_at = opt.step_count
            break
        opt.zero_grad()
        if rank == reader_rank:  # every reader, right after each step, on this rank only
            _ = (opt.last_report, opt.history, opt.anomalies, opt.step_was_skipped, opt.skipped_steps)
            opt.state_dict()
            opt.flush()
    return {"on_abort_at": calls, "stopped_at": stopped_at}


def test_reading_on_one_rank_does_not_move_on_abort():
    quiet = spawn(_run, reader_rank=None)
    eager = spawn(_run, reader_rank=0)
    assert quiet[0] == quiet[1] and quiet[0]["on_abort_at"] and quiet[0]["stopped_at"] is not None
    assert eager == quiet, f"reading on rank 0 changed when on_abort ran: {eager} vs {quiet}"


def _run_schedule(rank: int, world: int, reader_rank: int | None) -> dict[str, Any]:
    """opt.schedule + EMA on the sync-free path (emulated): every update on every rank reads the
    same LR, whatever one rank reads, saves or flushes in between (those apply a pending advance
    early on that rank only)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=0.01, fused=True), model=model, precision="bf16")
    opt._lagged_reports = True  # the fused-CUDA schedule, here on CPU
    opt._pipeline.host_decision = False  # the tensor decision
    sched = opt.schedule(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    ema = opt.track_ema(ampguard.EMA(model, 0.9))
    faults.inject(opt, model, faults.loss("nan", steps=[2, 5], ranks=[1]))
    lrs: list[float] = []
    opt.register_pre_unscale_hook(lambda step: lrs.append(opt.param_groups[0]["lr"]))
    g = torch.Generator().manual_seed(rank)
    for _ in range(8):
        opt.backward(model(torch.randn(4, 8, generator=g)).square().mean())
        opt.step()
        opt.zero_grad()
        if rank == reader_rank:
            _ = (opt.last_report, opt.step_was_skipped, sched.get_last_lr())
            opt.state_dict()
            sched.state_dict()
            opt.flush()
    opt.flush()
    skipped = [r.step for r in opt.history if r.skipped]
    out = {"lrs": lrs, "last_epoch": sched.last_epoch, "skipped": skipped,
           "ema": [t.tolist() for t in ema.averaged.values()] if rank == 0 else None}
    opt.close()
    return out


def test_schedule_and_ema_agree_across_ranks_whatever_one_rank_reads():
    quiet = spawn(_run_schedule, reader_rank=None)
    eager = spawn(_run_schedule, reader_rank=1)
    assert quiet[0]["skipped"] == [2, 5] and quiet[0]["last_epoch"] == 6
    assert quiet[0]["lrs"] == quiet[1]["lrs"] == [0.01 * 0.5**n for n in (0, 1, 2, 2, 3, 4, 4, 5)]
    assert eager == quiet
