"""``GuardedTrainer`` against the plain transformers ``Trainer`` on the other model families (Llama, Mistral, Qwen2,
BERT's masked LM and T5's encoder-decoder, tiny, from ``benchmarks/hf_classification.py``'s builders; GPT-2 is
``test_transformers.py``'s): the Trainer's own loop, two micro-batches a step, ``max_grad_norm`` below every norm (so
every step clips), bf16, and fp16 with the GradScaler accelerate builds on CUDA
(``test_transformers._fp16_as_on_cuda``). The same parameters, optimizer state, logged losses, gradient norms and
learning rates, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Trainer

from ampguard.integrations.transformers import GuardedTrainer

from .test_transformers import (
    _args,
    _assert_same_tensors,
    _fp16_as_on_cuda,
    _opt_state,
    _params,
    _Tokens,
    _train_logs,
)

pytestmark = pytest.mark.frameworks

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def families(hf_bench):
    return hf_bench.FAMILIES


def _trained(families, family: str, precision: str, out: Path, guarded: bool) -> Trainer:
    torch.manual_seed(0)
    model, _ = families[family](False)
    # optim="adamw_torch" (not fused): bitwise needs the guard's clip to fall back to unscale_ + torch's
    # clip_grad_norm_ (fused, it is folded into grad_scale: equal within float rounding, test_families_bitwise.py)
    args = _args(out, precision, max_steps=4, max_grad_norm=0.25, optim="adamw_torch")
    trainer = (GuardedTrainer if guarded else Trainer)(model=model, args=args, train_dataset=_Tokens())
    if precision == "fp16":
        _fp16_as_on_cuda(trainer)
    trainer.train()
    return trainer


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "bert", "t5"])
def test_the_guarded_trainer_is_the_plain_trainer_bit_for_bit(families, family, precision, tmp_path):
    plain = _trained(families, family, precision, tmp_path / "plain", guarded=False)
    guarded = _trained(families, family, precision, tmp_path / "guarded", guarded=True)
    assert guarded.guard is not None and guarded.guard.step_count == 4
    _assert_same_tensors(_params(plain), _params(guarded))
    _assert_same_tensors(_opt_state(plain), _opt_state(guarded))
    plain_logs, logs = _train_logs(plain), _train_logs(guarded)
    for key in ("loss", "grad_norm", "learning_rate"):
        assert [h[key] for h in logs] == [h[key] for h in plain_logs], key
    assert min(r.grad_norm for r in guarded.guard.history) > 0.25  # every step clipped
    if precision == "fp16":
        assert plain.accelerator.scaler.get_scale() == guarded.guard.get_scale()
