"""Input the API used to accept and should not, and containers whose parts disagreed: each
test feeds the input a user wrote and checks the error names the fix (and that nothing changed)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import ampguard
from ampguard import faults

from ._models import guarded_steps, loss_of, make_data, make_model, make_opt


# ---------------------------------------------------------------------------------- GuardConfig(...)
def test_a_misspelt_guard_config_keyword_names_the_field_as_the_dict_form_does():
    with pytest.raises(TypeError, match=r"'max_consecutive_skip' \(did you mean 'max_consecutive_skips'\?\)"):
        ampguard.GuardConfig(max_consecutive_skip=5)
    with pytest.raises(ValueError, match=r"'max_consecutive_skip' \(did you mean 'max_consecutive_skips'\?\)"):
        ampguard.GuardConfig.from_dict({"max_consecutive_skip": 5})
    with pytest.raises(TypeError, match=r"'rollbak_after' \(did you mean 'rollback_after'\?\)"):
        ampguard.Escalation(rollbak_after=2)
    # the generated constructor still does the work: values, validation, replace, positional refusal
    cfg = ampguard.GuardConfig(max_consecutive_skips=5, escalation=ampguard.Escalation(rollback_after=2))
    assert cfg.max_consecutive_skips == 5 and cfg.escalation.rollback_after == 2
    assert dataclasses.replace(cfg, hysteresis=3).hysteresis == 3 and cfg.replace(hysteresis=2).hysteresis == 2
    with pytest.raises(TypeError, match=r"'hysterisis' \(did you mean 'hysteresis'\?\)"):
        dataclasses.replace(cfg, hysterisis=3)
    with pytest.raises(ValueError, match=r"GuardConfig\.hysteresis=0"):
        ampguard.GuardConfig(hysteresis=0)
    with pytest.raises(TypeError, match="positional"):
        ampguard.GuardConfig(2)  # type: ignore[misc]


# ---------------------------------------------------------------------------------- exporters=[Class]
@pytest.mark.parametrize("given", ["list", "single"])
def test_an_exporter_class_instead_of_an_instance_is_refused_at_wrap(given, tmp_path):
    model = make_model()
    inner = make_opt(model)
    before = inner.state_dict()
    exporters = [ampguard.JsonlExporter] if given == "list" else ampguard.JsonlExporter
    with pytest.raises(TypeError, match=r"JsonlExporter is a class, not an exporter; pass an instance, "
                                        r"JsonlExporter\(\.\.\.\)"):
        ampguard.wrap(inner, model=model, exporters=exporters)
    assert inner.state_dict() == before and not hasattr(inner, "guard")
    # the fix the message names works, on the same optimizer (nothing was half-done)
    opt = ampguard.wrap(inner, model=model, exporters=[ampguard.JsonlExporter(str(tmp_path / "e.jsonl"))])
    guarded_steps(opt, model, make_data(2))
    opt.close()
    assert (tmp_path / "e.jsonl").exists()


# ---------------------------------------------------------------------------------- History
def test_history_length_is_what_iteration_yields():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, config={"history_size": 5})
    guarded_steps(opt, model, make_data(10))
    h = opt.history
    assert len(h) == len(list(h)) == 5
    assert [r.step for r in h] == [5, 6, 7, 8, 9] and [r.step for r in reversed(h)] == [9, 8, 7, 6, 5]
    assert h.steps_reported == 10 and h.first_step == 5
    assert h[9].step == 9 and h[-1].step == 9 and h[5].step == 5 and [r.step for r in h[3:7]] == [5, 6]
    assert h.index(h[7]) == 7 and h[7] in h
    with pytest.raises(IndexError, match="history_size"):
        h[4]


def test_skip_aware_schedule_counts_every_taken_step_whatever_the_history_keeps():
    # The schedule counts taken steps from the steps reported, not from the reports retained.
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, config={"history_size": 2},
                        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**22))  # fp16 overflows on early steps
    sched = opt.schedule(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    guarded_steps(opt, model, make_data(12))
    opt.flush()
    taken = 12 - opt.skipped_steps
    assert 0 < opt.skipped_steps < 12 and sched.last_epoch == taken
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**taken)


# ---------------------------------------------------------------------------------- fault values
def _fp16_guard() -> tuple[torch.nn.Module, ampguard.GuardedOptimizer]:
    model = make_model()
    return model, ampguard.wrap(make_opt(model), model=model, scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("where", ["output", "backward"])
def test_a_fault_value_beyond_the_dtype_says_so_naming_its_largest_value(where):
    # The README's example, faults.output(name, 1e5, ...), under fp16 autocast: torch cannot write
    # 1e5 into a float16 tensor. It used to surface as torch's bare RuntimeError from faults.py.
    model, opt = _fp16_guard()
    module = "0" if where == "output" else "2"  # "2": the last Linear, whose input (and its gradient) is fp16
    fault = getattr(faults, where)(module, 1e5, steps=[1])
    x, y = make_data(1)[0]
    with faults.inject(opt, fault):
        with opt.autocast():
            opt.backward(loss_of(model, x, y))  # step 0: not due, nothing checked or raised
        opt.step()
        opt.zero_grad()
        what = "output" if where == "output" else "gradient"
        says = rf"faults\.{where}\('{module}', 100000\): 100000 does not fit the {what}'s dtype torch\.float16 " \
               r"\(largest finite value 65504\)"
        with pytest.raises(ValueError, match=says), opt.autocast():
            opt.backward(loss_of(model, x, y))


def test_a_fault_value_that_fits_fp16_overflows_for_real():
    # The README's example with a value that fits: a genuine fp16 overflow downstream, in backward.
    model, opt = _fp16_guard()
    with faults.inject(opt, faults.output("0", 6e4, steps=[1])) as inj:
        guarded_steps(opt, model, make_data(3))
    r = opt.history[1]
    assert [s for s, _, _ in inj.fired] == [1]
    assert r.skipped and r.reason == "nonfinite_grad" and math.isfinite(r.loss)
    assert opt.anomalies[0].kind == "overflow"
