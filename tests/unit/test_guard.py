"""The single-process guard: transparency, skips, scale control, detectors, clipping, state."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import ampguard
from ampguard import faults

from ._models import assert_same, guarded_steps, loss_of, make_data, make_model, make_opt, snapshot


def plain_fp16_loop(kind: str, data, clip: float | None = None, **scaler_kw):
    model = make_model()
    opt = make_opt(model, kind)
    scaler = torch.amp.GradScaler("cpu", **scaler_kw)
    scales = []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, x, y)
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model, opt, scales


@pytest.mark.parametrize("kind", ["adamw", "adamw_fused", "sgd"])
def test_fp16_bitwise_identical_to_plain_gradscaler_loop(kind):
    # growth_interval=3 so the scale grows and (on this model, naturally) overflows and backs off:
    # the guard must reproduce GradScaler's whole scale trajectory, not just the healthy case.
    data = make_data(24)
    ref_model, ref_opt, ref_scales = plain_fp16_loop(kind, data, growth_interval=3)
    model = make_model()
    opt = ampguard.wrap(make_opt(model, kind), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu", growth_interval=3))
    guarded_steps(opt, model, data)
    assert_same(snapshot(ref_model, ref_opt), snapshot(model, opt))
    assert [r.loss_scale for r in opt.history] == ref_scales
    assert len(set(ref_scales)) > 1  # the trajectory was not trivial


def test_clip_reuses_the_guards_norm_and_matches_unscale_plus_clip_grad_norm():
    data = make_data(16)
    ref_model, ref_opt, _ = plain_fp16_loop("adamw", data, clip=0.05)
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16", config={"clip_grad_norm": 0.05})
    guarded_steps(opt, model, data)
    # Within float32 rounding, not bitwise: on the CPU the guard's norm is sqrt(dot(g, g)) and
    # clip_grad_norm_'s is vector_norm (ampguard.stats.cpu_norms; test_fast_path.py's tolerances).
    a, b = snapshot(ref_model, ref_opt), snapshot(model, opt)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    clipped = [r for r in opt.history if r.clip_coef < 1.0]
    assert clipped, "max_norm 0.05 should clip some steps"
    for r in clipped:
        assert r.clip_coef == pytest.approx(0.05 / (r.grad_norm + 1e-6), rel=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["adamw", "adamw_fused"])
def test_bf16_fp32_identical_to_plain_loop_and_no_scaler(precision, kind):
    data = make_data(8)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    ref = make_model()
    ref_opt = make_opt(ref, kind)
    for x, y in data:
        with torch.autocast("cpu", dtype=dtype, enabled=precision == "bf16"):
            loss = loss_of(ref, x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = make_model()
    opt = ampguard.wrap(make_opt(model, kind), model=model, precision=precision)
    assert opt.scaler is None
    guarded_steps(opt, model, data)
    assert_same(snapshot(ref, ref_opt), snapshot(model, opt))
    assert all(r.loss_scale == 1.0 and not r.skipped for r in opt.history)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("kind", ["adamw", "adamw_fused"])
@pytest.mark.parametrize("where", ["grad", "loss"])
def test_nonfinite_skips_and_leaves_params_and_state_untouched(precision, kind, where):
    data = make_data(6)
    model = make_model()
    # init_scale 1024: this model overflows fp16 naturally at GradScaler's default 65536.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if precision == "fp16" else None
    opt = ampguard.wrap(make_opt(model, kind), model=model, precision=precision, scaler=scaler)
    guarded_steps(opt, model, data[:3])
    before = snapshot(model, opt)
    scale_before = opt.get_scale()
    fault = faults.grad("0.weight", "nan", steps=[3]) if where == "grad" else faults.loss("inf", steps=[3], mode="mul")
    with faults.inject(opt, fault) as inj:
        guarded_steps(opt, model, data[3:4])
    assert inj.fired and inj.fired[0][0] == 3
    assert opt.step_was_skipped
    assert_same(before, snapshot(model, opt))
    r = opt.last_report
    assert r.step == 3 and r.skipped
    assert r.reason == ("nonfinite_grad" if where == "grad" else "nonfinite_loss")
    assert r.nonfinite_grads >= 1
    assert r.nonfinite_ranks == ()
    if precision == "fp16":
        assert r.loss_scale == scale_before and opt.get_scale() == scale_before / 2
    else:
        assert opt.get_scale() == 1.0
    kinds = [a.kind for a in opt.anomalies if a.step == 3]
    expected = "nonfinite_loss" if where == "loss" else ("overflow" if precision == "fp16" else "nonfinite_grad")
    assert kinds == [expected]
    if where == "grad":
        assert opt.anomalies[-1].params == ("0.weight",)
    # The next clean step trains again.
    guarded_steps(opt, model, data[4:5])
    assert not opt.step_was_skipped


def test_nonfinite_loss_with_finite_grads_skips_without_backoff():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16")
    with faults.inject(opt, faults.loss("nan", steps=[1])):
        guarded_steps(opt, model, make_data(3))
    r = opt.history[1]
    assert r.skipped and r.reason == "nonfinite_loss" and r.nonfinite_loss and r.nonfinite_grads == 0
    assert math.isnan(r.loss)
    assert r.next_loss_scale == r.loss_scale  # the scale did not cause it: no backoff


def test_hysteresis_allowance_is_spent_by_overflows_and_refilled_only_by_growth():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0),
                        config={"hysteresis": 3})
    s0 = opt.get_scale()
    with faults.inject(opt, faults.grad("2.weight", "inf", steps=[1, 2, 4, 5, 6, 7])):
        guarded_steps(opt, model, make_data(9))
    h = opt.history
    assert [h[i].skipped for i in range(9)] == [False, True, True, False, True, True, True, True, False]
    # steps 1, 2: two overflows spend the allowance (hysteresis - 1 = 2): no backoff
    assert h[3].loss_scale == s0
    # step 4: the third overflow since the scale last grew backs off although a clean step came
    # between (docs/hysteresis.md); so does every later one until the scale grows
    assert h[4].loss_scale == s0 and h[4].next_loss_scale == s0 / 2
    assert [h[i].next_loss_scale for i in (5, 6, 7)] == [s0 / 4, s0 / 8, s0 / 16]
    assert h[8].loss_scale == s0 / 16


def test_scale_floor_and_ceiling():
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    opt = ampguard.wrap(make_opt(model), model=model, scaler=scaler,
                        config={"min_scale": 2.0, "max_scale": 16.0})
    with faults.inject(opt, faults.grad("0.bias", "inf", steps=[3, 4, 5, 6])):
        guarded_steps(opt, model, make_data(8))
    scales = [r.loss_scale for r in opt.history]
    assert scales == [8.0, 16.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0]
    floors = [a for a in opt.anomalies if a.kind == "scale_floor"]
    assert [a.step for a in floors] == [5, 6]
    assert all(2.0 <= s <= 16.0 for s in scales)


def test_max_consecutive_skips_raises_nonfinite_error():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16", config={"max_consecutive_skips": 3})
    faults.inject(opt, faults.grad("0.weight", "nan", steps=range(2, 100)))
    with pytest.raises(ampguard.NonFiniteError, match="3 consecutive steps skipped") as err:
        guarded_steps(opt, model, make_data(10))
    assert opt.step_count == 5  # steps 2, 3, 4 skipped -> raised at the end of step 4
    assert err.value.report.step == 4 and err.value.report.skipped
    opt.close()  # armed by the NaN steps: close disarms (the traceback would keep it alive past the test)


@pytest.mark.parametrize("on_spike", ["warn", "skip"])
def test_grad_spike_detector(on_spike):
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16",
                        config={"spikes": {"grad_factor": 5.0, "warmup": 5, "action": on_spike}})
    data = make_data(10)
    x, y = data[8]
    data[8] = (x, y * 1000.0)  # a real spike: the target jumps, the gradient norm with it
    guarded_steps(opt, model, data)
    spikes = [a for a in opt.anomalies if a.kind == "grad_spike"]
    assert [a.step for a in spikes] == [8]
    assert opt.history[8].grad_spike
    assert opt.history[8].skipped == (on_spike == "skip")
    assert opt.history[8].reason == ("grad_spike" if on_spike == "skip" else None)
    assert not any(r.grad_spike for r in list(opt.history)[:8])


def test_loss_spike_detector_waits_for_warmup():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16",
                        config={"spikes": {"loss_factor": 3.0, "warmup": 4, "action": "skip"}})
    data = make_data(8)
    data[2] = (data[2][0], data[2][1] * 100)  # before warm-up: not flagged
    data[6] = (data[6][0], data[6][1] * 100)  # after: flagged and skipped
    guarded_steps(opt, model, data)
    assert [a.step for a in opt.anomalies if a.kind == "loss_spike"] == [6]
    assert opt.history[6].skipped and opt.history[6].reason == "loss_spike"


def test_state_dict_round_trip_continues_bit_for_bit():
    cfg = {"hysteresis": 2, "spikes": {"grad_factor": 50.0, "warmup": 2}}
    data = make_data(16)
    plan = [faults.grad("0.weight", "inf", steps=[5, 8, 9]), faults.loss("nan", steps=[11])]

    def build():
        model = make_model()
        opt = ampguard.wrap(make_opt(model), model=model, precision="fp16",
                            scaler=torch.amp.GradScaler("cpu", growth_interval=4), config=cfg)
        faults.inject(opt, *plan)
        return model, opt

    model_a, opt_a = build()
    guarded_steps(opt_a, model_a, data)

    model_b, opt_b = build()
    # stops with the allowance spent (5 and 8 overflowed since the growth at step 3): step 9 backs
    # off only if the resumed guard restored that
    guarded_steps(opt_b, model_b, data[:9])
    assert opt_b.state_dict()["ampguard"]["overflow_run"] == 2
    saved_model = {k: v.clone() for k, v in model_b.state_dict().items()}
    saved_opt = opt_b.state_dict()

    model_c, opt_c = build()
    model_c.load_state_dict(saved_model)
    opt_c.load_state_dict(saved_opt)
    assert opt_c.step_count == 9
    guarded_steps(opt_c, model_c, data[9:])
    assert_same(snapshot(model_a, opt_a), snapshot(model_c, opt_c))
    tail_a = [(r.skipped, r.reason, r.loss_scale, r.next_loss_scale) for r in list(opt_a.history)[9:]]
    tail_c = [(r.skipped, r.reason, r.loss_scale, r.next_loss_scale) for r in opt_c.history]
    assert tail_a == tail_c
    assert opt_a.state_dict()["ampguard"] == opt_c.state_dict()["ampguard"]


def test_gradient_accumulation_reports_mean_loss():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16")
    losses = []
    for x, y in make_data(3):
        with opt.autocast():
            loss = loss_of(model, x, y)
        losses.append(loss.item())
        opt.backward(loss)
    opt.step()
    assert opt.last_report.loss == pytest.approx(sum(losses) / 3, rel=1e-6)


def test_lr_scheduler_and_optimizer_surface():
    model = make_model()
    inner = make_opt(model)
    opt = ampguard.wrap(inner, model=model)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for x, y in make_data(4):
        with opt.autocast():
            loss = loss_of(model, x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if not opt.step_was_skipped:
            sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    assert opt.precision == "bf16"  # "auto" on CPU without a scaler


def test_history_is_bounded_and_indexed_by_step():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, config={"history_size": 3})
    guarded_steps(opt, model, make_data(7))
    h = opt.history
    assert len(h) == 3 and h.steps_reported == 7 and h[6].step == 6 and h[-1].step == 6 and h[4].step == 4
    assert [r.step for r in h] == [4, 5, 6]
    with pytest.raises(IndexError, match="history_size"):
        h[3]


def test_exporter_failure_is_contained_and_reported_once(monkeypatch, caplog):
    monkeypatch.setattr(ampguard.MultiExporter, "RETRY_FIRST_S", 3600.0)  # no retry before close(), however slow
    monkeypatch.setenv("AMPGUARD_REPORT_BATCH", "0")  # each report exported at its step, so the failure is seen now
    calls = []

    class Broken:
        def open(self, info):
            calls.append(("open", info.precision))

        def export(self, report, anomalies):
            calls.append(("export", report.step))
            raise OSError("disk full")

        def close(self):
            calls.append(("close",))

    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, exporters=[Broken()])
    with caplog.at_level(logging.ERROR, logger="ampguard"):
        guarded_steps(opt, model, make_data(3))
    assert [r.getMessage().count("\n") for r in caplog.records if "disk full" in r.getMessage()] == [0]
    opt.close()
    # set aside after the failure, training went on; retried with backoff (none within these 3 steps) and
    # once more at close(), which then closes it
    assert calls == [("open", "bf16"), ("export", 0), ("export", 0), ("close",)]
    assert opt.step_count == 3


def test_exporter_sees_every_report_in_order_with_its_anomalies():
    seen = []

    class Recorder:
        def open(self, info):
            seen.append(info)

        def export(self, report, anomalies):
            seen.append((report.step, report.skipped, tuple(a.kind for a in anomalies)))

        def close(self):
            seen.append("closed")

    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16", exporters=[Recorder()])
    faults.inject(opt, faults.grad("0.weight", "inf", steps=[1]))
    guarded_steps(opt, model, make_data(3))
    opt.close()
    info = seen[0]
    assert isinstance(info, ampguard.RunInfo) and info.world_size == 1 and info.precision == "fp16"
    assert info.param_names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert seen[1:] == [(0, False, ()), (1, True, ("overflow",)), (2, False, ()), "closed"]


@pytest.mark.parametrize("path", ["host", "device_lagged"])
def test_both_rollback_paths_record_the_rollback_zero_the_gradients_and_end_the_step(path):
    """A rollback is a step of its own, on both paths: the ladder asks for it on step 8's report
    (two non-finite steps, 7 and 8), and step 9 is the rollback's, a skipped ``rollback`` report,
    with the snapshot after step 5 restored and the gradients zeroed. Where step 8 synchronised
    (CPU) the rollback happens at the end of step 8's ``step()`` (before, it restored the weights
    but recorded no report and left the gradients); on the sync-free path, at the start of the
    next ``step()``, whose gradients it drops."""
    model = make_model()
    config = ampguard.GuardConfig(escalation=ampguard.Escalation(rollback_after=2, window=10, snapshot_every=3))
    lagged = path == "device_lagged"  # the sync-free fused CUDA path, emulated on CPU
    opt = ampguard.wrap(make_opt(model, "adamw_fused" if lagged else "adamw"), model=model, precision="bf16",
                        config=config)
    if lagged:
        opt._pipeline.host_decision, opt._lagged_reports = False, True
    faults.inject(opt, faults.grad("0.weight", "inf", steps=[7, 8]))
    weights, calls = {}, 0
    for x, y in make_data(12):
        opt.backward(loss_of(model, x, y))
        opt.step()
        calls += 1
        if opt._reporter.ladder.rollbacks:
            break
        opt.zero_grad()
        weights[opt.step_count - 1] = snapshot(model, opt)
    assert calls == (10 if lagged else 9) and opt.step_count == 10
    assert all(p.grad is None for p in model.parameters())
    rollback = opt.history[9]
    assert rollback.skipped and rollback.reason == "rollback" and opt.history[8].nonfinite
    assert [a.kind for a in opt.anomalies if a.step == 8][-1] == "rollback"
    assert_same(snapshot(model, opt), weights[5])
    opt.zero_grad()
    (x, y), = make_data(1, seed=5)
    opt.backward(loss_of(model, x, y))
    opt.step()
    opt.flush()
    assert opt.last_report.step == 10 and not opt.last_report.skipped
    opt.close()


def test_on_rollback_gets_the_guard_and_the_rollbacks_step():
    """With ``on_rollback`` (no snapshot), the callback restores; it gets the guard and the
    rollback's own step, which is recorded as a skipped ``rollback`` report."""
    model = make_model()
    calls = []
    config = ampguard.GuardConfig(escalation=ampguard.Escalation(rollback_after=2, window=10, snapshot_every=None))
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16", config=config,
                        on_rollback=lambda o, step: calls.append((o, step)))
    faults.inject(opt, faults.grad("0.weight", "nan", steps=[3, 4]))
    guarded_steps(opt, model, make_data(5))
    assert calls == [(opt, 5)] and opt.step_count == 6
    assert opt.history[5].reason == "rollback" and opt.history[5].skipped
    opt.close()


def test_step_hooks_and_the_profiler_range_as_torch_optimizer_gives_them():
    """``opt.step`` keeps what ``torch.optim.Optimizer`` wraps every step in: this optimizer's and the
    global step pre/post hooks (in torch's order, with the call's arguments), and the profiler range
    ``Optimizer.step#GuardedOptimizer.step`` while a profiler runs; with neither, the step runs without
    them (the same update)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16")
    data = make_data(4)
    calls: list[tuple[str, str, int]] = []

    def hook(what: str):
        return lambda o, a, k: calls.append((what, type(o).__name__, getattr(o, "step_count", -1)))

    handles = [opt.register_step_pre_hook(hook("pre")), opt.register_step_post_hook(hook("post")),
               register_optimizer_step_pre_hook(hook("global pre")),
               register_optimizer_step_post_hook(hook("global post"))]
    try:
        guarded_steps(opt, model, data[:1])
    finally:
        for h in handles:
            h.remove()
    # the global hooks also see the inner optimizer's own step, inside the guard's
    assert calls == [("global pre", "GuardedOptimizer", 0), ("pre", "GuardedOptimizer", 0),
                     ("global pre", "AdamW", -1), ("global post", "AdamW", -1),
                     ("post", "GuardedOptimizer", 1), ("global post", "GuardedOptimizer", 1)]
    guarded_steps(opt, model, data[1:2])  # no hook: nothing more is called
    assert len(calls) == 6 and opt.step_count == 2

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        guarded_steps(opt, model, data[2:3])
    names = [e.name for e in prof.events()]
    assert "Optimizer.step#GuardedOptimizer.step" in names and "Optimizer.step#AdamW.step" in names
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pass
    guarded_steps(opt, model, data[3:4])  # after the profiler: no range, the step as before
    assert opt.step_count == 4 and not any(r.skipped for r in opt.history)
