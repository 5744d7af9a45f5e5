"""Leading indicators (issue 17) on CUDA: a sampled step adds no host sync (the CUDA-graph decision
replayed, the values riding the lagged report), the values equal an independent computation, and
the parameters are bitwise those of a run without them.

Skipped without CUDA. Run: ``pytest -m gpu tests/gpu/test_gpu_indicators.py -v``."""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the identity test

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 256)
        self.body = nn.Sequential(nn.GELU(), nn.Linear(256, 256), nn.GELU())
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def _guard(every: int | None) -> tuple[nn.Module, ampguard.GuardedOptimizer]:
    torch.manual_seed(0)
    model = Net().cuda()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cuda", init_scale=2.0**10),
                        config={"numerics_every": every, "indicators_every": every})
    return model, opt


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 64, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda())
            for _ in range(n)]


def _step(model: nn.Module, opt: ampguard.GuardedOptimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    with opt.autocast():
        loss = F.cross_entropy(model(x), y)
    opt.backward(loss)
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_sampled_steps_add_no_sync_and_the_values_are_exact_and_the_run_unchanged():
    batches = _batches(12)
    model, opt = _guard(2)
    for b in batches[:4]:  # warm-up: lazy init, the decision's CUDA-graph capture, the segment index
        _step(model, opt, *b)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches[4:8]:  # two sampled steps (4, 6), two not
            _step(model, opt, *b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # step 8, sampled, against an independent computation
    x, y = batches[8]
    with opt.autocast():
        loss = F.cross_entropy(model(x), y)
    opt.backward(loss)
    scale = opt.get_scale()
    members = {"embed": list(model.embed.parameters()), "body": list(model.body.parameters()),
               "head": list(model.head.parameters())}
    grads = {m: torch.cat([p.grad.float().flatten() / scale for p in ps]) for m, ps in members.items()}
    before = {m: [p.detach().clone() for p in ps] for m, ps in members.items()}
    opt.step()
    opt.zero_grad(set_to_none=True)
    want = {m: (torch.linalg.vector_norm(grads[m]).item(),
                (torch.linalg.vector_norm(torch.cat([(p.detach() - b).flatten() for p, b in zip(ps, before[m])]))
                 / torch.linalg.vector_norm(torch.cat([b.flatten() for b in before[m]]))).item())
            for m, ps in members.items()}
    for b in batches[9:]:
        _step(model, opt, *b)
    reports = list(opt.history)
    assert [r.step for r in reports if r.module_grad_norms is not None] == [0, 2, 4, 6, 8, 10]
    r = reports[8]
    assert not r.skipped
    for m, (norm, ratio) in want.items():
        assert dict(r.module_grad_norms)[m] == pytest.approx(norm, rel=1e-5)
        assert dict(r.module_update_ratios)[m] == pytest.approx(ratio, rel=1e-4)
    params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    model_off, opt_off = _guard(None)
    for b in batches:
        _step(model_off, opt_off, *b)
    opt_off.close()
    assert all(torch.equal(a, b) for a, b in zip(params, model_off.parameters()))
