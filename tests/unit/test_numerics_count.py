"""The sampled numerics' zero counts and headroom (``GuardConfig.numerics_every``): exact counts by one read off the
CPU (``numerics.chunked_count``, where ``torch.count_nonzero`` writes a bool and a long copy of each gradient on
CUDA), and no headroom read where there is no GradScaler (bf16: its reduction over every gradient was made and
thrown away). The CUDA side, without the temporaries: tests/gpu/test_gpu_numerics.py."""

from __future__ import annotations

import math

import pytest
import torch

import ampguard
from ampguard import numerics
from ampguard.numerics import chunked_count

from ._models import guarded_steps, make_data, make_model


def test_chunked_counts_are_count_nonzero_exactly_past_float32s_integers() -> None:
    """A tensor of 2**24 + 4099 elements with zeros, NaNs and Infs: its count, in chunks of at most 2**24 and in
    small chunks, is ``count_nonzero``'s, to the unit (a float32 sum of that many ones is not exact past 2**24)."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn((1 << 24) + 4099, generator=g)
    t[torch.rand(t.shape, generator=g) < 0.3] = 0.0
    t[5], t[7], t[(1 << 24) + 1] = math.nan, math.inf, -math.inf
    want = torch.count_nonzero(t).item()
    assert chunked_count(t).item() == want
    assert chunked_count(t, chunk=1000).item() == want
    assert chunked_count(t[:100].view(10, 10)).item() == torch.count_nonzero(t[:100]).item()
    assert chunked_count(t).dtype == torch.float64 and chunked_count(t).dim() == 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_headroom_read_is_made_only_with_a_grad_scaler(monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    """bf16: a sampled step reads no max|g| (the headroom it would give is never reported); fp16 reads it once per
    (device, dtype) group and reports the headroom. The zero fraction is reported either way."""
    calls = []
    peak = numerics._peak
    monkeypatch.setattr(numerics, "_peak", lambda grads: calls.append(len(grads)) or peak(grads))
    model = make_model(0)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision=precision,
                        config={"numerics_every": 1})
    guarded_steps(opt, model, make_data(2))
    opt.flush()
    reports = opt.history
    assert all(r.grad_zero_fraction is not None for r in reports)
    if precision == "bf16":
        assert calls == [] and all(r.headroom_log2 is None for r in reports)
    else:
        assert len(calls) == 2 and all(r.headroom_log2 is not None for r in reports)
    opt.close()
