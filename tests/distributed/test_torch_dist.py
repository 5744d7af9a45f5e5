"""DDP and FSDP2 on 2 real gloo ranks (CPU): one decision on every rank, attribution,
consistency checks, escalation. Each test spawns the ranks once and runs several scenarios
in them (a spawn costs seconds; a scenario, a fraction of one)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ampguard
from ampguard import faults
from ampguard.backends.torch_dist import TorchDistBackend, compose_comm_hook

from ._common import assert_same_everywhere, fsdp2_model, spawn, standard_faults, tiny_model, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 8
HEALTHY_STEPS = 1000


def _adamw(model: torch.nn.Module, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)


# ---------------------------------------------------------------------------------- DDP
def _run_ddp(rank: int, world_size: int, fused: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}

    # 1. faults on rank 1 only: loss (step 2), gradient before (4) and after (6) reduction; fp16
    model = DDP(tiny_model())
    opt = ampguard.wrap(_adamw(model, fused), model=model, precision="fp16", config={"consistency_every": 1})
    assert isinstance(opt.backend, TorchDistBackend) and opt.backend.world_size == 2
    with faults.inject(opt, model, *standard_faults("0.weight")):
        out["faults"] = train(opt, model, rank, STEPS)
    opt.close()

    # 2. no_sync() accumulation (2 micro-batches), an inf in rank 1's first micro-batch at step 3;
    #    the user's own comm hook composed with the guard's check
    model = DDP(tiny_model())
    calls = []

    def user_hook(state: Any, bucket: Any) -> Any:
        calls.append(1)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, compose_comm_hook(user_hook))
    opt = ampguard.wrap(_adamw(model, fused), model=model, precision="bf16")
    grad_fault = faults.grad("2.weight", "inf", steps=[3], ranks=[1])
    with faults.inject(opt, model, grad_fault) as inj:
        out["no_sync"] = train(opt, model, rank, 6, micro_batches=2, no_sync=model.no_sync)
        out["no_sync_fired"] = [(s, r) for s, r, _ in inj.fired]
    out["user_hook_calls"] = len(calls)
    opt.close()

    # 3. one bit flipped in one element of rank 1's 0.bias after step 2 (through its integer view: the
    #    last mantissa bit, a finite, plausible value): the check every 2 steps names rank 1 and 0.bias
    model = DDP(tiny_model())
    opt = ampguard.wrap(_adamw(model, fused), model=model, precision="bf16", config={"consistency_every": 2})

    def perturb(step: int) -> None:
        if step == 2 and rank == 1:
            with torch.no_grad():
                model.module[0].bias.view(torch.int32)[0] ^= 1

    out["divergence"] = train(opt, model, rank, 6, before_step=perturb)
    opt.close()

    # 3b. the same with on_divergence="raise": every rank raises at the same step
    model = DDP(tiny_model())
    opt = ampguard.wrap(_adamw(model, fused), model=model, precision="bf16",
                        config={"consistency_every": 2, "on_divergence": "raise"})
    out["divergence_raise"] = train(opt, model, rank, 6, before_step=perturb)
    opt.close()

    # 3c. healthy steps compared at every step: no false alarm (the fingerprints are bitwise, and DDP
    #     replicas are bitwise equal)
    if not fused:
        model = DDP(tiny_model())
        opt = ampguard.wrap(_adamw(model, fused), model=model, precision="bf16", config={"consistency_every": 1})
        out["healthy_checked"] = train(opt, model, rank, HEALTHY_STEPS)
        opt.close()

    # 4. max_consecutive_skips=3, the loss NaN on rank 0 only from step 2 on: every rank raises at step 4
    model = DDP(tiny_model())
    opt = ampguard.wrap(_adamw(model, fused), model=model, precision="fp16",
                        config={"max_consecutive_skips": 3})
    with faults.inject(opt, model, faults.loss("nan", steps=range(2, 100), ranks=[0])):
        out["escalate"] = train(opt, model, rank, STEPS)
    opt.close()

    # 5. an explicit process group, passed as backend= (wrap() accepts a backend instance)
    group = dist.new_group([0, 1])
    model = DDP(tiny_model(), process_group=group)
    opt = ampguard.wrap(_adamw(model, fused), model=model, precision="bf16", backend=TorchDistBackend(group=group))
    with faults.inject(opt, model, faults.loss("nan", steps=[1], ranks=[0])):
        out["group"] = train(opt, model, rank, 3)
    opt.close()

    # 6. a user comm hook that was not composed: a warning, and attribution through tensor hooks
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = DDP(tiny_model())
    model.register_comm_hook(None, allreduce_hook)
    with pytest.warns(UserWarning, match="compose_comm_hook"):
        opt = ampguard.wrap(_adamw(model, fused), model=model, precision="bf16")
    with faults.inject(opt, model, faults.grad("4.weight", "nan", steps=[1], ranks=[1])):
        out["raw_hook"] = train(opt, model, rank, 3)
    opt.close()
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_ddp_one_decision_on_every_rank(fused: bool) -> None:
    res = spawn(_run_ddp, fused=fused)

    # faults on rank 1 only: same skipped steps, same parameters and scale, rank 1 named
    faulted = [r["faults"] for r in res]
    assert_same_everywhere(faulted, skipped=[2, 4, 6], origin=1)
    assert not [a for r in faulted for a in r["anomalies"] if a[1] == "rank_divergence"]  # checked every step
    assert faulted[0]["reasons"] == {2: "nonfinite_loss", 4: "nonfinite_grad", 6: "nonfinite_grad"}
    assert faulted[0]["scale"] < 65536.0  # the fp16 scale backed off for the two gradient overflows

    # no_sync accumulation
    ns = [r["no_sync"] for r in res]
    assert_same_everywhere(ns, skipped=[3], origin=1)
    assert set(res[1]["no_sync_fired"]) == {(3, 1)} and res[0]["no_sync_fired"] == []
    assert all(r["user_hook_calls"] > 0 for r in res)  # the user's hook did the reduction

    # consistency check names the perturbed rank, on every rank
    for r in res:
        kinds = [(a[0], a[1], a[2]) for a in r["divergence"]["anomalies"]]
        assert kinds and all(k == (3, "rank_divergence", (1,)) or k[0] > 3 for k in kinds), kinds
        assert kinds[0] == (3, "rank_divergence", (1,))
        assert "0.bias on rank(s) [1]" in r["divergence"]["anomalies"][0][3], r["divergence"]["anomalies"][0]
        assert r["divergence_raise"]["error"] == ("RankDivergenceError", 3)
        if not fused:
            assert not r["healthy_checked"]["anomalies"] and r["healthy_checked"]["error"] is None

    # escalation on every rank at the same step
    for r in res:
        assert r["escalate"]["error"] == ("NonFiniteError", 4)
        assert r["escalate"]["skipped"] == [2, 3, 4]
        assert r["escalate"]["nonfinite_ranks"][2] == (0,)

    assert_same_everywhere([r["group"] for r in res], skipped=[1], origin=0)
    assert_same_everywhere([r["raw_hook"] for r in res], skipped=[1], origin=1)


# ---------------------------------------------------------------------------------- FSDP2
def _run_fsdp2(rank: int, world_size: int, fused: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}

    # faults on rank 1 only. FSDP2's sharded parameters get their gradients from the
    # reduce-scatter, so the before-reduction gradient fault is faults.backward on the first ReLU
    # (an inf in the gradient its backward hands the first Linear, on rank 1 at step 4), not
    # faults.grad.
    model = fsdp2_model(mesh)
    opt = ampguard.wrap(_adamw(model, fused), model=model, precision="fp16", config={"consistency_every": 1})
    assert opt.backend.grads_sharded

    def after_reduction(step: int) -> None:
        # rank 1's shard of a reduced gradient, corrupted locally (faults.grad(after_reduction=True)
        # would write through the DTensor, which dispatches a collective on rank 1 alone)
        if step == 6 and rank == 1:
            model[0].weight.grad.to_local().view(-1)[0] = float("nan")

    with faults.inject(opt, model, faults.loss("nan", steps=[2], ranks=[1]),
                       faults.backward("1", "inf", steps=[4], ranks=[1])):
        out["faults"] = train(opt, model, rank, STEPS, before_step=after_reduction)
    opt.close()

    # the global norm of sharded gradients equals the unsharded model's (checked in the parent)
    model = fsdp2_model(mesh)
    opt = ampguard.wrap(_adamw(model, fused), model=model, precision="bf16")
    x = torch.ones(4, 8)
    with opt.autocast():
        loss = model(x).float().square().mean()
    opt.backward(loss)
    opt.step()
    out["norm"] = opt.last_report.grad_norm  # type: ignore[union-attr]
    opt.close()

    # escalation
    model = fsdp2_model(mesh)
    opt = ampguard.wrap(_adamw(model, fused), model=model, precision="bf16", config={"max_consecutive_skips": 2})
    with faults.inject(opt, model, faults.loss("inf", steps=range(1, 100), ranks=[1])):
        out["escalate"] = train(opt, model, rank, 5)
    opt.close()
    dist.barrier()
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_fsdp2_one_decision_on_every_rank(fused: bool) -> None:
    res = spawn(_run_fsdp2, fused=fused)
    assert_same_everywhere([r["faults"] for r in res], skipped=[2, 4, 6], origin=1)
    # checked every step: sharded parameters differ by design and are left out of the comparison
    assert not [a for r in res for a in r["faults"]["anomalies"] if a[1] == "rank_divergence"]

    # the reference: the same model, unsharded, one process, same input (2 ranks averaged = same)
    model = tiny_model()
    model.insert(1, torch.nn.Identity())
    loss = model(torch.ones(4, 8)).square().mean()
    loss.backward()
    ref = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    for r in res:
        assert r["norm"] == pytest.approx(ref, rel=2e-2)  # bf16 autocast vs fp32 reference
        assert r["escalate"]["error"] == ("NonFiniteError", 2)


# ---------------------------------------------------------------------------------- FSDP1
def _run_fsdp1(rank: int, world_size: int, fused: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    net = tiny_model()
    model = FSDP(net, device_id=torch.device("cpu"))
    opt = ampguard.wrap(_adamw(model, fused), model=model, precision="fp16",
                        scaler=ShardedGradScaler(device="cpu"))
    assert opt.backend.grads_sharded

    def after_reduction(step: int) -> None:
        if step == 4 and rank == 1:
            next(iter(model.parameters())).grad.view(-1)[0] = float("nan")  # rank 1's shard only

    # before the reduce-scatter: an inf in rank 1's own gradients at step 3 (faults.backward on
    # the first ReLU hands the first Linear a non-finite gradient)
    with faults.inject(opt, model, faults.loss("nan", steps=[2], ranks=[1]),
                       faults.backward("1", "inf", steps=[3], ranks=[1])):
        out = train(opt, model, rank, 6, before_step=after_reduction)
    with FSDP.summon_full_params(model):  # collective: the unsharded parameters, for comparison
        out["params"] = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    opt.close()
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_fsdp1_sharded_grad_scaler(fused: bool) -> None:
    # FSDP1 + ShardedGradScaler: loss (2), before (3) and after (4) reduction, all on rank 1
    res = spawn(_run_fsdp1, fused=fused)
    assert_same_everywhere(res, skipped=[2, 3, 4], origin=1)
