"""Issue 27 on CUDA: the parameter check rides the step's report (no host sync on the fused path),
a real eps=0 NaN is named, and a fingerprint is the same on the GPU as on the CPU (exact integer
sums). Skipped without CUDA. Run: ``pytest -m gpu tests/gpu/test_gpu_integrity.py -v``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard
from ampguard.fingerprint import param_fingerprints, params_digest

from ..unit.test_integrity import _Gated

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _gated() -> nn.Module:
    """The unit tests' model (a parameter the loss never reaches), at a GPU's size."""
    return _Gated((64, 256, 10, 8))


def _run(eps: float, steps: int) -> tuple[ampguard.GuardedOptimizer, BaseException | None]:
    torch.manual_seed(0)
    model = _gated().cuda()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps, fused=True), model=model,
                        precision="fp16", scaler=torch.amp.GradScaler("cuda"),
                        config=ampguard.GuardConfig(param_check_every=1))
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    err = None
    try:
        for i in range(steps):
            with opt.autocast():
                loss = F.cross_entropy(model(x), y)
            opt.backward(loss)
            if i >= 2:  # after GradScaler's lazy init: a checked fused step makes no sync of its own
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            opt.zero_grad()
    except ampguard.NonFiniteError as e:
        err = e
    return opt, err


def test_the_parameter_check_adds_no_sync_and_names_a_real_eps0_nan() -> None:
    opt, err = _run(1e-8, 6)
    assert err is None and not [a for a in opt.anomalies if a.kind == "nonfinite_params"]
    opt.close()
    opt, err = _run(0.0, 6)
    assert err is not None and "gate" in str(err)
    found = [a for a in opt.anomalies if a.kind == "nonfinite_params"]  # steps 0 and 1: decoded two steps late
    assert found[0].step == 0 and found[0].params == ("gate",)


def test_a_fingerprint_is_the_same_on_the_gpu_and_the_cpu() -> None:
    torch.manual_seed(0)
    ts = [torch.randn(300, 77), torch.randn(5000).half(), torch.randn(33, 4096).bfloat16(), torch.randn(7)]
    assert torch.equal(param_fingerprints(ts), param_fingerprints([t.cuda() for t in ts]).cpu())
    assert torch.equal(params_digest(ts), params_digest([t.cuda() for t in ts]).cpu())


def test_the_digest_replayed_from_a_cuda_graph_is_the_eager_one_sees_every_flip_and_adds_no_sync() -> None:
    from ampguard import fingerprint

    torch.manual_seed(0)
    ts = [torch.randn(300, 77), torch.randn(5000).half(), torch.randn(5_000_000), torch.randn(33, 4096).bfloat16()]
    gpu = [t.cuda() for t in ts]
    first = params_digest(gpu)  # captured here
    assert fingerprint._REPLAYS.get(id(gpu[0])) is not None  # the graph, not the eager fallback
    assert torch.equal(first.cpu(), params_digest(ts))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            gpu[2].view(torch.int32)[123_457] ^= 1 << 3  # an in-place flip: the same storage, the graph replayed
        second = params_digest(gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ts[2].view(torch.int32)[123_457] ^= 1 << 3
    assert not torch.equal(first, second) and torch.equal(second.cpu(), params_digest(ts))
    assert torch.equal(second.cpu(), fingerprint._words(fingerprint._plan(gpu, gpu[0].device)).cpu())
