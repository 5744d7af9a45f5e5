"""Usage patterns of real training code, each on a tiny GPT-2 from ``transformers``' config, held to the plain
loop bit for bit or to the guard's own answer without the pattern:

- gradient checkpointing (``model.gradient_checkpointing_enable()``, non-reentrant): a genuine fp16 overflow in
  block 2's MLP (its weight scaled so the forward overflows) is named at the same block and module, with the
  sentinel on the step itself and by forensics on the next, as without checkpointing (the recompute in the
  backward runs the blocks' hooks again);
- progressive unfreezing: frozen parameters made trainable at step 3, by ``add_param_group`` or with every
  parameter in the optimizer from the start, as the plain GradScaler loop trains them;
- bf16 parameters (no autocast), and bf16 with the LayerNorms kept in float32 (two dtype groups, under bf16
  autocast), as the plain loop trains them;
- ``torch.load``'s ``weights_only`` default (torch >= 2.6) reads ``opt.state_dict()`` back.
``AMPGUARD_RECIPE_DEVICE=cuda`` runs it on CUDA (tests/gpu/test_gpu_recipes.py does, on the device).
"""

from __future__ import annotations

import io
import os

import pytest
import torch

import ampguard

from ..unit._models import one_step

DEV = os.environ.get("AMPGUARD_RECIPE_DEVICE", "cpu")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.frameworks


def _gpt2(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).to(DEV)


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50, (2, 12), generator=g).to(DEV) for _ in range(n)]


def _named(checkpointing: bool) -> list[tuple[int, str, str | None, str | None]]:
    model = _gpt2(layers=4)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with torch.no_grad():
        model.transformer.h[2].mlp.c_fc.weight.mul_(1e7)  # its output overflows fp16: inf, then NaN
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler(DEV), exporters=[], config={"sentinel": "top"})
    for ids in _batches(3):
        with opt.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    opt.flush()
    named = [(a.step, str(a.kind), a.module, a.phase) for a in opt.anomalies]
    assert all(r.skipped for r in opt.history)
    opt.close()
    return named


def test_gradient_checkpointing_names_the_same_block():
    want = _named(checkpointing=False)
    assert want[0][2] == "transformer.h.2" and want[1][2] == "transformer.h.2.mlp.c_fc", want
    assert _named(checkpointing=True) == want


def _unfreezing(how: str, guarded: bool) -> list[torch.Tensor]:
    model = _gpt2()
    late = [p for n, p in model.named_parameters() if not n.startswith("transformer.h.1")]
    early = [p for n, p in model.named_parameters() if n.startswith("transformer.h.1")]
    for p in late:
        p.requires_grad_(False)
    inner = torch.optim.AdamW(early if how == "add_param_group" else model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(DEV, init_scale=2.0**10)
    opt = ampguard.wrap(inner, model=model, precision="fp16", scaler=scaler, exporters=[]) if guarded else inner
    for step, ids in enumerate(_batches(6)):
        if step == 3:
            for p in late:
                p.requires_grad_(True)
            if how == "add_param_group":
                opt.add_param_group({"params": late, "lr": 1e-3})
        with torch.autocast(DEV, torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        one_step(guarded, opt, scaler, loss)
        opt.zero_grad()
    if guarded:
        assert [r.skipped for r in opt.history] == [False] * 6
        opt.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["add_param_group", "frozen_in_the_optimizer"])
def test_progressive_unfreezing_trains_as_the_plain_loop(how):
    assert all(torch.equal(a, b) for a, b in zip(_unfreezing(how, True), _unfreezing(how, False)))


def _low_precision_params(layout: str, fused: bool, guarded: bool) -> list[torch.Tensor]:
    model = _gpt2().to(torch.bfloat16)
    if layout == "layernorms-fp32":
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.float()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    opt = ampguard.wrap(inner, model=model, precision="bf16", exporters=[]) if guarded else inner
    # float32 LayerNorms between bf16 layers run under bf16 autocast, as mixed layouts are trained: CUDA's
    # layer_norm refuses a bf16 input with float32 weights outside it (the CPU's takes it)
    mixed = layout == "layernorms-fp32"
    for ids in _batches(4):
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=mixed):
            loss = model(input_ids=ids, labels=ids).loss
        if guarded:
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    if guarded:
        opt.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("layout", ["bf16", "layernorms-fp32"])
@pytest.mark.parametrize("fused", [False, True])
def test_bf16_parameters_train_as_the_plain_loop(layout, fused):
    got, want = _low_precision_params(layout, fused, True), _low_precision_params(layout, fused, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_torch_load_default_reads_the_guards_state_back():
    model = _gpt2()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler(DEV), exporters=[], config={"zclip": {}})
    for step, ids in enumerate(_batches(2)):
        with opt.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss, batch_id=("shard-3", step))
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf)["opt"])  # weights_only=True, torch's default
    assert opt.step_count == 2
    opt.close()
