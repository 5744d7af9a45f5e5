"""Forensics on 2 gloo ranks: the fault on one rank is localised, and every rank agrees on the view."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ampguard
from ampguard import faults
from tests.unit._models import step_once

from ._common import spawn

pytestmark = pytest.mark.distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1))


def _run_forensics(rank: int, world: int, closure: bool) -> dict[str, Any]:
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"escalation": {"rollback_after": 2, "window": 3, "snapshot_every": 2,
                                               "max_rollbacks": 1}})
    faults.inject(opt,
                  faults.loss("nan", steps=[1], ranks=[0]),            # arms the hooks on every rank
                  faults.output("2", "nan", steps=[4], ranks=[1]),     # the fault under test, rank 1 only
                  faults.output("0", "nan", steps=[7], ranks=[1], transient=True),
                  faults.grad("4.weight", "inf", steps=[10, 11], ranks=[0]))  # two in a window: rollback
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(14):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

        def run(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            opt.zero_grad()
            with opt.autocast():
                loss = F.mse_loss(model(x).float(), y)
            opt.backward(loss)

        step_once(opt, run, closure=closure)
    opt.close()
    return {
        "anomalies": [(a.step, a.kind, a.ranks, a.module, a.phase, a.cause, a.detail) for a in opt.anomalies],
        "params": [p.detach().clone() for p in model.parameters()],
        "skipped": [r.step for r in opt.history if r.skipped],
    }


@pytest.mark.parametrize("closure", [False, True], ids=["hooks", "replay"])
def test_fault_on_one_rank_is_localised_and_agreed(closure):
    results = spawn(_run_forensics, closure=closure)
    a0, a1 = results[0]["anomalies"], results[1]["anomalies"]
    assert [x[:6] for x in a0] == [x[:6] for x in a1]  # the same view on every rank
    by_step = {x[0]: x for x in a0 if x[3] is not None}
    step4 = by_step[4]
    assert step4[2] == (1,) and step4[3] == "2" and step4[4] == "forward"
    assert "rank 1:" in step4[6]
    if closure:
        step7 = by_step[7]
        assert step7[2] == (1,) and step7[3] == "0" and step7[5] == "transient"
    assert any(x[0] == 11 and x[1] == "rollback" for x in a0)  # every rank took the same rung
    assert results[0]["skipped"] == results[1]["skipped"]
    for p0, p1 in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(p0, p1)


def _run_fsdp2_module_faults(rank: int, world: int) -> list[tuple[int, str | None, tuple[int, ...]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16")
    # faults.grad cannot reach FSDP2's sharded parameters before the reduce-scatter; module
    # faults act on the unsharded computation, so they can.
    faults.inject(opt, faults.backward("2", "inf", steps=[2], ranks=[1]),
                  faults.output("0", "nan", steps=[4], ranks=[0]))
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        with opt.autocast():
            loss = F.mse_loss(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    return [(r.step, r.reason, r.nonfinite_ranks) for r in opt.history if r.skipped]


def test_fsdp2_module_faults_on_one_rank():
    r0, r1 = spawn(_run_fsdp2_module_faults)
    assert r0 == r1 == [(2, "nonfinite_grad", (1,)), (4, "nonfinite_loss", (0,))]


def _run_gather_mode(rank: int, world: int, mode: str) -> dict[str, Any]:
    from ampguard.backends.torch_dist import TorchDistBackend

    model = torch.nn.parallel.DistributedDataParallel(_model())
    backend = TorchDistBackend(gather=mode)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu", init_scale=256.0), backend=backend)
    faults.inject(opt, faults.loss("nan", steps=[2], ranks=[1]), faults.grad("4.weight", "inf", steps=[5], ranks=[0]))
    g = torch.Generator().manual_seed(rank)
    for _ in range(8):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        with opt.autocast():
            loss = F.mse_loss(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    opt.close()
    return {"gather": backend.gather,
            "reports": [(r.step, r.skipped, r.reason, r.nonfinite_ranks, r.loss_scale, r.grad_norm, r.loss)
                        for r in opt.history],
            "params": [p.detach().clone() for p in model.parameters()]}


def test_all_reduce_assembly_equals_all_gather():
    """The large-world path (a sum all-reduce of one row per rank) decides exactly as the all-gather."""
    a = spawn(_run_gather_mode, mode="all_gather")
    b = spawn(_run_gather_mode, mode="all_reduce")
    assert [r["gather"] for r in a] == ["all_gather"] * 2 and [r["gather"] for r in b] == ["all_reduce"] * 2
    for ra, rb in zip(a, b):
        assert str(ra["reports"]) == str(rb["reports"])  # str: NaN losses compare equal as text
        assert all(torch.equal(x, y) for x, y in zip(ra["params"], rb["params"]))
    assert [r[3] for r in a[0]["reports"] if r[1]] == [(1,), (0,)]
