"""The fp8 preflight on real torchao float8 training (CPU: emulated, as preflight chooses by itself): per-layer cast
statistics of a transformers Llama, a layer whose gradients really underflow named as "keep in bf16" with a filter
that keeps exactly it, and a missing or untested torchao refused before any trial runs."""

from __future__ import annotations

import math
import sys

import pytest
import torch

torchao_float8 = pytest.importorskip("torchao.float8")

import ampguard  # noqa: E402
from ampguard._versions import IntegrationVersionError  # noqa: E402
from ampguard.errors import BackendUnavailableError  # noqa: E402
from ampguard.preflight_fp8 import FP8_UNDERFLOW_LIMIT  # noqa: E402

STEPS = 5


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def test_a_llama_gets_every_casts_statistics_and_a_comparison_with_bf16():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)

    def model_fn():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)

    def batch_fn(i):
        return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))

    rec = ampguard.preflight(model_fn, batch_fn, _adamw, steps=STEPS, precision=("bf16", "fp8"), device="cpu",
                             loss_fn=lambda model, ids: model(input_ids=ids, labels=ids).loss)
    linears = [name for name, m in model_fn().named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 15 and rec.fp8 is not None and list(rec.fp8.converted) == linears
    assert [(c.module, c.role) for c in rec.fp8.casts] == [(n, r) for n in linears
                                                          for r in ("input", "weight", "grad_output")]
    for c in rec.fp8.casts:
        assert c.steps == STEPS and c.nonfinite_steps == 0 and c.saturation is None
        assert math.isfinite(c.amax) and c.amax > 0  # the smallest scale is the one of the largest amax:
        assert c.scale == pytest.approx(torch.finfo(getattr(torch, c.dtype)).max / c.amax, rel=1e-6)
        assert c.underflow is not None and c.dynamic_range is not None  # measured on every trial step
        assert c.dtype == ("float8_e5m2" if c.role == "grad_output" else "float8_e4m3fn")
    assert rec.fp8.keep_bf16 == {} and all(rec.fp8.module_filter_fn(None, n) for n in linears)
    assert "cpu has no fp8 matmul" in rec.fp8.emulated
    bf16, fp8 = rec.trials
    assert (bf16.precision, fp8.precision) == ("bf16", "fp8") and fp8.skipped == 0
    assert rec.fp8.loss_vs_bf16 == pytest.approx(fp8.loss_last - bf16.loss_last)
    assert rec.fp8.time_vs_bf16 == pytest.approx(fp8.step_time_s / bf16.step_time_s)
    assert rec.precision == "fp8" and rec.wrap_kwargs("cpu")["precision"] == "bf16"
    text = str(rec)
    assert "fp8 casts: 15 layers converted; keep in bf16: none" in text and "saturation not measured" in text


class Branches(torch.nn.Module):
    """A trunk feeding a head and a side branch whose output columns 1.. are scaled by 1e-12: the side layer's
    grad_output spans ~40 bits, wider than e5m2 holds under one scale, so most of it flushes to 0 in fp8."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 8)
        self.side = torch.nn.Linear(32, 8)
        self.register_buffer("mix", torch.tensor([1.0] + [1e-12] * 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.head(h) + self.side(h) * self.mix


def _branches() -> torch.nn.Module:
    torch.manual_seed(0)
    return Branches()


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)


def test_a_layer_whose_gradients_underflow_is_kept_in_bf16_and_the_filter_keeps_exactly_it():
    rec = ampguard.preflight(_branches, _batch, _adamw, steps=STEPS, precision=("bf16", "fp8"), device="cpu")
    assert rec.fp8 is not None and list(rec.fp8.keep_bf16) == ["side"]
    side = next(c for c in rec.fp8.casts if (c.module, c.role) == ("side", "grad_output"))
    assert side.underflow is not None and side.underflow > 0.8  # 7 of 8 columns flushed to 0
    assert side.dynamic_range is not None and side.dynamic_range > side.format_range
    assert f"{side.underflow:.1%} of its elements underflow to 0 in float8_e5m2" in rec.fp8.keep_bf16["side"]
    healthy = [c for c in rec.fp8.casts if c.module != "side"]
    assert all(c.underflow is not None and c.underflow <= FP8_UNDERFLOW_LIMIT for c in healthy)
    converted = torchao_float8.convert_to_float8_training(
        _branches(), config=torchao_float8.Float8LinearConfig(emulate=True), module_filter_fn=rec.fp8.module_filter_fn)
    f8 = torchao_float8.float8_linear.Float8Linear
    assert isinstance(converted.trunk, f8) and isinstance(converted.head, f8)
    assert type(converted.side) is torch.nn.Linear
    assert "keep in bf16: side" in str(rec)


def test_a_missing_or_untested_torchao_is_refused_before_any_trial(monkeypatch):
    built = []

    def model_fn():
        built.append(1)
        return _branches()

    # A missing torchao, the way Python says so: an import of a name mapped to None in sys.modules fails.
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torchao", None)
        with pytest.raises(BackendUnavailableError, match=r"torchao is not installed: pip install 'ampguard\[fp8\]'"):
            ampguard.preflight(model_fn, _batch, _adamw, steps=STEPS, precision=("bf16", "fp8"), device="cpu")
    # An untested version: the real module, its __version__ set to one outside the tested range.
    import torchao

    with monkeypatch.context() as m:
        m.setattr(torchao, "__version__", "0.19.0")
        with pytest.raises(IntegrationVersionError, match=r"tested with torchao >=0\.18,<0\.19.*ampguard\[fp8\]"):
            ampguard.preflight(model_fn, _batch, _adamw, steps=STEPS, precision=("bf16", "fp8"), device="cpu")
    assert built == []  # refused before any model was built


def test_bad_fp8_arguments_are_refused_with_what_to_do():
    with pytest.raises(TypeError, match=r"fp8_config=.*Float8LinearConfig"):
        ampguard.preflight(_branches, _batch, _adamw, precision=("fp8",), fp8_config={"emulate": True})
    with pytest.raises(TypeError, match=r"fp8_filter=.*module_filter_fn"):
        ampguard.preflight(_branches, _batch, _adamw, precision=("fp8",), fp8_filter="side")
    with pytest.raises(ValueError, match="add 'fp8' to precision"):
        ampguard.preflight(_branches, _batch, _adamw, precision=("bf16",),
                           fp8_config=torchao_float8.Float8LinearConfig())


def test_a_nonfinite_cast_keeps_its_layer_in_bf16_unless_the_bf16_trial_went_nonfinite_too():
    def model_fn():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))

    def batch_fn(i):
        x, y = _batch(i)
        if i == 2:
            x[3, 5] = math.inf  # a real Inf in the data: amax inf -> scale 0 in fp8, non-finite in bf16 as well
        return x, y

    alone = ampguard.preflight(model_fn, batch_fn, _adamw, steps=STEPS, precision=("fp8",), device="cpu")
    assert alone.fp8 is not None and list(alone.fp8.keep_bf16) == ["0", "2"]  # no bf16 trial to tell
    assert "input: non-finite cast on 1 of 5 steps (first step 2: amax inf → scale 0); no bf16 trial" in (
        alone.fp8.keep_bf16["0"])
    both = ampguard.preflight(model_fn, batch_fn, _adamw, steps=STEPS, precision=("bf16", "fp8"), device="cpu")
    assert both.trials[0].overflow_steps == 1 and both.fp8 is not None
    assert both.fp8.keep_bf16 == {} and list(both.fp8.nonfinite_in_bf16_too) == ["0", "2"]
    assert "not fp8's doing" in str(both)


def test_the_command_takes_fp8_and_its_json_holds_the_advice(tmp_path, capsys):
    import json
    import textwrap

    from ampguard import cli

    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        def make_preflight():
            def model_fn():
                torch.manual_seed(0)
                return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
            return {"model_fn": model_fn, "batch_fn": lambda i: (torch.randn(8, 16), torch.randn(8, 16)),
                    "optimizer_fn": lambda p: torch.optim.SGD(p, lr=0.01)}
    """))
    rc = cli.main(["preflight", "--script", f"{tmp_path / 'train.py'}:make_preflight", "--steps", "5",
                   "--precision", "bf16,fp8", "--device", "cpu", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rec = json.loads(out.out)
    assert rec["precision"] == "fp8" and rec["fp8"]["converted"] == ["0", "2"] and rec["fp8"]["keep_bf16"] == {}
    assert len(rec["fp8"]["casts"]) == 6 and all(c["steps"] == 5 for c in rec["fp8"]["casts"])
