"""fp8 monitoring inside the guarded step (issue 28, item 2): a non-finite fp8 cast is a non-finite step, skipped
on the step itself and named by module and role. Real torchao float8 training (CPU: ``emulate=True``), real
failures: a NaN in the batch, an fp16 grad_output that overflows at too high a loss scale, an activation that
overflows into the next layer's rowwise cast; a real Llama from ``transformers`` config classes."""

from __future__ import annotations

import math

import pytest
import torch

import ampguard
from ampguard.vocab import AnomalyKind, Phase, SkipReason

torchao_float8 = pytest.importorskip("torchao.float8")

from tests.unit.test_fp8 import _model as _mlp  # noqa: E402  (the same two-layer float8 model)


def _step(opt, model, x):
    with opt.autocast():
        loss = model(x).float().square().mean()
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    return opt.last_report


def test_wrap_turns_fp8_monitoring_on_for_a_float8_model_and_a_nan_batch_is_named_at_the_first_cast():
    model = _mlp()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"numerics_every": 1})
    assert opt._fp8 is not None  # auto: the model holds Float8Linear modules
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 16)
    x[3, 5] = math.nan  # a real NaN in the batch
    report = _step(opt, model, x)
    assert report.skipped and report.nonfinite
    assert report.reason == SkipReason.NONFINITE_LOSS  # the loss came first: the batch is the cause
    fp8 = [a for a in opt.anomalies if a.kind == AnomalyKind.FP8_NONFINITE]
    assert len(fp8) == 1 and fp8[0].module == "fc1" and fp8[0].phase == Phase.FORWARD and fp8[0].cause is None
    assert "fc1, input: amax nan → scale nan" in fp8[0].detail
    assert {(c.module, c.role) for c in report.fp8 if not c.finite} >= {("fc1", "input")}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # skipped: nothing changed
    opt.close()


def test_an_fp16_grad_output_that_overflows_is_the_steps_reason_and_backs_the_scale_off():
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # far above fp16's range: grad_output overflows
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, scaler=scaler)
    report = _step(opt, model, torch.randn(8, 16))
    assert report.skipped and report.reason == SkipReason.NONFINITE_FP8 and not report.nonfinite_loss
    assert report.scale_backoff and report.next_loss_scale < report.loss_scale  # the gradients overflowed too
    first = opt.anomalies[0]
    assert first.kind == AnomalyKind.FP8_NONFINITE and first.module == "fc2" and first.phase == Phase.BACKWARD
    assert "fc2, grad_output: amax inf → scale 0" in first.detail and "fp16 overflow" in first.detail
    # The ladder's usual medicine works: the scale backs off until the casts are finite again.
    for _ in range(20):
        report = _step(opt, model, torch.randn(8, 16))
        if not report.skipped:
            break
    assert not report.skipped and all(c.finite for c in (report.fp8 or ()))
    opt.close()


def test_an_activation_that_overflows_zeroes_its_row_in_the_next_rowwise_cast_and_is_named():
    model = _mlp("rowwise")
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="bf16")
    x = torch.randn(8, 16)
    x[2] = 3e38  # finite in the batch; fc1's output overflows bf16 on that row: fc2's row amax inf, its scale 0
    report = _step(opt, model, x)
    assert report.skipped and report.nonfinite
    fp8 = next(a for a in opt.anomalies if a.kind == AnomalyKind.FP8_NONFINITE)
    assert fp8.module == "fc2" and "fc2, input: amax inf → scale 0" in fp8.detail
    bad = {(c.module, c.role) for c in report.fp8 if not c.finite}
    assert ("fc1", "input") not in bad and ("fc2", "input") in bad
    opt.close()


def _llama(monitor: bool | None):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    model = torchao_float8.convert_to_float8_training(
        model, config=torchao_float8.Float8LinearConfig(emulate=True),
        module_filter_fn=lambda m, fqn: fqn != "lm_head")
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"numerics_every": 2}, fp8=monitor)
    return model, opt


def test_a_healthy_llama_is_bitwise_unchanged_by_the_monitoring_and_reports_casts_on_sampled_steps():
    runs = {}
    for monitor in (None, False):
        model, opt = _llama(monitor)
        gen = torch.Generator().manual_seed(1)
        reports = []
        for _ in range(4):
            ids = torch.randint(0, 64, (2, 12), generator=gen)
            with opt.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            reports.append(opt.last_report)
        runs[monitor] = ({k: v.clone() for k, v in model.state_dict().items()}, reports, list(opt.anomalies))
        opt.close()
    (watched, reports, anomalies), (plain, plain_reports, _) = runs[None], runs[False]
    assert all(torch.equal(watched[k], plain[k]) for k in plain)
    assert [r.loss for r in reports] == [r.loss for r in plain_reports] and not anomalies
    assert all(r.fp8 is None for r in plain_reports)
    assert [r.fp8 is not None for r in reports] == [True, False, True, False]  # numerics_every=2
    casts = reports[2].fp8
    from torchao.float8.float8_linear import Float8Linear

    linears = [n for n, m in _llama(False)[0].named_modules() if isinstance(m, Float8Linear)]
    assert {c.module for c in casts} == set(linears) and len(linears) == 2 * 7
    assert all(c.finite and c.underflow is not None for c in casts)


def test_an_evaluation_forward_between_steps_is_not_counted():
    model = _mlp()
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="bf16")
    with torch.no_grad():
        bad = torch.full((2, 16), math.nan)
        model(bad)  # evaluation on a NaN batch: no step follows it
    report = _step(opt, model, torch.randn(8, 16))
    assert not report.skipped and not opt.anomalies
    opt.close()


def test_bad_fp8_arguments_are_refused_and_leave_no_hook():
    plain = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="no torchao Float8Linear"):
        ampguard.wrap(torch.optim.SGD(plain.parameters(), lr=0.1), model=plain, precision="bf16", fp8=True)
    model = _mlp()
    with pytest.raises(TypeError, match="wrap\\(fp8='yes'\\)"):
        ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="bf16", fp8="yes")
    with pytest.raises(ValueError, match="without model="):
        ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", fp8=True)
    with pytest.raises(TypeError, match="exporters"):  # refused after the monitor was made: its hooks go too
        ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="bf16", exporters=[1])
    assert all(not m._forward_hooks for m in model.modules())
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="bf16", fp8=False)
    assert opt._fp8 is None and all(not m._forward_hooks for m in model.modules())
    opt.close()
