"""``accelerator.save_state``/``load_state`` under FSDP2 with the guard, on 2 gloo ranks.

accelerate saves an FSDP optimizer through torch's ``get_optimizer_state_dict(model, optimizer)``, which reads
a plain optimizer's ``state_dict`` (and, for an empty state, calls its ``step()``); with the guard in the
optimizer's place it died on the guard's nested dict (``KeyError: 'state'``): no accelerate + FSDP2 run could
checkpoint. The Accelerator is set up as accelerate sets it up for FSDP2 on CUDA (accelerate turns FSDP on only
for GPU-like devices: ``distributed_type`` FSDP, a ``FullyShardedDataParallelPlugin(fsdp_version=2)``, the model
``fully_shard``-ed, registered as ``prepare`` registers it); accelerate's own save and load code then runs as it
is: DCP for the model and the optimizer, its scheduler, sampler and RNG files. The model is a tiny Hugging Face
Llama, sharded per decoder layer.

- A run saved at step 3 and resumed by a fresh Accelerator, model and guard ends bit for bit where the
  uninterrupted run ends, on both ranks, at the same guard step and scale-rule state.
- One rank's guard file with a flipped exponent (a NaN in a detector's statistic) is refused on both ranks (one
  rank's refusal is every rank's), and no guard is restored.
"""

from __future__ import annotations

import os
import struct
import tempfile
import warnings
from typing import Any

import pytest
import torch

import ampguard

from ._common import flat_params, spawn

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.frameworks, pytest.mark.timeout(240)]

SAVED_AT, MORE = 3, 2


def _llama(world_size: int) -> torch.nn.Module:
    """A tiny Hugging Face Llama (from its config class: no weights downloaded), ``fully_shard``-ed per decoder
    layer and at the root, as accelerate's FSDP2 auto-wrap shards a transformer."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same initial parameters on every rank
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _setup(world_size: int) -> tuple[Any, torch.nn.Module, Any]:
    """A fresh Accelerator in FSDP2 mode, an FSDP2 model and its guarded optimizer."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    model = _llama(world_size)
    acc._models.append(model)  # what prepare() does with a model (here already sharded)
    opt = acc.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))  # (re-reads the CPU state)
    opt = ampguard.wrap(opt, accelerator=acc, model=model, exporters=[])
    acc.state.distributed_type = DistributedType.FSDP  # what AcceleratorState sets on CUDA with an fsdp_plugin
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    return acc, model, opt


def _steps(acc: Any, model: torch.nn.Module, opt: Any, rank: int, steps: range) -> None:
    for step in steps:
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))  # per rank
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()


def _state(opt: Any) -> dict[str, Any]:
    saved = opt.guard._state_without_optimizer()["ampguard"]
    return {k: saved[k] for k in ("step", "skipped_total", "grad_ema", "loss_ema", "ema_count", "z_mean", "z_var")}


def _resume(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # what `accelerate launch` sets
    acc, model, opt = _setup(world_size)
    _steps(acc, model, opt, rank, range(SAVED_AT))
    assert acc.is_fsdp2
    acc.save_state(folder)
    files = sorted(os.listdir(folder))
    _steps(acc, model, opt, rank, range(SAVED_AT, SAVED_AT + MORE))
    straight = (flat_params(model), _state(opt))
    opt.close()

    acc, model, opt = _setup(world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the guard files are there: no "no guard state" warning
        acc.load_state(folder)
    assert opt.guard.step_count == SAVED_AT
    _steps(acc, model, opt, rank, range(SAVED_AT, SAVED_AT + MORE))
    resumed = (flat_params(model), _state(opt))
    opt.close()
    return {"files": files, "straight": straight, "resumed": resumed}


def test_an_fsdp2_run_saved_and_resumed_by_accelerate_ends_where_the_straight_run_ends() -> None:
    with tempfile.TemporaryDirectory() as folder:
        res = spawn(_resume, world_size=2, folder=os.path.join(folder, "ckpt"))
    for r, out in enumerate(res):
        assert "ampguard_0_rank0.pt" in out["files"] and "ampguard_0_rank1.pt" in out["files"], out["files"]
        assert any(f.startswith("optimizer") for f in out["files"]), out["files"]  # accelerate's own DCP folder
        assert torch.equal(out["resumed"][0], out["straight"][0]), r
        assert out["resumed"][1] == out["straight"][1], r
    assert torch.equal(res[0]["resumed"][0], res[1]["resumed"][0])


def _flip_exponent(x: float) -> float:
    """``x`` with every exponent bit set, through its integer view: NaN (or inf for a zero mantissa)."""
    (bits,) = struct.unpack("<Q", struct.pack("<d", x))
    return float(struct.unpack("<d", struct.pack("<Q", bits | (0x7FF << 52)))[0])


def _refused(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    acc, model, opt = _setup(world_size)
    _steps(acc, model, opt, rank, range(SAVED_AT))
    acc.save_state(folder)
    opt.close()
    if rank == 1:  # one rank's file only, after it was written
        path = os.path.join(folder, "ampguard_0_rank1.pt")
        saved = torch.load(path, weights_only=True)
        saved["ampguard"]["grad_ema"] = _flip_exponent(saved["ampguard"]["grad_ema"] or 1.0)
        torch.save(saved, path)
    torch.distributed.barrier()
    acc, model, opt = _setup(world_size)
    before = _state(opt)
    try:
        acc.load_state(folder)
        error = None
    except ampguard.CheckpointError as e:
        error = str(e)
    out = {"error": error, "unchanged": _state(opt) == before, "step": opt.guard.step_count}
    opt.close()
    return out


def test_one_ranks_corrupt_guard_file_is_refused_on_every_rank() -> None:
    with tempfile.TemporaryDirectory() as folder:
        res = spawn(_refused, world_size=2, folder=os.path.join(folder, "ckpt"))
    for r, out in enumerate(res):
        assert out["error"] is not None and "rank 1 refused the guard's state" in out["error"], (r, out)
        assert "nothing was loaded" not in out["error"].lower(), out["error"]  # accelerate has loaded: it says so
        assert out["unchanged"] and out["step"] == 0, (r, out)
