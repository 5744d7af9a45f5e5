"""``GuardedOptimizer.clip_grad_norm_`` folded into the fused fast path on CUDA (issue 26): no host
sync in clip + step (``torch.cuda.set_sync_debug_mode("error")``), and the weights of the plain
GradScaler loop (unscale_ + clip_grad_norm_ + step) within float rounding."""

from __future__ import annotations

import pytest
import torch

import ampguard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CLIP = 0.05


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).cuda()


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(1)
    return [(torch.randn(32, 64, device="cuda", generator=g), torch.randn(32, 1, device="cuda", generator=g))
            for _ in range(n)]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.float16):
        return torch.nn.functional.mse_loss(model(x).float(), y)


def test_folded_clip_has_no_sync_and_matches_the_plain_loop():
    data = _data(8)
    plain = _model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    for x, y in data:
        scaler.scale(_loss(plain, x, y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    model = _model()
    guard = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), precision="fp16",
                          scaler=torch.amp.GradScaler("cuda", init_scale=1024.0), model=model)
    for i, (x, y) in enumerate(data):
        guard.backward(_loss(model, x, y))
        warm = i >= 3  # first steps: lazy init and the decision graph's capture
        torch.cuda.synchronize()
        if warm:
            torch.cuda.set_sync_debug_mode("error")
        try:
            norm = guard.clip_grad_norm_(CLIP)
            guard.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert norm.is_cuda and guard._measured is None
        guard.zero_grad()
    guard.flush()
    assert all(r.clip_coef < 1.0 for r in guard.history)
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
