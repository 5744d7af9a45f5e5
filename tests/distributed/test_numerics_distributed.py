"""The headroom scale policy (issue 17) on 2 real gloo ranks whose headrooms differ: without DDP
each rank's gradients are its own, and rank 1's loss is 64x larger. The policy decides on the
minimum headroom over ranks (gathered through the step's one collective), so both ranks end
every step with the same loss scale, the one rank 1's headroom calls for."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import ampguard
from ampguard.backends.torch_dist import TorchDistBackend

from ._common import batch, spawn, tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 12
EVERY = 2


def _run(rank: int, world_size: int, fused: bool) -> dict[str, Any]:
    model = tiny_model()  # no DDP: each rank's gradients (and headroom) are its own
    inner = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused
             else torch.optim.SGD(model.parameters(), lr=1e-3))
    opt = ampguard.wrap(inner, model=model, precision="fp16", backend=TorchDistBackend(),
                        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**-8, growth_interval=1),
                        config={"numerics_every": EVERY, "scale_policy": "headroom", "min_scale": 2.0**-20})
    for step in range(STEPS):
        x, y = batch(rank, step)
        with opt.autocast():
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y) * (64.0 if rank == 1 else 1.0)
        opt.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.flush()
    reports = [(r.step, r.loss_scale, r.next_loss_scale, r.headroom_log2, r.skipped) for r in opt.history]
    return {"reports": reports, "final": opt.scaler.get_scale()}


@pytest.mark.parametrize("fused", [False, True])
def test_ranks_with_different_headrooms_agree_on_the_scale(fused):
    r0, r1 = spawn(_run, world_size=2, fused=fused)
    assert r0["final"] == r1["final"]
    for a, b in zip(r0["reports"], r1["reports"]):
        step, scale, next_scale, h0, skipped = a
        assert (scale, next_scale, skipped) == (b[1], b[2], b[4]), (a, b)  # the same decision
        if step % EVERY:
            assert h0 is None and b[3] is None and next_scale == scale  # no growth timer
            continue
        h1 = b[3]
        assert h1 < h0 - 3  # rank 1's gradients are 64x larger: less headroom
        if not skipped:  # the smaller headroom decides, with the default margin of 2 doublings
            assert next_scale == scale * 2.0 ** (math.floor(min(h0, h1)) - 2)
    assert r0["reports"][0][2] > 2.0**-8  # it moved off the low start
