"""fp8 on several ranks (issue 28, item 2): an fp8 cast that goes non-finite on one rank skips the step on every
rank, on the step itself, and every rank names the rank; that rank names the module and role. Two real gloo ranks,
DDP over a model converted with real torchao float8 (CPU: emulate=True), fp16 with a GradScaler; rank 1's targets
are, at one step, large enough that its grad_output overflows fp16 at the loss scale (a genuine overflow; its loss
stays finite)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed._common import spawn

pytest.importorskip("torchao.float8")

BAD_STEP = 2


def _body(rank: int, world_size: int) -> dict[str, Any]:
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    import ampguard

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    model = DDP(convert_to_float8_training(model, config=Float8LinearConfig(emulate=True)))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.01), model=model, scaler=scaler)
    out = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
        if step == BAD_STEP and rank == 1:
            y = y * 1e4  # rank 1 only: d loss / d out * 2**16 is beyond fp16's 65504
        with opt.autocast():
            loss = (model(x).float() - y).square().mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        r = opt.last_report
        out.append((r.skipped, str(r.reason), r.nonfinite_loss, r.loss_scale, r.next_loss_scale))
    fp8 = [(a.step, a.ranks, a.module, a.detail) for a in opt.anomalies if a.kind == "fp8_nonfinite"]
    opt.close()
    return {"reports": out, "fp8": fp8}


def test_an_fp8_cast_non_finite_on_one_rank_skips_the_step_on_every_rank_and_names_the_rank() -> None:
    ranks = spawn(_body, world_size=2)
    assert ranks[0]["reports"] == ranks[1]["reports"]  # one decision everywhere
    skipped, reason, loss_bad, scale, next_scale = ranks[0]["reports"][BAD_STEP]
    assert skipped and reason == "nonfinite_fp8" and not loss_bad and next_scale < scale
    assert [r[0] for r in ranks[0]["reports"]] == [i == BAD_STEP for i in range(4)]
    (named,), (told,) = ranks[1]["fp8"], ranks[0]["fp8"]  # (step, ranks, module, detail)
    assert named[:2] == told[:2] == (BAD_STEP, (1,))
    assert named[2] == "module.2" and "module.2, grad_output: amax inf → scale 0" in named[3]
    assert told[2] is None and "on rank(s) [1]" in told[3]


def _fsdp2_body(rank: int, world_size: int) -> dict[str, Any]:
    import math
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    import ampguard

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    model = convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # the whole weight's amax as the layer casts it (its fp32 master: torchao never casts the weight to the autocast
    # dtype first), before any update: full_tensor is a collective
    full = [float(model[i].weight.full_tensor().abs().max()) for i in (0, 2)]
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"numerics_every": 1})
    reports = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(8, 16, generator=g)
        if step == 2 and rank == 1:
            x[0, 0] = math.nan  # rank 1's batch only
        with opt.autocast():
            loss = model(x).float().square().mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        reports.append(opt.last_report)
    first = {(c.module, c.role): c.amax for c in reports[0].fp8}
    fp8 = [(a.step, a.ranks, a.module) for a in opt.anomalies if a.kind == "fp8_nonfinite"]
    opt.close()
    return {"skipped": [r.skipped for r in reports], "weights": [first[("0", "weight")], first[("2", "weight")]],
            "full": full, "fp8": fp8}


def test_fsdp2_sharded_float8_layers_are_measured_whole_and_a_rank_local_nan_skips_everywhere() -> None:
    """FSDP2 + torchao float8 (torchtitan's combination): the monitor measures a layer's weight before its forward,
    when FSDP2 has gathered it whole (after the forward it is a shard again, a DTensor that once made collect() fail
    mixing DTensor and Tensor), and a NaN in rank 1's batch skips the step on both ranks."""
    ranks = spawn(_fsdp2_body, world_size=2)
    for out in ranks:
        assert out["skipped"] == [False, False, True]
        assert out["weights"] == out["full"]  # the whole weight's amax, on both ranks
        assert [f[:2] for f in out["fp8"]] == [(2, (1,))]
    assert ranks[1]["fp8"][0][2] == "0" and ranks[0]["fp8"][0][2] is None
