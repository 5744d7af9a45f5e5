"""The z-score detector and ZClip on 2 real gloo ranks (CPU): only rank 1's batch spikes, and every
rank takes the same decision (flag, skip, clip coefficient, thresholds) at the same step, because
it is decided from the gathered values. With DDP (averaged gradients) and without (each rank's own
gradients: the gathered maximum decides)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ampguard
from ampguard import faults

from ._common import flat_params, spawn, tiny_model, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS, SPIKE = 30, 22
CONFIG = {"spikes": {"grad_zscore": 4.0, "warmup": 10, "action": "skip"},
          "zclip": {"warmup": 10, "alpha": 0.9, "z": 2.0}}


def _train(rank: int, ddp: bool) -> dict[str, Any]:
    model = tiny_model()
    net = DDP(model) if ddp else model
    opt = ampguard.wrap(torch.optim.AdamW(net.parameters(), lr=1e-2), model=net, precision="bf16", config=CONFIG)
    # a bad batch on rank 1 only: its loss times 1000, before backward (so before DDP's reduction)
    with faults.inject(opt, net, faults.loss(1000.0, mode="mul", steps=[SPIKE], ranks=[1])):
        train(opt, net, rank, STEPS)
    hist = list(opt.history)
    spikes = opt._pipeline.spikes
    out = {
        "decisions": [(r.grad_spike, r.skipped, r.clip_coef, r.spike_threshold, r.clip_threshold, r.grad_norm)
                      for r in hist],
        "state": [t.item() for t in (spikes.count, spikes.z_mean, spikes.z_var, spikes.clip_mean, spikes.clip_var,
                                     spikes.clip_count)],
        "params": flat_params(model),
    }
    opt.close()
    return out


def _run(rank: int, world_size: int) -> dict[str, Any]:
    return {"ddp": _train(rank, ddp=True), "local": _train(rank, ddp=False)}


def test_one_rank_spikes_every_rank_decides_the_same() -> None:
    res = spawn(_run)
    for mode in ("ddp", "local"):
        a, b = res[0][mode], res[1][mode]
        assert a["decisions"] == b["decisions"], mode
        assert a["state"] == b["state"], mode
        flagged = [s for s, d in enumerate(a["decisions"]) if d[0]]
        # without DDP the decision reads the larger of two ranks' own norms: a noisier series, where
        # a short warm-up also flags a healthy step; agreeing on it is what is tested here
        assert flagged == [SPIKE] if mode == "ddp" else SPIKE in flagged, (mode, flagged)
        assert a["decisions"][SPIKE][1]  # skipped on every rank
        assert a["decisions"][SPIKE][2] < 1.0  # and ZClip's coefficient agreed on too
    assert torch.equal(res[0]["ddp"]["params"], res[1]["ddp"]["params"])
