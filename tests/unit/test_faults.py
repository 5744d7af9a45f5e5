"""ampguard.faults: what is injected, where, when, and that removal restores a clean run."""

from __future__ import annotations

import math

import pytest
import torch

import ampguard
from ampguard import faults

from ._models import guarded_steps, make_data, make_model, make_opt


def _guard(precision="bf16"):
    model = make_model()
    return model, ampguard.wrap(make_opt(model), model=model, precision=precision)


def test_output_fault_makes_downstream_gradients_nonfinite_at_the_chosen_steps():
    model, opt = _guard()
    with faults.inject(opt, faults.output("1", "nan", steps=[2, 4])) as inj:
        guarded_steps(opt, model, make_data(6))
    assert [s for s, _, _ in inj.fired] == [2, 4]
    assert [r.step for r in opt.history if r.skipped] == [2, 4]
    assert all(math.isnan(opt.history[s].loss) for s in (2, 4))


def test_large_finite_output_overflows_fp16_only():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    faults.inject(opt, faults.output("1", 6e4, steps=[1]))
    guarded_steps(opt, model, make_data(3))
    r = opt.history[1]
    assert r.skipped and r.reason == "nonfinite_grad"  # fp16 overflow in backward, loss finite
    assert not r.nonfinite_loss and math.isfinite(r.loss)
    assert opt.anomalies[0].kind == "overflow"


def test_after_reduction_grad_fault_and_removal():
    model, opt = _guard()
    inj = faults.inject(opt, faults.grad("2.bias", "-inf", steps=None, after_reduction=True))
    guarded_steps(opt, model, make_data(2))
    assert all(r.skipped and r.reason == "nonfinite_grad" for r in opt.history)
    assert opt.anomalies[-1].params == ("2.bias",)
    inj.remove()
    inj.remove()
    guarded_steps(opt, model, make_data(2))
    assert not opt.history[2].skipped and not opt.history[3].skipped


def test_faults_respect_ranks_and_validate_names():
    model, opt = _guard()
    with faults.inject(opt, faults.loss("nan", steps=[0], ranks=[1])) as inj:
        guarded_steps(opt, model, make_data(1))
    assert inj.fired == [] and not opt.history[0].skipped  # this process is rank 0
    with pytest.raises(ValueError, match="no parameter named 'nope'"):
        faults.inject(opt, faults.grad("nope", steps=[1]))
    with pytest.raises(ValueError, match="allowed: 'nan', 'inf', '-inf'"):
        faults.loss("NaNa", steps=[1])
    with pytest.raises(TypeError, match=r"ampguard.wrap\(\)"):
        faults.inject(make_opt(model), faults.loss(steps=[1]))
