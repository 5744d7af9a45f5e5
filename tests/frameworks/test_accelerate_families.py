"""The guard inside accelerate's documented loop on the six Hugging Face families (tiny, from
``benchmarks/hf_classification.py``'s builders), against the same loop without it: ``prepare(model, optimizer,
scheduler)``, two micro-batches a step (``accelerator.accumulate``), ``accelerator.clip_grad_norm_`` on every
optimizer step, ``optimizer.step()``, ``scheduler.step()``. bf16, and fp16 through accelerate's GradScaler code path
as on CUDA (``test_accelerate._accelerator``), from a scale of 2**18 that the fp16 backward overflows as it comes
(growth every two taken steps). The same skips, learning rates, loss scale and weights, bit for bit (a for-loop
AdamW: accelerate's clip is torch's ``clip_grad_norm_`` after ``unscale_``, whose values the guard keeps)."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import ampguard

from .test_accelerate import _fresh_accelerate_state  # noqa: F401  (the fixture)
from .test_families_bitwise import FAMILY_NAMES, _same_bits

pytestmark = pytest.mark.frameworks


def _run(build, precision: str, guarded: bool, steps: int = 6):
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(mixed_precision=precision, cpu=True, gradient_accumulation_steps=2)
    if precision == "fp16":  # what Accelerator.__init__ does for fp16 on CUDA
        acc.native_amp = True
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18, growth_interval=2)
    torch.manual_seed(0)
    model, _ = build(False)
    model.train()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda k: 0.9**k)
    model, opt, sched = acc.prepare(model, inner, sched)
    if guarded:
        opt = ampguard.wrap(opt, accelerator=acc, model=model)
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(2 * steps):
        ids = torch.randint(2, model.config.vocab_size, (2, 8), generator=g)
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            norm = float(acc.clip_grad_norm_(model.parameters(), 0.25)) if acc.sync_gradients else None
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            seen.append((acc.optimizer_step_was_skipped, sched.get_last_lr()[0], math.isfinite(norm),
                         None if acc.scaler is None else acc.scaler.get_scale()))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    if guarded:
        opt.close()
    return seen, weights


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_accelerates_loop_with_the_guard_is_its_loop_without_it(hf_bench, family, precision):
    want_seen, want_weights = _run(hf_bench.FAMILIES[family], precision, guarded=False)
    got_seen, got_weights = _run(hf_bench.FAMILIES[family], precision, guarded=True)
    if precision == "fp16":  # real overflows skipped, and the scale grew after them
        assert any(s for s, *_ in want_seen) and not all(s for s, *_ in want_seen), want_seen
    assert got_seen == want_seen
    for name, want in want_weights.items():
        assert _same_bits(got_weights[name], want), name
