"""The fused fast path (issue 16) on 2 real gloo ranks: DDP, fp16, fused AdamW. The guarded run
takes the fast path on every step, and every rank ends bitwise where the plain fused GradScaler
loop ends, with the same skips (an inf in rank 1's loss reaches both ranks through the
all-reduce) and the same scale; with the same per-step norms on both ranks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ampguard

from ._common import batch, flat_params, spawn, tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 10
INF_STEP = 3  # rank 1's loss times inf


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    loss = torch.nn.functional.mse_loss(out.float(), y)
    return loss * math.inf if (rank == 1 and step == INF_STEP) else loss


def _run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # the plain fused GradScaler loop
    model = DDP(tiny_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    scales = []
    for step in range(STEPS):
        scales.append(scaler.get_scale())
        scaler.scale(_loss(model, rank, step)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    out["plain"] = {"params": flat_params(model), "scales": scales, "final": scaler.get_scale()}

    # the guarded loop, fast path spied on
    model = DDP(tiny_model())
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    guard = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model,
                          precision="fp16", scaler=scaler)
    taken: list[bool] = []
    measure = guard._pipeline.measure

    def spy(g: Any, **kw: Any) -> Any:
        m = measure(g, **kw)
        taken.append(m.scaled)
        return m

    guard._pipeline.measure = spy  # type: ignore[method-assign]
    for step in range(STEPS):
        guard.backward(_loss(model, rank, step))
        guard.step()
        guard.zero_grad(set_to_none=True)
    guard.flush()
    hist = list(guard.history)
    out["guard"] = {"params": flat_params(model), "scales": [r.loss_scale for r in hist], "final": guard.get_scale(),
                    "skipped": [r.step for r in hist if r.skipped], "taken": taken,
                    "norms": [r.grad_norm for r in hist]}
    guard.close()
    return out


def test_fast_path_on_two_ranks_is_bitwise_the_plain_fused_loop() -> None:
    res = spawn(_run)
    for r, out in enumerate(res):
        plain, guard = out["plain"], out["guard"]
        assert guard["taken"] == [True] * STEPS, f"rank {r}: fast path not taken on every step"
        assert torch.equal(guard["params"], plain["params"]), f"rank {r}: parameters differ from the plain loop's"
        assert guard["scales"] == plain["scales"] and guard["final"] == plain["final"], f"rank {r}: scales differ"
        assert INF_STEP in guard["skipped"], f"rank {r}: the inf step was not skipped"
    assert torch.equal(res[0]["guard"]["params"], res[1]["guard"]["params"])
    a, b = res[0]["guard"]["norms"], res[1]["guard"]["norms"]
    assert all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))
