"""A run that cannot learn stops by default; loop mistakes the guard can see are said once, naming the
fix; a failed backward() leaves the guard as it was.

Each fixture is the failing input itself: a batch with a NaN feature on every step, an optimizer built
on another model's parameters, the old ``scaler.scale(loss).backward()`` habit, a float16 autocast
under ``precision="auto"`` (bf16 on CPU), a backward through a graph modified in place.
"""

from __future__ import annotations

import json
import logging
import math
import warnings

import pytest
import torch

import ampguard
from ampguard.runlog import load_run

from ._models import guarded_steps, loss_of, make_data, make_model, make_opt


def _messages(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ampguard" and r.levelno >= level]


def _run(opt, model, batches, n):
    guarded_steps(opt, model, [batches[i % len(batches)] for i in range(n)])


# ------------------------------------------------------------------ a run that cannot learn (default config)
def test_nan_loss_on_every_step_stops_by_default_after_a_warm_up_that_does_not(caplog):
    caplog.set_level(logging.INFO, logger="ampguard")
    model = make_model()
    # A loss of large magnitude: fp16 gradients overflow at GradScaler's 65536 until the scale has
    # come down (a genuine warm-up calibration), here with DeepSpeed's/Megatron's hysteresis=2.
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-7), model=model, precision="fp16",
                        config={"hysteresis": 2})
    good = [(x, y * 1e3) for x, y in make_data(4)]
    _run(opt, model, good, 60)
    warm_up = sum(r.skipped for r in opt.history)
    assert 10 <= warm_up < 50 and not any(r.skipped for r in opt.history[30:])  # calibrated: no stop
    assert not [m for m in _messages(caplog, logging.WARNING) if "in a row" in m]
    # Then every batch carries a NaN feature: the loss is NaN on every step.
    bad = [(x.clone().index_fill_(1, torch.tensor([2]), math.nan), y) for x, y in good]
    with pytest.raises(ampguard.NonFiniteError) as err:
        _run(opt, model, bad, 500)
    assert opt.step_count == 60 + 100  # GuardConfig.max_consecutive_skips defaults to 100
    msg = str(err.value)
    assert "100 consecutive steps skipped" in msg and "nonfinite_loss" in msg and "the loss itself" in msg
    said = _messages(caplog, logging.WARNING)
    assert any("nonfinite_loss" in m and "What to do" in m for m in said)  # at once, with the first NaN loss
    assert any("50 steps in a row skipped" in m for m in said)  # half-way, well before the stop
    assert any("training stops" in m for m in _messages(caplog, logging.ERROR))


def test_optimizer_over_another_models_parameters_stops_by_default(caplog):
    caplog.set_level(logging.INFO, logger="ampguard")
    model, other = make_model(0), make_model(1)
    opt = ampguard.wrap(make_opt(other), model=other, precision="bf16")  # built on the wrong model
    with pytest.raises(ampguard.NonFiniteError) as err:
        _run(opt, model, make_data(4), 300)
    assert opt.step_count == 100
    assert err.value.report.reason == "no_gradients"
    assert "is the optimizer built on this model's parameters" in str(err.value)
    first = [m for m in _messages(caplog, logging.ERROR) if "no_gradients" in m]
    assert first and first[0].startswith("step 0, rank 0:")  # said on the first step, not after 100
    assert len(first) == 1 + 1  # the first, then once more after REPEAT_EVERY steps


def test_the_default_bound_is_in_the_config_and_can_be_turned_off():
    assert ampguard.GuardConfig().max_consecutive_skips == 100
    model, other = make_model(0), make_model(1)
    opt = ampguard.wrap(make_opt(other), precision="bf16", config={"max_consecutive_skips": None})
    _run(opt, model, make_data(2), 120)
    assert opt.skipped_steps == 120


# ------------------------------------------------------------------ the loss the guard never saw
def test_scaler_scale_backward_warns_once_and_the_loss_is_unknown_not_nan(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ampguard")
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16",
                        exporters=[ampguard.JsonlExporter(tmp_path / "events.jsonl", every_step=True)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in make_data(6):
            with opt.autocast():
                loss = loss_of(model, x, y)
            opt.scaler.scale(loss).backward()  # the old habit, with the guard's own scaler
            opt.step()
            opt.zero_grad()
    mine = [w for w in caught if "ampguard" in str(w.message) and "loss" in str(w.message)]
    assert len(mine) == 1 and "opt.backward(loss)" in str(mine[0].message)
    assert "opt.observe_loss(loss)" in str(mine[0].message)
    assert mine[0].filename == __file__  # points at the user's step() call
    assert len([m for m in _messages(caplog, logging.WARNING) if "opt.backward(loss)" in m]) == 1
    reports = list(opt.history)
    assert all(r.loss is None and not r.nonfinite_loss for r in reports)
    opt.close()
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    steps = [rec for rec in lines if rec["event"] in ("step", "skipped")]
    assert len(steps) == 6 and all(rec["loss"] is None for rec in steps)  # JSON null, not "nan"
    run = load_run(tmp_path)
    assert [r.loss for r in run.ranks[0].reports] == [None] * 6
    assert not any(r.nonfinite_loss for r in run.ranks[0].reports)
    # The same loop giving its loss (opt.backward, or its own backward and observe_loss) says nothing.
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (x, y) in enumerate(make_data(4)):
            with opt.autocast():
                loss = loss_of(model, x, y)
            if i % 2:
                opt.backward(loss)
            else:
                opt.scaler.scale(loss).backward()
                opt.observe_loss(loss)
            opt.step()
            opt.zero_grad()
    assert all(r.loss is not None and math.isfinite(r.loss) for r in opt.history)


# ------------------------------------------------------------------ an autocast dtype the guard does not run
@pytest.mark.parametrize("backward_inside_autocast", [False, True])
def test_auto_precision_under_a_float16_autocast_warns_once_naming_the_fix(backward_inside_autocast, caplog):
    caplog.set_level(logging.INFO, logger="ampguard")
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model)  # precision="auto": bf16 on a CPU
    assert opt.precision == "bf16"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in make_data(4):
            with torch.autocast("cpu", dtype=torch.float16):  # the loop's own autocast: float16
                loss = loss_of(model, x, y)  # a float32 loss (mse on .float()) from float16 activations
                if backward_inside_autocast:
                    opt.backward(loss)
            if not backward_inside_autocast:
                opt.backward(loss)
            opt.step()
            opt.zero_grad()
    mine = [str(w.message) for w in caught if "autocast" in str(w.message)]
    assert len(mine) == 1 and "float16" in mine[0] and "precision='fp16'" in mine[0]
    assert len([m for m in _messages(caplog, logging.WARNING) if "precision='fp16'" in m]) == 1
    # An autocast that matches the guard's precision says nothing.
    for precision, dtype in (("auto", torch.bfloat16), ("fp16", torch.float16)):
        opt = ampguard.wrap(make_opt(model), model=model, precision=precision)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for x, y in make_data(3):
                with torch.autocast("cpu", dtype=dtype):
                    loss = loss_of(model, x, y)
                opt.backward(loss)
                opt.step()
                opt.zero_grad()




# ------------------------------------------------------------------ a failed backward changes nothing
def _inplace_broken_loss(model, x):
    out = torch.sigmoid(model(x))
    out.add_(1.0)  # sigmoid saved its output for backward: backward() now raises
    return out.mean()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_backward_that_raises_leaves_the_guard_as_it_was(precision):
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision=precision)
    (x0, y0), (x1, _) = make_data(2)
    loss = loss_of(model, x0, y0)
    opt.backward(loss)
    broken = _inplace_broken_loss(model, x1)
    with pytest.raises(RuntimeError, match="inplace"):
        opt.backward(broken)
    opt.step()
    assert opt.last_report.loss == pytest.approx(loss.item(), rel=1e-6)  # the failed micro-batch is not in it
    assert not opt.last_report.skipped
    opt.zero_grad()
    # A failed backward as the only one of a step: there is nothing to step on, as before the call.
    with pytest.raises(RuntimeError, match="inplace"):
        opt.backward(_inplace_broken_loss(model, x1))
    with pytest.raises(ampguard.GuardStateError, match="no backward in between"):
        opt.step()
    assert opt.step_count == 1 and opt.skipped_steps == 0


def test_a_second_backward_through_a_freed_graph_is_not_counted():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16")
    x, y = make_data(1)[0]
    loss = loss_of(model, x, y)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        opt.backward(loss)  # last step's loss again: its graph was freed
    with pytest.raises(ampguard.GuardStateError, match="no backward in between"):
        opt.step()  # not a step skipped as no_gradients: nothing happened since zero_grad()
    assert opt.step_count == 1 and opt.skipped_steps == 0
