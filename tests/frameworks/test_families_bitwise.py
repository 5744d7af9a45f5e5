"""The guarded loop is the plain GradScaler loop, bit for bit, on the six Hugging Face model families
(``benchmarks/hf_classification.py``'s builders: GPT-2, Llama, Mistral, Qwen2, BERT, T5 at tiny sizes, from their
``transformers`` config classes; no weights downloaded), with a fused and a foreach AdamW.

fp16 autocast on the CPU, ``GradScaler("cpu", init_scale=2**18, growth_interval=2)``: the fp16 backward overflows as
it comes (nothing injected) within the first two steps, the scale backs off to where steps are taken, grows after two
taken steps and overflows again (2**16-2**18 on every family). Held against the plain loop,
``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``, on a twin model and the same batches: every
step's loss scale and ``.grad`` after the step, and at the end every parameter and every optimizer state tensor. On
the CPU these run the guard's host paths: the fused fast path (the still-scaled gradients measured, the kernel
unscales) and, for foreach, norms first with each gradient unscaled right after its dot (``stats.cpu_norms``'s
``unscale_by``, stop 67) and GradScaler's own element check on a non-finite step; and, with the host decision off
(``tensor-decision``), the decision as it is taken off the CPU, in tensors (eagerly: the CPU captures no graph).
Taking out ``check_unscaled`` (stop 67's fix) fails every foreach case.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import torch

import ampguard

from ..unit._models import one_step

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


@pytest.fixture(scope="module")
def families():
    spec = importlib.util.spec_from_file_location("hf_families", REPO / "benchmarks" / "hf_classification.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module.FAMILIES
    sys.modules.pop(spec.name, None)


def _run(build, optim: str, guarded: bool, host: bool = True):
    torch.manual_seed(0)
    model, _ = build(False)
    model.train()
    kind = {"fused": True} if optim == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18, growth_interval=2)
    if guarded:
        opt = ampguard.wrap(opt, model=model, precision="fp16", scaler=scaler, exporters=[])
        opt._pipeline.host_decision = host  # False: the tensor decision, the path off the CPU (run eagerly here)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    scales, grads = [], []
    for _ in range(STEPS):
        ids = torch.randint(2, vocab, (2, 8), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scales.append(scaler.get_scale())
        one_step(guarded, opt, scaler, loss)
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.zero_grad(set_to_none=True)
    scales.append(scaler.get_scale())
    skipped = [r.skipped for r in opt.history] if guarded else None
    state = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    inner = opt.optimizer if guarded else opt
    for i, st in enumerate(inner.state.values()):
        state.update({f"s.{i}.{k}": v.detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    if guarded:
        opt.close()
    return scales, grads, state, skipped


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN payloads included (``torch.equal`` says two NaNs differ: a skipped step's gradients hold
    them)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("host", [True, False], ids=["host-decision", "tensor-decision"])
@pytest.mark.parametrize("optim", ["fused", "foreach"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "bert", "t5"])
def test_the_guarded_loop_is_the_plain_loop_bit_for_bit(families, family, optim, host):
    want_scales, want_grads, want_state, _ = _run(families[family], optim, guarded=False)
    got_scales, got_grads, got_state, skipped = _run(families[family], optim, guarded=True, host=host)
    # the run is what it says: real overflows skipped (the scale backed off), steps taken, and growth
    assert any(skipped) and not all(skipped), skipped
    pairs = list(itertools.pairwise(want_scales))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs), want_scales
    assert got_scales == want_scales
    for step, (got, want) in enumerate(zip(got_grads, want_grads)):
        assert got.keys() == want.keys()
        for name in want:
            g, w = got[name], want[name]
            assert (g is None) == (w is None), (step, name)
            assert g is None or _same_bits(g, w), f"step {step}: {name}.grad differs"
    assert got_state.keys() == want_state.keys()
    for name in want_state:
        assert _same_bits(got_state[name], want_state[name]), f"{name} differs"
