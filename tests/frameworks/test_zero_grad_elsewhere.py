"""Gradients cleared by a ``zero_grad()`` other than the guard's: ``model.zero_grad()`` (what the
Hugging Face examples and many tutorials call), the inner optimizer's, ``p.grad = None``.

Before: the next ``opt.backward(loss)`` raised "backward() after step() without zero_grad(): the new
gradients would be added to the last step's", which was false: they had been cleared. Now such a
clearing counts as ``opt.zero_grad()``: the run trains bit for bit as with it. A gradient the step
left untouched (one submodule cleared, another not) still refuses the backward, changing nothing.

A tiny GPT-2 from ``transformers``' config, fp16 autocast with a real GradScaler on the CPU.
``AMPGUARD_RECIPE_DEVICE=cuda`` runs it on CUDA (tests/gpu/test_gpu_recipes.py does, on the device).
"""

from __future__ import annotations

import os

import pytest
import torch

import ampguard

DEV = os.environ.get("AMPGUARD_RECIPE_DEVICE", "cpu")
transformers = pytest.importorskip("transformers")

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).to(DEV)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50, (2, 12), generator=g).to(DEV) for _ in range(STEPS)]


def _clear(how: str, opt: ampguard.GuardedOptimizer, model: torch.nn.Module) -> None:
    if how == "guard":
        opt.zero_grad()
    elif how == "model":
        model.zero_grad()
    elif how == "model-in-place":
        model.zero_grad(set_to_none=False)
    elif how == "inner":
        opt.optimizer.zero_grad()
    elif how == "assign-none":
        for p in model.parameters():
            p.grad = None
    else:  # pragma: no cover - test table
        raise AssertionError(how)


def _train(how: str) -> tuple[dict[str, torch.Tensor], list[tuple[bool, float]]]:
    model = _model()
    scaler = torch.amp.GradScaler(DEV, init_scale=2.0**12)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, scaler=scaler,
                        precision="fp16", exporters=[])
    for ids in _batches():
        with opt.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        _clear(how, opt, model)
    history = [(r.skipped, r.grad_norm) for r in opt.history]
    opt.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, history


@pytest.mark.parametrize("how", ["model", "model-in-place", "inner", "assign-none"])
def test_a_zero_grad_elsewhere_trains_as_the_guards_own(how):
    want, want_history = _train("guard")
    got, got_history = _train(how)
    assert got_history == want_history
    assert all(not skipped for skipped, _ in got_history)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_gradients_the_step_left_still_refuse_the_backward_and_change_nothing():
    model = _model()
    scaler = torch.amp.GradScaler(DEV, init_scale=2.0**12)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, scaler=scaler,
                        precision="fp16", exporters=[])
    ids = _batches()[0]
    with opt.autocast():
        loss = model(input_ids=ids, labels=ids).loss
    opt.backward(loss)
    opt.step()
    model.transformer.h[0].zero_grad()  # one block cleared; the embeddings' gradients are the step's
    kept = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with opt.autocast():
        loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(ampguard.GuardStateError, match=r"backward\(\) after step\(\) without zero_grad\(\)"):
        opt.backward(loss)
    assert {n for n, p in model.named_parameters() if p.grad is not None} == set(kept)
    assert all(torch.equal(p.grad, kept[n]) for n, p in model.named_parameters() if p.grad is not None)
    model.zero_grad()  # now every gradient is cleared: the same backward is taken
    opt.backward(loss)
    opt.step()
    assert [r.skipped for r in opt.history] == [False, False]
    opt.close()
