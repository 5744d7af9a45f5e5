"""Issue 15 on 2 real gloo ranks: a step where one rank's backward reached no parameter is
skipped on every rank (the gather still runs everywhere: no desync, no hang), and the next
steps are healthy on both."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ampguard

from ._common import batch, spawn, tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _no_grads_on_rank_1(rank: int, world_size: int) -> dict[str, Any]:
    return {precision: _train_no_grads_on_rank_1(rank, precision) for precision in ("fp16", "bf16")}


def _train_no_grads_on_rank_1(rank: int, precision: str) -> dict[str, Any]:
    model = tiny_model()  # no DDP: DDP's own reducer would wait for the detached rank's gradients
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, precision=precision,
                        scaler=torch.amp.GradScaler("cpu", init_scale=256.0) if precision == "fp16" else None)
    outside = torch.ones((), requires_grad=True)
    for step in range(5):
        x, y = batch(rank, step)
        with opt.autocast():
            out = model(x).float()
        if step == 2 and rank == 1:
            out = out.detach() * outside  # this rank's backward reaches no parameter
        opt.backward(torch.nn.functional.mse_loss(out, y))
        opt.step()
        opt.zero_grad()
    opt.flush()
    result = {"reasons": [r.reason for r in opt.history],
              "anomalies": [(a.step, str(a.kind), a.ranks) for a in opt.anomalies],
              "scale": opt.get_scale()}
    opt.close()
    return result


def test_one_rank_without_gradients_skips_the_step_on_every_rank():
    # before (issue 15): rank 1 raised torch's "Expected !nested_tensorlist[0].empty()" before the
    # gather; rank 0, in the gather, failed with gloo's "Connection closed by peer" when rank 1's
    # process ended (had rank 1 caught the error and gone on, rank 0 would have waited there)
    by_rank = spawn(_no_grads_on_rank_1)
    for precision in ("fp16", "bf16"):
        results = [r[precision] for r in by_rank]
        for res in results:
            assert res["reasons"] == [None, None, "no_gradients", None, None], precision
            assert res["anomalies"] == [(2, "no_gradients", (1,))], precision
        assert results[0]["scale"] == results[1]["scale"]
