"""The step's measurement replayed from a CUDA graph (``MeasureGraph``, issue 26): the same values as the eager
stages, bit for bit, and never a replay that reads gradients the step does not have.

Skipped without CUDA (CUDA graphs are CUDA's). Run: ``pytest -m gpu tests/gpu -v``.
"""

from __future__ import annotations

import os
from unittest import mock

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _guarded(graph: bool, precision: str, seed: int = 0) -> tuple[nn.Module, ampguard.GuardedOptimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**24) if precision == "fp16" else None
    with mock.patch.dict(os.environ, {"AMPGUARD_MEASURE_GRAPH": "1" if graph else "0"}):  # read at wrap time
        guard = ampguard.wrap(opt, model=model, scaler=scaler, precision=precision)
    return model, guard


def _steps(model: nn.Module, opt: ampguard.GuardedOptimizer, n: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(32, 64, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda()
        with opt.autocast():
            loss = F.cross_entropy(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _state(opt: ampguard.GuardedOptimizer) -> str:
    mg = opt._pipeline.measure_graph
    return (f"replays {mg.replays}, eager {mg.eager}, captures {mg._captures}, kept {len(mg._graphs)}, "
            f"error {mg.error}, distinct recent keys {len({str(k) for k in mg._seen})}")


def _history(opt: ampguard.GuardedOptimizer) -> list[tuple[object, ...]]:
    opt.flush()
    return [(r.step, r.skipped, r.reason, r.grad_norm, r.loss, r.loss_scale, r.next_loss_scale)
            for r in opt.history]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_replayed_measurement_is_the_eager_one_bitwise(precision: str) -> None:
    """Fused AdamW, fp16 with a GradScaler (the fast path; init_scale 2**24 makes the first steps overflow, so
    skips and back-offs are replayed too) and bf16 without one: every parameter and every report the same, bit
    for bit, with the graph and without; and the graph was replayed (it did not silently stay eager)."""
    runs = {}
    for graph in (False, True):
        model, opt = _guarded(graph, precision)
        _steps(model, opt, 16)
        runs[graph] = ([p.detach().clone() for p in model.parameters()], _history(opt),
                       opt._pipeline.measure_graph.replays)
        print(graph, _state(opt))
        opt.close()
    (p0, h0, r0), (p1, h1, r1) = runs[False], runs[True]
    assert r0 == 0 and r1 >= 10, f"replays: eager run {r0}, graphed run {r1}; {_state(opt)}"
    assert h0 == h1
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
    if precision == "fp16":
        assert any(h[1] for h in h1)  # the overflow steps were among those compared


def test_gradients_at_new_addresses_are_read_not_the_captured_ones() -> None:
    """After the graph is captured, a step whose gradients lie elsewhere (fresh tensors, the old ones kept alive so
    their memory cannot be handed back) and hold an Inf: the step is measured where they are, so it is skipped as
    non-finite. A replay keyed on anything but the gradients' addresses would read the old, finite ones."""
    model, opt = _guarded(True, "bf16")
    _steps(model, opt, 16)
    assert opt._pipeline.measure_graph.replays >= 3, _state(opt)
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    with opt.autocast():
        loss = F.cross_entropy(model(x), y)
    opt.backward(loss)
    kept = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = p.grad.clone()  # type: ignore[union-attr]
    bad = next(iter(model.parameters())).grad
    bad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert opt.step_was_skipped and opt.last_report is not None and opt.last_report.reason == "nonfinite_grad"
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    del kept
    _steps(model, opt, 4, seed=2)  # and the run goes on, graphed again
    assert not opt.step_was_skipped
    opt.close()
