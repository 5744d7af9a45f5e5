"""Two ranks sharing one CUDA device over gloo (NCCL refuses two ranks on one GPU): the guard's
CUDA paths (lagged reports, the CUDA-graph decision, fused fp16 steps) with a real all-gather.

This is what a single lent GPU allows; NCCL across GPUs is issue 8's, on a multi-GPU machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ampguard
from ampguard import faults

from ..distributed._common import spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(rank: int, world: int, fused: bool, device: str = "cuda") -> dict[str, Any]:
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if dev.type == "cuda" else None)
    inner = torch.optim.AdamW(ddp.parameters(), lr=1e-3, **({"fused": True} if fused else {"foreach": True}))
    opt = ampguard.wrap(inner, model=ddp, scaler=torch.amp.GradScaler(dev.type, init_scale=1024.0),
                        config={"hysteresis": 2, "max_consecutive_skips": 4})
    faults.inject(opt, faults.loss("nan", steps=[3], ranks=[1]),
                  faults.grad("2.weight", "inf", steps=[6, 7], ranks=[1]),
                  faults.grad("0.weight", "nan", steps=[10], ranks=[0], after_reduction=True))
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(20):
        x = torch.randn(16, 32, generator=g).to(dev)
        y = torch.randint(0, 4, (16,), generator=g).to(dev)
        with opt.autocast():
            loss = F.cross_entropy(ddp(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    opt.flush()
    return {
        "skipped": [r.step for r in opt.history if r.skipped],
        "origins": {r.step: r.nonfinite_ranks for r in opt.history if r.skipped},
        "scales": [r.loss_scale for r in opt.history],
        "params": [p.detach().cpu() for p in model.parameters()],
        "graph": opt._pipeline.graph._graph is not None,
        "host": opt._pipeline.host_decision,
    }


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_two_ranks_on_one_gpu_agree(fused):
    r0, r1 = spawn(_run, fused=fused)
    assert r0["skipped"] == r1["skipped"] == [3, 6, 7, 10]
    assert r0["origins"] == r1["origins"] == {3: (1,), 6: (1,), 7: (1,), 10: (0,)}
    assert r0["scales"] == r1["scales"]
    assert r0["scales"][8] == r0["scales"][0] / 2  # hysteresis 2: the second overflow backed off
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    # the decision ran from a CUDA graph: sync-free fused; non-fused, its step reads the decision's skip flag (stop
    # 55; before, it decided on the host from one copy of the statistics)
    assert r0["graph"] and r1["graph"] and not (r0["host"] or r1["host"])
