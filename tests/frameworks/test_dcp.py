"""``torch.distributed.checkpoint`` (DCP) with the guard, in one process: a tiny GPT-2 from
``transformers``' config, fp16 with a real GradScaler and fused AdamW on the CPU, saved with
``dcp.save`` to a directory and resumed into a fresh model and guard with ``dcp.load``
(:mod:`ampguard.integrations.dcp`). Multi-rank (FSDP2 on gloo): tests/distributed/test_dcp_distributed.py.

Before: torch's own ``get_optimizer_state_dict(model, opt)`` on the guard raised ``KeyError: 'state'``
(test below), and there was no way to put the guard's state (loss scale, counters, verdict) into a
DCP checkpoint.
``AMPGUARD_RECIPE_DEVICE=cuda`` runs it on CUDA (tests/gpu/test_gpu_recipes.py does, on the device).
"""

from __future__ import annotations

import os

import pytest
import torch

import ampguard

DEV = os.environ.get("AMPGUARD_RECIPE_DEVICE", "cpu")
transformers = pytest.importorskip("transformers")
dcp = pytest.importorskip("torch.distributed.checkpoint")
guard_dcp = pytest.importorskip("ampguard.integrations.dcp")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "no process group: saving in one process"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).to(DEV)


def _guard(model: torch.nn.Module) -> ampguard.GuardedOptimizer:
    return ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model,
                         scaler=torch.amp.GradScaler(DEV, init_scale=2.0**20, growth_interval=2),
                         precision="fp16", exporters=[])


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50, (2, 12), generator=g).to(DEV) for _ in range(n)]


def _train(model, opt, batches) -> None:
    for ids in batches:
        with opt.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _read(path) -> tuple[torch.nn.Module, ampguard.GuardedOptimizer, dict]:
    """A fresh model (other weights) and guard, and the template dcp.load filled from ``path``."""
    model = _model(7)
    opt = _guard(model)
    state = guard_dcp.get_state_dict(model, opt)
    dcp.load(state, checkpoint_id=str(path))
    return model, opt, state


def test_torch_functions_on_the_guard_itself_fail_which_is_why_the_integration_exists():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    model = _model(0)
    opt = _guard(model)
    _train(model, opt, _batches(1))
    with pytest.raises(KeyError):
        get_optimizer_state_dict(model, opt)
    opt.close()


def test_a_dcp_checkpoint_resumes_bit_for_bit(tmp_path):
    batches = _batches(6)
    model = _model(0)
    opt = _guard(model)
    _train(model, opt, batches[:3])  # with a skipped step: the first scale overflows fp16
    saved = [(r.skipped, r.loss_scale) for r in opt.history]
    assert any(s for s, _ in saved), saved
    dcp.save(guard_dcp.get_state_dict(model, opt), checkpoint_id=str(tmp_path))
    _train(model, opt, batches[3:])
    want, want_history = _weights(model), [(r.step, r.skipped, r.loss_scale, r.grad_norm) for r in opt.history][3:]
    want_scale = opt.scaler.get_scale()
    opt.close()

    model2, opt2, state = _read(tmp_path)  # everything comes from the checkpoint
    guard_dcp.set_state_dict(model2, opt2, state)
    assert opt2.step_count == 3
    _train(model2, opt2, batches[3:])
    assert [(r.step, r.skipped, r.loss_scale, r.grad_norm) for r in opt2.history] == want_history
    assert opt2.scaler.get_scale() == want_scale
    got = _weights(model2)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    opt2.close()


@pytest.mark.parametrize("where", ["before-save", "after-load"])
def test_an_unhealthy_checkpoint_is_refused_before_anything_changes(tmp_path, where):
    """A bit flipped through an integer view (the exponent all ones: inf) in Adam's second moment:
    in the run before it was saved (its verdict says so), or in the state read back from disk."""
    def flip(t: torch.Tensor) -> None:
        t.view(torch.int32)[0] |= 0x7F800000

    model = _model(0)
    opt = _guard(model)
    _train(model, opt, _batches(2))
    if where == "before-save":
        flip(opt.optimizer.state[model.transformer.wte.weight]["exp_avg_sq"])
    dcp.save(guard_dcp.get_state_dict(model, opt), checkpoint_id=str(tmp_path))
    opt.close()

    model2, opt2, state = _read(tmp_path)
    if where == "after-load":
        flip(state["optim"]["state"]["transformer.wte.weight"]["exp_avg_sq"])
    message = "saved unhealthy" if where == "before-save" else "optimizer state is non-finite"
    with pytest.raises(ampguard.CheckpointError, match=message) as refused:
        guard_dcp.set_state_dict(model2, opt2, state)
    assert "transformer.wte.weight" in str(refused.value) and "DCP loads in place" in str(refused.value)
    # the guard's own state is untouched (dcp.load wrote the model's and the optimizer's tensors in place)
    assert opt2.step_count == 0 and opt2.scaler.get_scale() == 2.0**20 and not opt2.history


def test_weights_from_elsewhere_are_refused_at_the_first_step(tmp_path):
    model = _model(0)
    opt = _guard(model)
    _train(model, opt, _batches(2))
    dcp.save(guard_dcp.get_state_dict(model, opt), checkpoint_id=str(tmp_path))
    opt.close()
    model2, opt2, state = _read(tmp_path)
    guard_dcp.set_state_dict(model2, opt2, state)
    with torch.no_grad():  # someone else's weights put back after the resume
        model2.lm_head.weight.add_(1.0)
    with pytest.raises(ampguard.CheckpointError, match="weights are not the ones"):
        _train(model2, opt2, _batches(1))
    opt2.close()


def test_bad_input_says_what_to_do():
    model = _model(0)
    opt = _guard(model)
    with pytest.raises(TypeError, match="guarded optimizer"):
        guard_dcp.get_state_dict(model, opt.optimizer)
    with pytest.raises(ValueError, match="keys 'model', 'optim', 'ampguard'"):
        guard_dcp.set_state_dict(model, opt, {"model": {}})
    state = guard_dcp.get_state_dict(model, opt)
    state["ampguard"] = {"rank1": state["ampguard"]["rank0"]}
    with pytest.raises(ValueError, match="no guard state for rank0"):
        guard_dcp.set_state_dict(model, opt, state)
    opt.close()
