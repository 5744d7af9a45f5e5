"""Skip-aware LR schedules and weight EMA with no host sync (issue 17, item 1).

Every guarded run is compared with a loop that learns each skip on the host at once (a plain
GradScaler loop, or the guard read eagerly through ``step_was_skipped``) and steps its scheduler
and its reference EMA only on taken steps. Compared bitwise: the LR every optimizer update sees,
the final LR, the parameters, the averaged weights.

The guard's three paths, on CPU:

- ``host``: the CPU default (decision on host floats; reports at once);
- ``device_synced``: the tensor decision, and a non-fused optimizer whose step syncs for the
  skip (GradScaler's ``found_inf.item()``): non-fused CUDA;
- ``device_lagged``: the tensor decision, a fused optimizer, reports decoded at the next
  ``step()`` (``_lagged_reports``): the sync-free fused CUDA path, emulated on CPU.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import ampguard
from ampguard import GuardConfig, faults
from ampguard.errors import GuardStateError
from ampguard.schedules import ScheduledLR

from ._models import loss_of, make_data, make_model, make_opt

PATHS = [("host", "adamw"), ("host", "adamw_fused"), ("device_synced", "adamw"), ("device_lagged", "adamw_fused")]
IDS = [f"{p}-{k}" for p, k in PATHS]
OVERFLOW_SCALE = 2.0**22  # fp16 overflows on several of the first steps with this model and data


def set_path(opt: ampguard.GuardedOptimizer, path: str) -> None:
    if path == "host":
        return
    opt._pipeline.host_decision = False  # the tensor decision (CUDA's), no host floats
    opt._lagged_reports = True  # reports wait for the next step() unless the step synced


def make_sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """An LR that changes at every step: linear warm-up, then cosine (a composite scheduler)."""
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=4)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20, eta_min=1e-4)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[4])


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), (x, y)


def assert_same_run(got, ref) -> None:
    """Two :func:`guarded` runs: the same LR before every update, last LR and skips, and bitwise
    the same parameters and averages."""
    assert got[0] == ref[0] and got[1] == ref[1] and got[4] == ref[4]
    assert_bitwise(got[2], ref[2])
    assert_bitwise(got[3], ref[3])


def ref_ema_update(ema: list[torch.Tensor], model: torch.nn.Module, decay: float) -> None:
    """The eager reference: torch.lerp per tensor (swa_utils.get_ema_multi_avg_fn's formula)."""
    with torch.no_grad():
        for e, p in zip(ema, model.parameters()):
            e.lerp_(p, 1.0 - decay)


# ---------------------------------------------------------------------------------------- runs
def train(model, opt, batches) -> None:
    """The guarded loop, one step a batch."""
    for x, y in batches:
        with opt.autocast():
            loss = loss_of(model, x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()




def plain_fp16(kind: str, data, decay: float = 0.9, after: list | None = None):
    """GradScaler's own loop; the skip read on the host each step (the scale dropped). ``after``: each step's
    ``sched.get_last_lr()`` appended to it."""
    model = make_model()
    inner = make_opt(model, kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=OVERFLOW_SCALE)
    sched = make_sched(inner)
    ema = params(model)
    lrs, skipped = [], []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, x, y)
        scaler.scale(loss).backward()
        lrs.append(inner.param_groups[0]["lr"])
        before = scaler.get_scale()
        scaler.step(inner)
        scaler.update()
        inner.zero_grad()
        skipped.append(scaler.get_scale() < before)  # SYNC: the eager loop's
        if not skipped[-1]:
            sched.step()
            ref_ema_update(ema, model, decay)
        if after is not None:
            after.append(sched.get_last_lr())
    return lrs, sched.get_last_lr(), params(model), ema, skipped


def guarded(kind: str, path: str, data, *, precision: str = "fp16", config: GuardConfig | None = None,
            fault: faults.Fault | None = None, accum: int = 1, schedule: bool = True, decay: float = 0.9,
            model: torch.nn.Module | None = None):
    """A guarded run. ``schedule=True``: opt.schedule + opt.track_ema; False: the eager reference
    (``step_was_skipped`` read after each step, scheduler and EMA stepped by hand). Returns
    (LR before each update, last LR, params, averaged params, skipped flags) and (the scheduler's
    ``last_epoch`` between steps, the LR each call of the inner optimizer's step read)."""
    model = model if model is not None else make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=OVERFLOW_SCALE) if precision == "fp16" else None
    opt = ampguard.wrap(make_opt(model, kind) if not isinstance(kind, torch.optim.Optimizer) else kind,
                        model=model, precision=precision, scaler=scaler, config=config)
    set_path(opt, path)
    sched = make_sched(opt)
    if schedule:
        opt.schedule(sched)
        ema = opt.track_ema(ampguard.EMA(model, decay))
    else:
        ref = params(model)
    lrs: list[float] = []
    between: list[int] = []
    opt.register_pre_unscale_hook(lambda step: lrs.append(opt.param_groups[0]["lr"]))  # before the update
    read: list[float] = []  # what the inner optimizer's step reads (fused: every step; else taken steps)
    opt.optimizer.register_step_pre_hook(lambda o, a, k: read.append(o.param_groups[0]["lr"]))
    handle = faults.inject(opt, fault) if fault is not None else None
    for x, y in data:
        for xs, ys in zip(x.chunk(accum), y.chunk(accum)):
            with opt.autocast():
                loss = loss_of(model, xs, ys)
            opt.backward(loss)
        opt.step()
        opt.zero_grad()
        between.append(sched.last_epoch)
        if not schedule and not opt.step_was_skipped:
            sched.step()
            ref_ema_update(ref, model, decay)
    if handle is not None:
        handle.remove()
    opt.flush()
    skipped = [r.skipped for r in opt.history]
    averaged = list(ema.averaged.values()) if schedule else ref
    result = lrs, sched.get_last_lr(), params(model), averaged, skipped
    opt.close()
    return result, (between, read)


# ---------------------------------------------------------------------------------------- LR and EMA


@pytest.mark.parametrize(("path", "kind"), PATHS, ids=IDS)
def test_same_lr_at_every_step_as_the_eager_gradscaler_loop_across_overflows(path, kind):
    data = make_data(14)
    lrs, last, final, ema, skipped = plain_fp16(kind, data)
    assert sum(skipped) >= 3 and not all(skipped)  # real fp16 overflows
    (g_lrs, g_last, g_final, g_ema, g_skipped), (between, inner_read) = guarded(kind, path, data)
    assert g_skipped == skipped
    assert g_lrs == lrs  # float ==: bitwise (the same Python floats)
    assert inner_read == (lrs if kind == "adamw_fused" else [lr for lr, sk in zip(lrs, skipped) if not sk])
    assert g_last == last
    assert_bitwise(g_final, final)
    assert_bitwise(g_ema, ema)
    taken_before = [sum(not s for s in skipped[: i + 1]) for i in range(len(skipped))]
    if path == "device_lagged":  # between steps advanced as if the last step was taken, undone at the next step()
        assert between == [t + s for t, s in zip(taken_before, skipped)]
    else:
        assert between == taken_before


@pytest.mark.parametrize("lag", [1, 2], ids=["lag1", "lag2_internal"])
@pytest.mark.parametrize("read_last_lr", [True, False], ids=["get_last_lr_read", "not_read"])
def test_between_steps_param_groups_show_the_next_lr_and_get_last_lr_is_the_eager_loops(read_last_lr, lag):
    """On the sync-free path the outcome of step N is learnt at step N+1's fixed point, but between the two a loop
    reads ``opt.param_groups[0]["lr"]`` and ``sched.get_last_lr()`` (to log them). The guard advances the scheduler
    ahead, as if step N was taken: ``param_groups`` show the eager loop's next LR after every taken step (and one
    advance too many after a skipped one, undone before the next update reads it), and ``get_last_lr()`` reads the
    step's skip flag first, so it is the eager loop's after every step. Real fp16 overflows (loss scale 2**22).
    ``lag2_internal``: reports decoded two steps late (an internal knob; a scheduler keeps it at 1), so the
    advances made ahead for two steps are settled together: the scheduler's state stays exact."""
    data = make_data(14)
    eager_after: list = []  # the eager loop: the skip read on the host after each step, the scheduler held on it
    eager_lrs, _, _, _, skipped = plain_fp16("adamw_fused", data, after=eager_after)
    assert sum(skipped) >= 3 and not all(skipped)

    model = make_model()
    opt = ampguard.wrap(make_opt(model, "adamw_fused"), model=model, scaler=torch.amp.GradScaler(
        "cpu", init_scale=OVERFLOW_SCALE))
    set_path(opt, "device_lagged")
    if lag == 2:
        opt._report_lag = lambda: 2
    sched = opt.schedule(make_sched(opt))
    read: list[float] = []  # the LR each update read
    opt.optimizer.register_step_pre_hook(lambda o, a, k: read.append(o.param_groups[0]["lr"]))
    groups, last = [], []
    for batch in data:
        train(model, opt, [batch])
        groups.append(opt.param_groups[0]["lr"])
        if read_last_lr:
            last.append(sched.get_last_lr())
    opt.flush()
    assert [r.skipped for r in opt.history] == skipped
    if lag == 1:
        assert read == eager_lrs  # every update read the eager loop's LR, bitwise
        assert [g for g, s in zip(groups, skipped) if not s] == [a[0] for a, s in zip(eager_after, skipped) if not s]
        assert any(g != a[0] for g, a, s in zip(groups, eager_after, skipped) if s)  # the skip learnt later
    if read_last_lr:
        assert last == eager_after
    assert sched.get_last_lr() == eager_after[-1] and opt.param_groups[0]["lr"] == eager_after[-1][0]
    assert sched.last_epoch == sum(not s for s in skipped)
    opt.close()


@pytest.mark.parametrize(("path", "kind"), PATHS, ids=IDS)
def test_injected_inf_and_nan_bf16_against_the_eager_report(path, kind):
    data = make_data(12)
    fault = faults.grad("0.weight", "inf", steps=[2, 3, 7])
    ref, _ = guarded(kind, "host", data, precision="bf16", fault=fault, schedule=False)
    got, _ = guarded(kind, path, data, precision="bf16", fault=fault)
    assert ref[4] == [s in (2, 3, 7) for s in range(12)]
    assert_same_run(got, ref)


@pytest.mark.parametrize(("path", "kind"), PATHS, ids=IDS)
def test_gradient_accumulation_several_backwards_per_step(path, kind):
    data = make_data(10)
    ref, _ = guarded(kind, "host", data, accum=2, schedule=False)
    got, _ = guarded(kind, path, data, accum=2)
    assert any(ref[4]) and not all(ref[4])
    assert_same_run(got, ref)


@pytest.mark.parametrize(("path", "kind"), PATHS, ids=IDS)
def test_spike_skips_hold_the_schedule_and_the_average(path, kind):
    data = make_data(12)
    config = GuardConfig(spikes=ampguard.Spikes(grad_factor=5.0, warmup=3, action="skip"))
    fault = faults.grad("2.weight", 1e4, steps=[6, 9])  # finite: a spike, not an overflow
    ref, _ = guarded(kind, "host", data, precision="bf16", config=config, fault=fault, schedule=False)
    got, _ = guarded(kind, path, data, precision="bf16", config=config, fault=fault)
    assert [s for s, sk in enumerate(ref[4]) if sk] == [6, 9]
    assert_same_run(got, ref)


def test_ema_of_several_dtypes_against_the_eager_reference():
    def model_fn():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        m[0].to(torch.bfloat16)  # a bf16 layer beside fp32 ones
        return m

    class Cast(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m[2](self.m[1](self.m[0](x.bfloat16()).float()))

    data = make_data(10)
    fault = faults.grad("m.2.weight", "nan", steps=[3, 5])
    for fused, path in ((False, "host"), (True, "host"), (True, "device_lagged")):
        runs = []
        for p, schedule in (("host", False), (path, True)):
            model = Cast(model_fn())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
            run, _ = guarded(opt, p, data, precision="bf16", fault=fault, schedule=schedule, model=model)
            runs.append(run)
        ref, got = runs
        assert ref[4] == [s in (3, 5) for s in range(10)]
        assert {t.dtype for t in ref[3]} == {torch.bfloat16, torch.float32}
        assert got[4] == ref[4]
        assert_bitwise(got[2], ref[2])
        assert_bitwise(got[3], ref[3])


def test_ema_update_on_device_reads_nothing_to_the_host(monkeypatch):
    model = make_model()
    ema = ampguard.EMA(model, 0.5)
    before = [t.clone() for t in ema.averaged.values()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    expected = [b.lerp(p, 0.5) for b, p in zip(before, model.parameters())]

    def refuse(*args, **kwargs):
        raise AssertionError("a host read inside EMA.update")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    ema.update(torch.tensor(1.0))  # skipped: kept, bitwise
    ema.update(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])[7])  # a decision entry, as step() passes
    monkeypatch.undo()
    assert_bitwise(list(ema.averaged.values()), before)
    ema.update(torch.tensor(0.0))
    assert_bitwise(list(ema.averaged.values()), expected)


@pytest.mark.parametrize(("path", "kind"), PATHS, ids=IDS)
def test_schedule_and_ema_add_no_host_read_to_the_step(path, kind, monkeypatch):
    """The same run with and without opt.schedule + track_ema: the same number of .item(),
    .tolist() and bool() of a tensor inside step() and the closing flush (the advance reads two host
    integers)."""
    counts = {}
    calls = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__")}

    def counting(orig):
        def f(*args, **kwargs):
            calls["n"] += 1
            return orig(*args, **kwargs)
        return f

    for schedule in (False, True):
        model = make_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=OVERFLOW_SCALE)
        opt = ampguard.wrap(make_opt(model, kind), model=model, precision="fp16", scaler=scaler)
        set_path(opt, path)
        sched = make_sched(opt)
        if schedule:
            opt.schedule(sched)
            opt.track_ema(ampguard.EMA(model, 0.9))
        else:  # the scheduler's report lag (1) in both runs: forensics then arms on the same steps
            opt._report_lag = lambda: 1  # (an instance attribute: the monkeypatch.undo() below keeps it)
        calls["n"] = 0
        for x, y in make_data(10):
            with opt.autocast():
                loss = loss_of(model, x, y)
            opt.backward(loss)
            for name, orig in originals.items():
                monkeypatch.setattr(torch.Tensor, name, counting(orig))
            opt.step()
            monkeypatch.undo()
            opt.zero_grad()
        for name, orig in originals.items():  # and the reports still pending (the report lag differs:
            monkeypatch.setattr(torch.Tensor, name, counting(orig))  # a scheduler decodes one step sooner)
        opt.flush()
        monkeypatch.undo()
        assert any(r.skipped for r in opt.history)
        counts[schedule] = calls["n"]
        opt.close()
    assert counts[True] == counts[False]


def test_ema_state_dict_copy_to_and_applied():
    model = make_model()
    ema = ampguard.EMA(model, 0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    ema.update()
    live = params(model)
    averaged = [t.clone() for t in ema.averaged.values()]
    with ema.applied():
        assert_bitwise(params(model), averaged)
    assert_bitwise(params(model), live)
    saved = copy.deepcopy(ema.state_dict())
    other = ampguard.EMA(make_model(seed=3), 0.5)
    other.load_state_dict(saved)
    assert other.decay == 0.9
    assert_bitwise(list(other.averaged.values()), averaged)
    fresh = make_model(seed=4)
    other.copy_to(fresh)
    assert_bitwise(params(fresh), averaged)
    with pytest.raises(ValueError, match="parameters"):
        other.load_state_dict({"decay": 0.9, "averaged": {"x": torch.zeros(1)}})
    assert_bitwise(list(other.averaged.values()), averaged)  # a failed load changes nothing
    with pytest.raises(ValueError, match="decay"):
        ampguard.EMA(model, 1.5)


# ---------------------------------------------------------------------------------------- lag, checkpoints, refusals


def test_lagged_advance_is_made_ahead_and_kept_once_readers_and_flush_do_not_apply_it_twice():
    model = make_model()
    opt = ampguard.wrap(make_opt(model, "adamw_fused"), model=model, precision="bf16")
    set_path(opt, "device_lagged")
    sched = opt.schedule(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    (x, y), = make_data(1)
    opt.backward(loss_of(model, x, y))
    opt.step()
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.005  # advanced ahead, as the eager loop's
    assert not opt.step_was_skipped and len(opt.history) == 1  # decoded by a reader...
    assert sched.last_epoch == 1  # ...which applies nothing more
    opt.flush()
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.005  # kept: the step was taken
    opt.zero_grad()
    opt.backward(loss_of(model, x, y))
    opt.step()
    assert sched.last_epoch == 2 and sched.get_last_lr() == [0.0025]
    assert sched.state_dict()["last_epoch"] == 2  # the scheduler's own state_dict counts the pending report
    opt.flush()
    assert sched.last_epoch == 2  # not applied twice
    opt.close()


@pytest.mark.parametrize("scheduler_first", [True, False], ids=["sched_saved_first", "opt_saved_first"])
def test_resume_on_the_lagged_path_continues_the_schedule_exactly(scheduler_first):
    data = make_data(14)
    (lrs, last, final, ema, skipped), _ = guarded("adamw_fused", "device_lagged", data)
    assert any(skipped[:7]) and not skipped[6]  # skips before the checkpoint; step 6's advance pending at it

    def start():
        model = make_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=OVERFLOW_SCALE)
        opt = ampguard.wrap(make_opt(model, "adamw_fused"), model=model, precision="fp16", scaler=scaler)
        set_path(opt, "device_lagged")
        sched = opt.schedule(make_sched(opt))
        ema = opt.track_ema(ampguard.EMA(model, 0.9))
        seen: list[float] = []
        opt.register_pre_unscale_hook(lambda step: seen.append(opt.param_groups[0]["lr"]))
        return model, opt, sched, ema, seen

    model, opt, sched, e, seen = start()
    train(model, opt, data[:7])  # step 6 taken: its advance is pending when we save
    if scheduler_first:
        ckpt = {"sched": copy.deepcopy(sched.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    else:
        ckpt = {"opt": copy.deepcopy(opt.state_dict()), "sched": copy.deepcopy(sched.state_dict())}
    ckpt.update(model=copy.deepcopy(model.state_dict()), ema=copy.deepcopy(e.state_dict()))
    first = list(seen)
    opt.close()

    model, opt, sched, e, seen = start()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    e.load_state_dict(ckpt["ema"])
    train(model, opt, data[7:])
    opt.flush()
    assert first + seen == lrs
    assert sched.get_last_lr() == last
    assert_bitwise(params(model), final)
    assert_bitwise(list(e.averaged.values()), ema)
    opt.close()


def test_refusals_and_close_hands_the_scheduler_back():
    """opt.schedule() returns a wrapper and leaves the scheduler itself as it was (no class change)."""
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16")
    own = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched = opt.schedule(own)
    assert isinstance(sched, ScheduledLR) and sched.scheduler is own and type(own) is torch.optim.lr_scheduler.StepLR
    with pytest.raises(GuardStateError, match=r"opt\.schedule"):
        sched.step()
    assert sched.last_epoch == 0 and sched.get_last_lr() == own.get_last_lr()
    for again in (own, sched):
        with pytest.raises(ValueError, match="already registered"):
            opt.schedule(again)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        opt.schedule(torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    other = torch.optim.SGD(make_model(seed=2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="another optimizer"):
        opt.schedule(torch.optim.lr_scheduler.StepLR(other, step_size=1))
    with pytest.raises(ValueError, match="another model"):
        opt.track_ema(ampguard.EMA(make_model(seed=2)))
    with pytest.raises(TypeError):
        opt.schedule(object())  # type: ignore[arg-type]
    assert sched.state_dict() == own.state_dict()  # nothing of ours in the saved __dict__
    # a scheduler built on the inner optimizer is accepted too (same param_groups)
    inner_sched = opt.schedule(torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5))
    for copied in (pickle.loads(pickle.dumps(inner_sched)), copy.deepcopy(inner_sched)):
        assert type(copied) is torch.optim.lr_scheduler.StepLR  # a copy is the scheduler alone, not registered
    opt.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's: this optimizer never stepped
        sched.step()  # the user's again, through the wrapper
    assert sched.last_epoch == 1 and own.last_epoch == 1


@pytest.mark.parametrize("path", ["host", "device_lagged"])
def test_a_ladder_rollback_rewinds_the_schedule_and_the_average_with_the_model(path):
    """The snapshot after step 5 holds the model, the optimizer, the scheduler and the EMA; two
    overflowing steps (7, 8) roll back to it: the LR and the average continue from step 5's, as
    the weights do (before, the scheduler kept counting the rolled-back steps 6..8)."""
    model = make_model()
    config = GuardConfig(escalation=ampguard.Escalation(rollback_after=2, window=10, snapshot_every=3))
    opt = ampguard.wrap(make_opt(model, "adamw_fused"), model=model, precision="bf16", config=config)
    set_path(opt, path)
    sched = opt.schedule(make_sched(opt))
    ema = opt.track_ema(ampguard.EMA(model, 0.9))
    handle = faults.inject(opt, faults.grad("0.weight", "inf", steps=[7, 8]))
    after: dict[int, tuple] = {}
    for step, (x, y) in enumerate(make_data(12)):
        opt.backward(loss_of(model, x, y))
        opt.step()
        opt.zero_grad()
        opt.flush()  # this step's advance applied: the state "after step N"
        if opt._reporter.ladder.rollbacks:
            break
        averaged = [t.clone() for t in ema.averaged.values()]  # the EMA's own tensors change in place
        after[step] = (params(model), averaged, sched.last_epoch, opt.param_groups[0]["lr"])
    handle.remove()
    assert opt._reporter.ladder.snapshot_step == 5 and opt._reporter.ladder.rollbacks == 1
    assert step == (8 if path == "host" else 9)  # the lagged path learns of step 8 at step 9
    weights, averaged, last_epoch, lr = after[5]
    assert after[6][2] == 7 and last_epoch == 6  # step 6 was taken, and is rolled back
    assert_bitwise(params(model), weights)
    assert_bitwise(list(ema.averaged.values()), averaged)
    assert sched.last_epoch == last_epoch and opt.param_groups[0]["lr"] == lr
    assert sched.get_last_lr() == [lr]
    (x, y), = make_data(1, seed=5)  # training goes on from there: the next taken step advances once
    opt.backward(loss_of(model, x, y))
    opt.step()
    opt.flush()
    assert sched.last_epoch == last_epoch + 1 and opt.param_groups[0]["lr"] == after[6][3]
    opt.close()


def test_a_scheduler_that_raises_in_the_advance_made_ahead_leaves_the_schedules_as_they_were():
    """A scheduler's own error in the advance made ahead (the end of ``step()`` on the sync-free path) reaches the
    caller with the scheduler and the param groups as they were before that advance (the update itself ran); the
    next step's fixed point then steps the scheduler for it, once."""
    model = make_model()
    opt = ampguard.wrap(make_opt(model, "adamw_fused"), model=model, precision="bf16")
    set_path(opt, "device_lagged")
    fail = {2}

    def factor(k: int) -> float:
        if k in fail:
            fail.discard(k)
            raise RuntimeError("the schedule's own bug")
        return 0.5**k

    sched = opt.schedule(torch.optim.lr_scheduler.LambdaLR(opt, factor))
    base = opt.param_groups[0]["lr"]
    (x, y), = make_data(1)
    opt.backward(loss_of(model, x, y))
    opt.step()
    opt.zero_grad()
    before = (sched.last_epoch, opt.param_groups[0]["lr"], list(sched.scheduler._last_lr))
    assert before == (1, base * 0.5, [base * 0.5])
    opt.backward(loss_of(model, x, y))
    with pytest.raises(RuntimeError, match="the schedule's own bug"):
        opt.step()
    assert (sched.last_epoch, opt.param_groups[0]["lr"], list(sched.scheduler._last_lr)) == before
    opt.zero_grad()
    opt.backward(loss_of(model, x, y))
    opt.step()  # its fixed point steps the scheduler for step 1 (taken), then the advance ahead for this one
    opt.flush()
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == base * 0.5**3
    opt.close()
