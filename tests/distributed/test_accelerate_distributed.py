"""The guard inside a real ``Accelerator`` on 2 gloo ranks (accelerate's ``MULTI_CPU``: its DDP over the process
group), fp16 through accelerate's own GradScaler path as it runs on CUDA (the CPU stand-in of
tests/frameworks/test_accelerate.py), its documented loop with ``clip_grad_norm_``. A corrupt sample on one rank
only (an inf in rank 1's input at step 2: the loss goes non-finite there, and DDP's all-reduce carries it to rank 0's
gradients): the guarded run skips that step on both ranks, names rank 1 as where it came from, and ends bit for
bit where accelerate's own loop ends, the same on both ranks. No test ran accelerate on several ranks before.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import ampguard

from ..unit._models import loss_of, make_data, make_model
from ._common import assert_one_rank_fault, reports_and_params, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.frameworks, pytest.mark.timeout(240)]

STEPS, BAD_STEP, BAD_RANK = 6, 2, 1


def _run(rank: int, world_size: int) -> dict[str, Any]:
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # what `accelerate launch` sets
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    out: dict[str, Any] = {}
    for guarded in (False, True):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        acc = Accelerator(mixed_precision="fp16", cpu=True)
        acc.native_amp = True  # what Accelerator.__init__ does for fp16 on CUDA
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
        model = make_model(0)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        out["distributed_type"], out["world_size"] = str(acc.distributed_type), acc.num_processes
        if guarded:
            opt = ampguard.wrap(opt, accelerator=acc, model=model)
        skipped = []
        for step, (x, y) in enumerate(make_data(STEPS, seed=1 + rank)):  # each rank its own data
            if step == BAD_STEP and rank == BAD_RANK:
                x[0, 0] = float("inf")
            acc.backward(loss_of(model, x, y))
            acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            skipped.append(acc.optimizer_step_was_skipped)
        reports, params = reports_and_params(opt.guard if guarded else None, model)
        out["guard" if guarded else "plain"] = (skipped, params)
        if guarded:
            out["reports"] = reports
            opt.close()
    return out


def test_one_ranks_corrupt_sample_is_skipped_on_every_rank_as_accelerate_skips_it() -> None:
    res = spawn(_run, world_size=2)
    bad = [False] * STEPS
    bad[BAD_STEP] = True
    assert_one_rank_fault(res, "reports", BAD_STEP, BAD_RANK)
    for r, out in enumerate(res):
        assert out["distributed_type"] == "DistributedType.MULTI_CPU", r
        assert out["plain"][0] == out["guard"][0] == bad, r
        assert torch.equal(out["guard"][1], out["plain"][1]), r
    assert torch.equal(res[0]["guard"][1], res[1]["guard"][1])
