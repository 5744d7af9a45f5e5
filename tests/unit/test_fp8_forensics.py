"""Forensics on torchao float8 models (issue 28, item 2): a ``Float8Linear`` culprit is a leaf recomputed in its own
fp8 recipe, as the same layer without fp8 in the run's precision, and in fp32, so an fp16 overflow, a genuine NaN
and a fault of the fp8 path itself get different causes; and the step's ``fp8_nonfinite`` anomaly, which names the
cast, gains the cause and where the non-finite value arose. Real torchao float8 training (CPU: ``emulate=True``),
real failures: an fp16 activation overflow, a NaN weight made by a bit flipped through an integer view; and one
injected fault of torchao's own cast (the fp8-only verdict, which torchao's dynamic scaling cannot produce from
finite inputs)."""

from __future__ import annotations

import torch

import ampguard
from ampguard.vocab import AnomalyKind, Cause, Phase
from tests.unit.test_fp8 import _model as _mlp
from tests.unit.test_fp8_guard import _step


def _until_found(opt, model, x, steps: int = 4):
    """Steps on ``x`` until forensics (armed after the first non-finite step) explains one."""
    for _ in range(steps):
        _step(opt, model, x)
        if any(a.cause is not None for a in opt.anomalies):
            return
    raise AssertionError(f"no anomaly got a cause: {[(a.kind, a.detail) for a in opt.anomalies]}")


def test_an_fp16_overflow_in_a_float8_layer_is_the_runs_precision_not_fp8_and_explains_the_next_cast():
    model = _mlp()
    with torch.no_grad():
        model.fc1.weight.mul_(10.0)  # fc1's output on the big row passes 65504: finite in fp32, inf in fp16
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.0), model=model,
                        scaler=torch.amp.GradScaler("cpu"), config={"numerics_every": 1})
    x = torch.randn(8, 16)
    x[2] = 6e4  # finite in fp16
    _until_found(opt, model, x)
    fp8 = [a for a in opt.anomalies if a.kind == AnomalyKind.FP8_NONFINITE]
    explained = [a for a in fp8 if a.cause is not None]
    assert fp8[0].cause is None  # the first step: no hook was armed yet
    a = explained[0]
    # the anomaly still names the cast where the Inf arrived; forensics adds where it arose, and why
    assert a.module == "fc2" and a.phase == Phase.FORWARD and "fc2, input: amax inf → scale 0" in a.detail
    assert a.cause == Cause.OVERFLOW
    assert "arose at fc1 (forward)" in a.detail and "Float8Linear" in a.detail
    assert "non-finite in its fp8 recipe (float16 autocast) and in float16 autocast without fp8, finite in fp32" \
        in a.detail and "not fp8" in a.detail
    assert "its fp8 casts of these inputs: input amax 6e+04" in a.detail
    first = next(x for x in opt.anomalies if x.step == a.step and x.kind == AnomalyKind.NONFINITE_LOSS)
    assert first.module == "fc1" and first.cause == Cause.OVERFLOW
    opt.close()


def test_a_nan_weight_from_a_flipped_bit_is_a_genuine_nan_at_its_float8_layer():
    model = _mlp()
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.0), model=model, precision="bf16",
                        config={"param_check_every": None})
    with torch.no_grad():  # the exponent bits of one weight all set: a NaN, as a bit flip in memory makes it
        model.fc1.weight.view(torch.int32)[3, 5] |= 0x7FC00000
    x = torch.randn(8, 16)
    _until_found(opt, model, x)
    a = next(a for a in opt.anomalies if a.kind == AnomalyKind.FP8_NONFINITE and a.cause is not None)
    assert a.module == "fc1" and "fc1, weight: amax nan → scale nan" in a.detail
    assert a.cause == Cause.NAN and "arose at fc1 (forward)" in a.detail
    assert "in its fp8 recipe (bfloat16 autocast), in bfloat16 autocast without fp8 and in fp32" in a.detail
    assert "weight amax nan" in a.detail
    opt.close()


def test_a_fault_of_the_fp8_cast_itself_is_told_apart_from_the_layers_math(monkeypatch):
    """Injected: torchao's cast of fc2's input returns a zero scale (a faulty kernel); the layer's math is fine in
    high precision and fp32, so the cause is fp8."""
    from torchao.float8 import float8_linear

    real = float8_linear.hp_tensor_to_float8_dynamic
    model = _mlp()

    def faulty(hp, *args, **kwargs):
        out = real(hp, *args, **kwargs)
        if hp.shape[-1] == 32 and kwargs.get("gemm_input_role") == float8_linear.GemmInputRole.INPUT:
            out._scale = torch.zeros_like(out._scale)  # fc2's input: dequantizing divides by 0
        return out

    monkeypatch.setattr(float8_linear, "hp_tensor_to_float8_dynamic", faulty)
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.0), model=model, precision="bf16")
    _until_found(opt, model, torch.randn(8, 16))
    a = next(a for a in opt.anomalies if a.cause is not None)
    assert a.kind == AnomalyKind.NONFINITE_LOSS and a.module == "fc2" and a.cause == Cause.FP8
    assert "non-finite in its fp8 recipe (bfloat16 autocast) and finite as the same layer without fp8" in a.detail
    # the monitor measures the tensors, not torchao's result: fc2's input cast looks finite to it; only the
    # backward's casts of the NaN gradient are flagged, and that anomaly gets the same cause
    fp8 = [x for x in opt.anomalies if x.kind == AnomalyKind.FP8_NONFINITE]
    assert fp8 and all("grad_output" in x.detail.split(";")[0] for x in fp8)
    assert [x.cause for x in fp8 if x.step == a.step] == [Cause.FP8]
    opt.close()
