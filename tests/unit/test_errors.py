"""Bad input: a clear error, and nothing changed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import ampguard
from ampguard.hardware import check_precision

from ._models import assert_same, guarded_steps, loss_of, make_data, make_model, make_opt, snapshot


def _backward(opt, model, data):
    x, y = data
    with opt.autocast():
        loss = loss_of(model, x, y)
    opt.backward(loss)


def test_scaler_step_on_guarded_optimizer_is_refused_and_changes_nothing():
    model = make_model()
    scaler = torch.amp.GradScaler("cpu")
    opt = ampguard.wrap(make_opt(model), model=model, scaler=scaler)
    guarded_steps(opt, model, make_data(2))
    _backward(opt, model, make_data(1)[0])
    before = snapshot(model, opt)
    grads = [p.grad.clone() for p in model.parameters()]
    scaler_state = scaler.state_dict()
    with pytest.raises(ampguard.GuardStateError, match=r"scaler.step\(opt\)"):
        scaler.step(opt)
    assert_same(before, snapshot(model, opt))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert scaler.state_dict() == scaler_state
    assert id(opt) not in scaler._per_optimizer_states
    opt.step()  # and the guarded step still works, unscaling exactly once
    assert not opt.step_was_skipped


def test_user_unscale_before_step_is_adopted_not_done_twice():
    data = make_data(4)
    ref = make_model()
    ref_opt = ampguard.wrap(make_opt(ref), model=ref, precision="fp16")
    guarded_steps(ref_opt, ref, data)
    model = make_model()
    scaler = torch.amp.GradScaler("cpu")
    opt = ampguard.wrap(make_opt(model), model=model, scaler=scaler)
    for x, y in data:
        _backward(opt, model, (x, y))
        scaler.unscale_(opt)  # habit from the plain loop (to inspect or clip gradients)
        opt.step()
        opt.zero_grad()
    assert_same(snapshot(ref, ref_opt), snapshot(model, opt))


def test_step_after_a_backward_the_guard_did_not_run_is_guarded():
    """A framework's (or the user's) own loss.backward() feeds the guarded step: it still checks,
    decides and steps (bf16: nothing to scale)."""
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16")
    x, y = make_data(1)[0]
    with opt.autocast():
        loss = loss_of(model, x, y)
    opt.observe_loss(loss)
    loss.backward()
    before = snapshot(model, opt)
    opt.step()
    report = opt.last_report
    assert not report.skipped and report.loss == pytest.approx(loss.item()) and report.grad_norm > 0
    name, first = next(iter(model.named_parameters()))
    assert not torch.equal(before[f"p.{name}"], first)  # the inner optimizer stepped


def test_fp16_step_on_gradients_the_guards_scaler_did_not_scale_is_refused():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16")
    x, y = make_data(1)[0]
    with opt.autocast():
        loss_of(model, x, y).backward()  # not scaled: unscaling would shrink the update by the scale
    before = snapshot(model, opt)
    with pytest.raises(ampguard.GuardStateError, match=r"opt.scaler did not scale"):
        opt.step()
    assert_same(before, snapshot(model, opt))
    opt.zero_grad()
    with opt.autocast():
        opt.scaler.scale(loss_of(model, x, y)).backward()  # the shared scaler: legitimate
    opt.step()
    assert opt.last_report is not None and not opt.last_report.skipped


def test_call_order_is_enforced_before_anything_changes():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model)
    _backward(opt, model, make_data(1)[0])
    opt.step()
    before = snapshot(model, opt)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ampguard.GuardStateError, match=r"after step\(\) with no backward"):
        opt.step()
    # backward -> step -> backward without zero_grad() would add to the old gradients
    with pytest.raises(ampguard.GuardStateError, match=r"backward\(\) after step\(\) without zero_grad\(\)"):
        _backward(opt, model, make_data(1)[0])
    assert_same(before, snapshot(model, opt))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    opt.zero_grad()
    with pytest.raises(ampguard.GuardStateError, match=r"after zero_grad\(\)"):
        opt.step()
    # accumulation (several backward() before one step()) stays legal
    _backward(opt, model, make_data(1)[0])
    _backward(opt, model, make_data(2)[1])
    opt.step()
    assert opt.step_count == 2


def test_wrapping_twice_is_refused():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model)
    with pytest.raises(ampguard.GuardStateError, match="already guarded"):
        ampguard.wrap(opt)


def test_enabled_scaler_with_bf16_is_refused_and_auto_picks_fp16():
    model = make_model()
    with pytest.raises(ValueError, match="loss scaling is for fp16"):
        ampguard.wrap(make_opt(model), precision="bf16", scaler=torch.amp.GradScaler("cpu"))
    opt = ampguard.wrap(make_opt(model), scaler=torch.amp.GradScaler("cpu"))
    assert opt.precision == "fp16"


def test_optimizer_without_parameters_is_refused():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    opt.param_groups[0]["params"] = []
    with pytest.raises(ValueError, match="no parameters"):
        ampguard.wrap(opt)


def test_bad_precision_and_config():
    model = make_model()
    with pytest.raises(ValueError, match="precision='fp8'"):
        ampguard.wrap(make_opt(model), precision="fp8")
    with pytest.raises(ValueError, match=r"unknown GuardConfig key\(s\): 'hysterisis' \(did you mean 'hysteresis'\?\)"):
        ampguard.wrap(make_opt(model), config={"hysterisis": 2})
    with pytest.raises(TypeError, match="GuardConfig"):
        ampguard.wrap(make_opt(model), config=3)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("hysteresis", 0, "an int >= 1"),
        ("hysteresis", 1.5, "an int >= 1"),
        ("min_scale", 0.0, "a finite number > 0"),
        ("max_scale", float("inf"), "a finite number > 0"),
        ("max_consecutive_skips", 0, "None or an int >= 1"),
        ("clip_grad_norm", -1.0, "a finite number > 0"),
        ("history_size", 0, "an int >= 1"),
        ("on_divergence", "panic", "'warn' | 'raise'"),
        ("consistency_every", True, "None or an int >= 1"),
    ],
)
def test_config_validation_names_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError, match=rf"GuardConfig\.{field}=" + re.escape(repr(value)) + f"; allowed: {allowed}"):
        ampguard.GuardConfig(**{field: value})


def test_config_is_frozen_and_max_below_min_is_refused():
    cfg = ampguard.GuardConfig()
    with pytest.raises(AttributeError):
        cfg.hysteresis = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="below min_scale"):
        ampguard.GuardConfig(min_scale=8.0, max_scale=4.0)
    assert cfg.replace(hysteresis=3).hysteresis == 3


def test_hardware_rule_table():
    cuda = torch.device("cuda", 0)
    with pytest.raises(ampguard.UnsupportedPrecisionError, match=r"compute capability >= 8\.0"):
        check_precision("bf16", cuda, capability=(7, 5))
    check_precision("bf16", cuda, capability=(8, 0))
    check_precision("fp16", cuda, capability=(7, 0))
    with pytest.warns(RuntimeWarning, match="no fp16 tensor cores"):
        check_precision("fp16", cuda, capability=(6, 1))
    check_precision("bf16", torch.device("cpu"))


def test_bad_loss_is_refused():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model)
    x, y = make_data(1)[0]
    with pytest.raises(ValueError, match="scalar loss"):
        opt.backward(model(x))
    with pytest.raises(ValueError, match="does not require grad"):
        opt.backward(loss_of(model, x, y).detach())
    with pytest.raises(TypeError, match="loss tensor"):
        opt.backward(1.0)


def test_closed_guard_refuses_work():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model)
    opt.close()
    opt.close()
    with pytest.raises(ampguard.GuardStateError, match="after close"):
        _backward(opt, model, make_data(1)[0])


def test_import_is_light_and_global_free():
    code = (
        "import sys, torch\n"
        "from torch.nn.modules import module as m\n"
        "before = (len(m._global_forward_hooks), len(m._global_backward_hooks), len(m._global_forward_pre_hooks))\n"
        "import ampguard\n"
        "after = (len(m._global_forward_hooks), len(m._global_backward_hooks), len(m._global_forward_pre_hooks))\n"
        "assert before == after, (before, after)\n"
        "heavy = ('horovod', 'tensorboard', 'matplotlib', 'rich', 'torch.utils.tensorboard')\n"
        "bad = [n for n in heavy if n in sys.modules]\n"
        "assert not bad, bad\n"
        "import threading; assert threading.active_count() == 1, threading.enumerate()\n"
        "assert set(ampguard.__all__) <= set(dir(ampguard))\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_refusal_reason_drops_the_closing_nothing_was_loaded_of_the_real_refusals():
    """The refusals a caller rewords after an in-place load (ampguard.integrations.dcp, the accelerate and Trainer
    FSDP checkpoints): a real one from the guard's own check, and each phrasing the checks end with."""
    from ampguard.errors import refusal_reason

    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16", exporters=[])
    guarded_steps(opt, model, make_data(1))
    saved = opt._state_without_optimizer()
    saved["ampguard"]["grad_ema"] = float("nan")
    with pytest.raises(ValueError) as refused:
        opt._check_without_optimizer(saved, opt.optimizer.state_dict())
    assert str(refused.value).endswith("Nothing was loaded.")
    assert refusal_reason(refused.value) == ("ValueError: state_dict['ampguard']['grad_ema'] is nan; expected a finite "
                                             "number (float32 range)")
    for tail in ("; nothing was loaded", ". Nothing was loaded.", " Nothing was loaded"):
        assert refusal_reason(ampguard.CheckpointError("bad" + tail), typed=False) == "bad"
    assert refusal_reason(KeyError("other"), typed=False) == "'other'"
    opt.close()
