"""Leading indicators (issue 17) on 2 real gloo ranks: DDP, fp16, fused AdamW (the fast path).
Each rank reports its own per-module values (rank-local; with DDP's all-reduced gradients and
identical updates they agree), and training is bitwise what it is without them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ampguard

from ._common import spawn, tiny_model, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 9


def _run(rank: int, world_size: int, numerics_every: int | None) -> dict[str, Any]:
    model = DDP(tiny_model())
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu", growth_interval=2),
                        config={"numerics_every": numerics_every, "indicators_every": numerics_every})
    out = train(opt, model, rank, STEPS)
    out["modules"] = opt.run_info.modules
    out["indicators"] = [(r.step, r.rank, r.module_grad_norms, r.module_update_ratios) for r in opt.history]
    opt.close()
    return out


def _both(rank: int, world_size: int) -> dict[str, Any]:
    return {"off": _run(rank, world_size, None), "on": _run(rank, world_size, 4)}


def test_each_rank_reports_its_values_and_training_is_unchanged():
    results = spawn(_both)
    for rank, res in enumerate(results):
        off, on = res["off"], res["on"]
        assert torch.equal(off["params"], on["params"]) and off["skipped"] == on["skipped"]
        assert off["scale"] == on["scale"] and off["error"] is on["error"] is None
        assert on["modules"] == ("0", "2", "4") and off["modules"] == ()
        assert all(g is None and u is None for _, _, g, u in off["indicators"])
        sampled = [(s, r, g, u) for s, r, g, u in on["indicators"] if g is not None]
        assert [s for s, *_ in sampled] == [0, 4, 8]
        assert all(r == rank for _, r, _, _ in sampled)  # this rank's own report
        for step, _, grads, ratios in sampled:
            assert [m for m, _ in grads] == [m for m, _ in ratios] == ["0", "2", "4"]
            taken = step not in on["skipped"]
            assert all((v > 0) == taken for _, v in ratios)
    # DDP: the same gradients and the same update on both ranks, hence the same values
    assert [x[2:] for x in results[0]["on"]["indicators"]] == [x[2:] for x in results[1]["on"]["indicators"]]
