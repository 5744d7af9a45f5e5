"""The per-tensor norms every step reads (``ampguard.stats.per_tensor_norms``): what they equal,
and the grouping they follow, on the paths the step takes."""

from __future__ import annotations

import math

import torch

from ampguard.stats import cpu_norms, grads_by_device_and_dtype, per_tensor_norms


def _params(shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.randn(shape, generator=g).to(dtype) * 3.0
        out.append(p)
    return out


def test_cpu_norms_are_within_float32_rounding_of_a_float64_norm_and_scale_exactly():
    params = _params([(512, 512), (512,), (100, 512), (7,), (0,)])
    grads = [p.grad for p in params]
    got = cpu_norms(grads).tolist()
    for n, g in zip(got, grads):
        ref = g.double().norm().item()
        assert (n == ref == 0.0) or abs(n - ref) <= 1e-5 * ref
    # scaling by a power of two commutes exactly (what the fused fast path relies on)
    assert cpu_norms([g * 2.0**-12 for g in grads]).tolist() == [n * 2.0**-12 for n in got]


def test_cpu_norms_of_non_finite_gradients_are_non_finite():
    params = _params([(4, 4), (3,)])
    params[0].grad[1, 2] = math.inf
    params[1].grad[0] = math.nan
    a, b = cpu_norms([p.grad for p in params]).tolist()
    assert a == math.inf and math.isnan(b)


def test_one_group_and_several_groups_follow_the_helpers_order():
    params = _params([(3,), (4,), (5,)])
    params[1].grad = None
    groups = grads_by_device_and_dtype(params)
    assert groups.index == [0, 2] and list(groups.tensors) == [(torch.device("cpu"), torch.float32)]
    mixed = _params([(3,), (4,)]) + _params([(5,)], torch.float64) + _params([(6,)])
    groups = grads_by_device_and_dtype(mixed)
    assert {k[1] for k in groups.tensors} == {torch.float32, torch.float64}
    flat = [g for grads in groups.tensors.values() for g in grads]
    assert sorted(groups.index) == [0, 1, 2, 3]  # the helper's grouping; k-th tensor is parameter index[k]'s
    assert all(g is mixed[i].grad for g, i in zip(flat, groups.index))
    norms = per_tensor_norms(groups, torch.device("cpu")).tolist()
    expect = [mixed[i].grad.double().norm().item() for i in groups.index]
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, expect))

