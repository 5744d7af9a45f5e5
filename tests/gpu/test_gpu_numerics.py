"""On CUDA: the sampled numerics' zero counts (``GuardConfig.numerics_every``) read each gradient once and make no
temporary the size of a gradient (``torch.count_nonzero`` there is ``(g != 0).sum()``: a bool copy, then a long one
before the sum; stop 43's H100 profile put ~1.25 ms of kernels a sampled step on GPT-2 124M's gradients), and count
exactly, also past 2**24 elements.

Skipped without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from ampguard.numerics import Numerics, chunked_count, nonzero_count
from ampguard.stats import grads_by_device_and_dtype

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_counts_are_count_nonzero_exactly_past_float32s_integers() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn((1 << 24) + 4099, generator=g, device="cuda")
    t[torch.rand(t.shape, generator=g, device="cuda") < 0.3] = 0.0
    t[5], t[7], t[(1 << 24) + 1] = math.nan, math.inf, -math.inf
    want = torch.count_nonzero(t).item()
    assert nonzero_count(t).item() == want and chunked_count(t, chunk=1 << 20).item() == want


@pytest.mark.parametrize("headroom", [False, True])
def test_a_sampled_measurement_makes_no_gradient_sized_temporary(headroom: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048)).cuda()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * (torch.rand_like(p) > 0.25)  # a quarter of each gradient exactly zero
    params = list(model.parameters())
    groups = grads_by_device_and_dtype(params)
    measure = Numerics(1, device=torch.device("cuda"), headroom=headroom)
    param_groups = [{"params": params}]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = measure.measure(groups, param_groups, None)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    largest = max(p.numel() for p in params)  # 8M elements: a bool copy alone is 8 MB
    assert extra < largest // 8, extra
    zeros = sum(p.numel() - torch.count_nonzero(p.grad).item() for p in params)
    assert out[0].item() == pytest.approx(zeros / sum(p.numel() for p in params), rel=0, abs=1e-7)
    assert math.isnan(out[1].item()) != headroom  # no headroom without a GradScaler: NaN
