"""``torch.distributed.checkpoint`` with the guard on FSDP2 (``fully_shard``, 2 real gloo ranks on the
CPU, fp16 with the guard's GradScaler, fused AdamW): each rank saves its shards and its own guard state
with ``dcp.save``; a fresh model and guard (other initial weights) resume from it with ``dcp.load``
(:mod:`ampguard.integrations.dcp`) and train on bit for bit as the uninterrupted run, on every rank; a
checkpoint one rank refuses is refused on every rank, before DCP's collective restore.
Before: torch's ``get_state_dict(model, opt)`` on the guard raised ``KeyError: 'state'``."""

from __future__ import annotations

from typing import Any

import torch

import ampguard

from ._common import flat_params, fsdp2_model, spawn, train


def _wrap(model: torch.nn.Module) -> ampguard.GuardedOptimizer:
    return ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model, precision="fp16",
                         exporters=[])


def _history(opt: ampguard.GuardedOptimizer) -> list[tuple[int, bool, float, float]]:
    return [(r.step, r.skipped, r.loss_scale, r.grad_norm) for r in opt.history]


def _run(rank: int, world_size: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from ampguard.integrations import dcp as guard_dcp

    mesh = init_device_mesh("cpu", (world_size,))
    model = fsdp2_model(mesh)
    opt = _wrap(model)
    first = train(opt, model, rank, 3)
    dcp.save(guard_dcp.get_state_dict(model, opt), checkpoint_id=path)
    keys = sorted(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    want = train(opt, model, rank, 3)
    want_history = _history(opt)[3:]
    opt.close()

    model2 = fsdp2_model(mesh, seed=5)
    opt2 = _wrap(model2)
    state = guard_dcp.get_state_dict(model2, opt2)
    dcp.load(state, checkpoint_id=path)
    guard_dcp.set_state_dict(model2, opt2, state)
    resumed_at = opt2.step_count
    got = train(opt2, model2, rank, 3)
    out = {"first": first["skipped"], "want": want["params"], "got": got["params"], "resumed_at": resumed_at,
           "want_history": want_history, "got_history": _history(opt2), "errors": (want["error"], got["error"]),
           "keys": [k for k in keys if k.startswith("ampguard")], "params": flat_params(model2)}
    opt2.close()

    # a bit flipped (exponent all ones: inf) in rank 1's shard of the loaded optimizer state: every rank refuses,
    # before DCP's collective restore (rank 1 refusing alone would leave rank 0 waiting in it)
    model3 = fsdp2_model(mesh, seed=9)
    opt3 = _wrap(model3)
    state = guard_dcp.get_state_dict(model3, opt3)
    dcp.load(state, checkpoint_id=path)
    if rank == 1:
        state["optim"]["state"]["0.weight"]["exp_avg_sq"].to_local().view(torch.int32).view(-1)[0] |= 0x7F800000
    try:
        guard_dcp.set_state_dict(model3, opt3, state)
        out["refused"] = None
    except ampguard.CheckpointError as e:
        out["refused"] = str(e)
    out["step3"] = opt3.step_count
    opt3.close()
    return out


def test_fsdp2_resumes_from_a_dcp_checkpoint_bit_for_bit(tmp_path) -> None:
    res = spawn(_run, world_size=2, path=str(tmp_path / "ckpt"))
    assert res[0]["keys"] == ["ampguard.rank0", "ampguard.rank1"]  # each rank's own guard state
    for r, out in enumerate(res):
        assert out["errors"] == (None, None), (r, out["errors"])
        assert out["resumed_at"] == 3
        assert out["got_history"] == out["want_history"], r
        assert torch.equal(out["got"], out["want"]), r
    assert torch.equal(res[0]["params"], res[1]["params"])  # full tensors: the same on both ranks
    assert "0.weight" in res[1]["refused"] and "non-finite" in res[1]["refused"]
    assert res[0]["refused"].startswith("rank 1 refused the checkpoint") and "0.weight" in res[0]["refused"]
    assert res[0]["step3"] == res[1]["step3"] == 0  # the guard's state untouched on both
