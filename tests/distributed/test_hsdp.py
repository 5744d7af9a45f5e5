"""HSDP (FSDP2 ``fully_shard`` on a 2-D ``("replicate", "shard")`` mesh) on 4 real gloo ranks (CPU): the
replicated shards' bits are compared within each replicate group every ``consistency_every`` steps, and every
rank takes the same finding (issue 27, item 4). One spawn runs every scenario."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ampguard

from ._common import fsdp2_model, spawn, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

FLIP_STEP = 5  # the bit is flipped before step 5's update (after step 4's): step 5's check finds it
FLIP_RANK = 3  # replicate group [1, 3]; the mesh is [[0, 1], [2, 3]]: rank 3 holds the same shard as rank 1


def _run_hsdp(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out: dict[str, Any] = {}

    def flip(model: torch.nn.Module) -> Any:
        def before_step(step: int) -> None:
            if step == FLIP_STEP and rank == FLIP_RANK:  # the last mantissa bit of one element of this rank's shard
                with torch.no_grad():
                    model[0].weight.to_local().view(-1).view(torch.int32)[3] ^= 1
        return before_step

    model = fsdp2_model(mesh)
    out["placements"] = [str(p.placements) for p in model.parameters()]
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, precision="bf16",
                        config={"consistency_every": 1})
    replicas = opt.backend.replicas(list(model.parameters()))  # type: ignore[attr-defined]
    out["replicas"] = (replicas.members, replicas.ranks) if replicas is not None else None
    out["flip"] = train(opt, model, rank, FLIP_STEP + 2, before_step=flip(model))
    opt.close()

    model = fsdp2_model(mesh)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, precision="bf16",
                        config={"consistency_every": 1, "on_divergence": "raise"})
    out["raise"] = train(opt, model, rank, FLIP_STEP + 2, before_step=flip(model))
    opt.close()

    # the global gradient norm counts each shard once, not once per replica: torch's own norm of the DTensor
    # gradients (full_tensor: a collective) is the reference
    model = fsdp2_model(mesh)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, precision="bf16")
    g = torch.Generator().manual_seed(7 + rank)
    opt.backward(model(torch.randn(4, 8, generator=g)).square().mean())
    norms = [p.grad.full_tensor().norm() for p in model.parameters()]
    out["norm_ref"] = float(torch.linalg.vector_norm(torch.stack(norms)))
    out["replicas_factor"] = opt.backend.grad_replicas  # type: ignore[attr-defined]
    opt.step()
    out["norm"] = opt.last_report.grad_norm  # type: ignore[union-attr]
    opt.close()
    return out


def test_hsdp_replicas_compared_one_finding_on_every_rank() -> None:
    res = spawn(_run_hsdp, world_size=4)
    for r, out in enumerate(res):
        assert set(out["placements"]) == {"(Replicate(), Shard(dim=0))"}, out["placements"]
        assert out["replicas"] == (tuple(range(6)), (r % 2, r % 2 + 2))  # every parameter; groups [0, 2], [1, 3]

        found = out["flip"]["anomalies"]
        assert found, f"rank {r}: the flipped bit was not found"
        # healthy steps before the flip: no false alarm; then the same finding on every rank
        assert [a[:3] for a in found] == [(s, "rank_divergence", (FLIP_RANK,)) for s in range(FLIP_STEP, FLIP_STEP + 2)]
        detail = found[0][3]
        if r in (1, 3):  # the diverged replicate group names the parameter
            named = "1 parameter(s) differ in the replicate group of ranks [1, 3] (0.weight on rank(s) [3])"
            assert named in detail, detail
        else:
            assert detail.startswith("rank(s) [3] differ from the others in parameter bits (compared within"), detail
        assert out["flip"]["error"] is None and out["flip"]["skipped"] == []
        assert out["raise"]["error"] == ("RankDivergenceError", FLIP_STEP), (r, out["raise"])
        assert out["replicas_factor"] == 2 and out["norm"] == pytest.approx(out["norm_ref"], rel=1e-5), out
