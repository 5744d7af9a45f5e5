"""ampguard inside a real Hugging Face ``Accelerator`` (CPU, tiny models; nothing mocked).

fp16 through accelerate's own GradScaler code path, on CPU: ``Accelerator.__init__`` builds a
GradScaler and fp16 autocast only off CPU. On CUDA it sets ``native_amp = True`` and
``scaler = get_grad_scaler(...)`` (a ``torch.amp.GradScaler`` for the device), and
``prepare_model`` then wraps ``forward`` in ``torch.autocast(device, float16)``
(``get_mixed_precision_context_manager`` reads ``native_amp`` and ``state.mixed_precision``).
:func:`_accelerator` does the same on CPU: ``Accelerator(mixed_precision="fp16", cpu=True)``,
then ``native_amp = True`` and ``scaler = torch.amp.GradScaler("cpu", ...)`` before
``prepare``. accelerate's own ``backward`` (``scaler.scale(loss).backward()``),
``unscale_gradients`` (``scaler.unscale_``), ``AcceleratedOptimizer`` (built with that scaler)
and ``save_state``/``load_state`` (``scaler.pt``) then run as they do on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState

import ampguard
from ampguard import faults
from ampguard.integrations._versions import IntegrationVersionError
from ampguard.integrations.accelerate import GuardedAcceleratedOptimizer

from ..unit._models import assert_same, hook_count, loss_of, make_data, make_model, snapshot

pytestmark = pytest.mark.frameworks

ORDER = "ampguard.wrap(accelerator.prepare(optimizer), accelerator=accelerator, model=model)"


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each test builds its own Accelerator (accelerate's state is per process)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerator(precision: str, grad_accum: int = 1) -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(mixed_precision=precision, cpu=True, gradient_accumulation_steps=grad_accum)
    if precision == "fp16":  # what Accelerator.__init__ does for fp16 on CUDA (see the module docstring)
        acc.native_amp = True
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    return acc


def _prepared(precision: str, *, grad_accum: int = 1, seed: int = 0, kind: str = "adamw"):
    """A fresh Accelerator with a tiny model, optimizer and LR scheduler prepared (not guarded)."""
    acc = _accelerator(precision, grad_accum)
    model = make_model(seed)
    inner = (torch.optim.AdamW(model.parameters(), lr=1e-2, fused=kind == "adamw_fused") if kind.startswith("adamw")
             else torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda k: 0.9**k)
    model, opt, sched = acc.prepare(model, inner, sched)
    return acc, model, opt, sched


def _train(acc, model, opt, sched, batches, *, clip: float | None = None):
    """accelerate's standard loop. Per optimizer step: (skipped per accelerate, LR after it,
    micro-batch losses, clip_grad_norm_'s returned norm)."""
    steps, losses = [], []
    for x, y in batches:
        with acc.accumulate(model):
            loss = loss_of(model, x, y)
            losses.append(None if math.isnan(loss.item()) else loss.item())  # comparable
            acc.backward(loss)
            norm = None
            if clip is not None and acc.sync_gradients:
                norm = float(acc.clip_grad_norm_(model.parameters(), clip))
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            steps.append((acc.optimizer_step_was_skipped, sched.get_last_lr()[0], losses, norm))
            losses = []
    return steps


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_nan_steps_are_skipped_and_the_scheduler_holds_the_lr(precision):
    acc, model, opt, sched = _prepared(precision)
    opt = ampguard.wrap(opt, accelerator=acc, model=model)
    assert isinstance(opt, GuardedAcceleratedOptimizer) and acc._optimizers == [opt]
    injection = faults.inject(opt, model, faults.output("0", "nan", steps=[2, 4]))
    steps = _train(acc, model, opt, sched, make_data(6))

    decided = [r.step for r in opt.history if r.skipped]
    assert decided == [2, 4] == sorted({s for s, _, _ in injection.fired})
    assert [s for s, (skipped, *_) in enumerate(steps) if skipped] == decided
    taken = 0
    for s, (_, lr, _, _) in enumerate(steps):
        taken += s not in decided
        assert lr == pytest.approx(1e-2 * 0.9**taken, rel=1e-12), f"step {s}"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.skipped_steps == 2 and opt.step_count == 6 and opt.guard.step_count == 6
    if precision == "fp16":  # the guard set the shared scaler's scale: halved on each skip
        assert opt.guard.scaler is acc.scaler is opt.scaler
        for r in opt.history:
            assert r.next_loss_scale == (r.loss_scale / 2 if r.skipped else r.next_loss_scale)
        assert acc.scaler.get_scale() == opt.get_scale() == opt.last_report.next_loss_scale
    # the guard's readers on the returned object; close hands accelerate's methods back
    assert opt.last_report.step == 5 and len(opt.anomalies) >= 2
    opt.flush()
    with pytest.raises(AttributeError, match=r"accelerator\.backward"):
        opt.backward  # noqa: B018
    opt.close()
    assert "backward" not in acc.__dict__ and "unscale_gradients" not in acc.__dict__
    assert acc.scaler is None or "step" not in acc.scaler.__dict__


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_accumulation_and_clipping_match_accelerates_own_loop(precision):
    batches = make_data(8)
    acc, model, opt, sched = _prepared(precision, grad_accum=2)
    plain = _train(acc, model, opt, sched, batches, clip=0.5)
    expected = snapshot(model, opt)
    expected_scale = acc.scaler.get_scale() if acc.scaler is not None else None

    acc, model, opt, sched = _prepared(precision, grad_accum=2)
    opt = ampguard.wrap(opt, accelerator=acc, model=model)
    guarded = _train(acc, model, opt, sched, batches, clip=0.5)
    assert_same(snapshot(model, opt), expected)  # bitwise
    if expected_scale is not None:
        assert acc.scaler.get_scale() == expected_scale
    assert [(s, lr) for s, lr, _, _ in guarded] == [(s, lr) for s, lr, _, _ in plain]

    assert opt.step_count == 4  # one per accumulation boundary, not per micro-batch
    for report, (_, _, micro, norm) in zip(opt.history, guarded):
        # the loss of the optimizer step: accelerate back-propagates loss / 2 per micro-batch
        assert report.loss == pytest.approx(sum(micro) / 2, rel=1e-6)  # (healthy steps: no None)
        # measured before accelerator.clip_grad_norm_ clipped: the norm it returned, not 0.5
        assert report.grad_norm == pytest.approx(norm, rel=1e-5)
    assert max(r.grad_norm for r in opt.history) > 0.5


def test_fp16_prepare_then_wrap_updates_by_exactly_the_unguarded_amount():
    """Regression: the shared scaler once unscaled the gradients twice (update = 1/scale)."""
    batches = make_data(3)
    acc, model, opt, sched = _prepared("fp16", kind="sgd")
    start = snapshot(model, opt)
    _train(acc, model, opt, sched, batches)
    expected = snapshot(model, opt)

    acc, model, opt, sched = _prepared("fp16", kind="sgd")
    opt = ampguard.wrap(opt, accelerator=acc, model=model)
    _train(acc, model, opt, sched, batches)
    got = snapshot(model, opt)
    assert_same(got, expected)
    moved = sum((got[k] - start[k]).abs().sum() for k in start)
    assert moved > 1e-3 and opt.get_scale() >= 256.0  # a real update, at a real loss scale


def _sync_free(opt) -> None:
    """The fused CUDA path on the CPU: the tensor decision, reports decoded late (tests/unit/test_schedule.py)."""
    opt.guard._pipeline.host_decision, opt.guard._lagged_reports = False, True


@pytest.mark.parametrize("path", ["host", "sync_free"])
def test_save_state_load_state_resumes_bit_for_bit(tmp_path, path):
    """On the sync-free path the guard steps the prepared scheduler at its fixed points: ``save_state`` applies the
    advance still pending (the scheduler's ``state_dict``), and the resumed run's LR goes on exactly."""
    batches = make_data(6)
    fault = faults.output("0", "nan", steps=[1, 4])
    kind = "adamw_fused" if path == "sync_free" else "adamw"
    acc, model, opt, sched = _prepared("fp16", kind=kind)
    opt = ampguard.wrap(opt, accelerator=acc, model=model)
    if path == "sync_free":
        _sync_free(opt)
    faults.inject(opt, model, fault)
    _train(acc, model, opt, sched, batches[:3])
    acc.save_state(str(tmp_path / "ckpt"))
    rest = _train(acc, model, opt, sched, batches[3:])
    expected = (snapshot(model, opt), opt.get_scale(), opt.step_count, opt.skipped_steps,
                [opt.history[s].skipped for s in (3, 4, 5)], rest)

    acc, model, opt, sched = _prepared("fp16", seed=7, kind=kind)  # other weights: the checkpoint brings them back
    opt = ampguard.wrap(opt, accelerator=acc, model=model)
    if path == "sync_free":
        _sync_free(opt)
    faults.inject(opt, model, fault)
    acc.load_state(str(tmp_path / "ckpt"))
    assert (opt.step_count, opt.skipped_steps) == (3, 1)
    rest = _train(acc, model, opt, sched, batches[3:])
    got = (snapshot(model, opt), opt.get_scale(), opt.step_count, opt.skipped_steps,
           [opt.history[s].skipped for s in (3, 4, 5)], rest)
    assert_same(got[0], expected[0])
    assert got[1:] == expected[1:]
    assert got[3] == 2 and got[4] == [False, True, False]


def test_a_scheduler_prepared_after_wrap_holds_the_lr_too():
    acc = _accelerator("bf16")
    model = make_model(0)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt = ampguard.wrap(opt, accelerator=acc, model=model)
    sched = acc.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9**k))
    faults.inject(opt, model, faults.output("0", "nan", steps=[1]))
    steps = _train(acc, model, opt, sched, make_data(3))
    assert [skipped for skipped, *_ in steps] == [False, True, False]
    assert [lr for _, lr, _, _ in steps] == pytest.approx([1e-2 * 0.9, 1e-2 * 0.9, 1e-2 * 0.9**2], rel=1e-12)
    assert acc.prepare(opt) is opt and acc._optimizers == [opt]  # prepare() hands the guarded one back as it is


def test_two_guards_on_one_accelerator_each_take_their_place_and_the_last_close_hands_backward_back():
    acc = _accelerator("bf16")
    model = make_model(0)
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    model, opt1, opt2 = acc.prepare(model, torch.optim.AdamW(first, lr=1e-2), torch.optim.SGD(second, lr=0.1))
    opt1 = ampguard.wrap(opt1, accelerator=acc, model=model)
    opt2 = ampguard.wrap(opt2, accelerator=acc, model=model)
    assert acc._optimizers == [opt1, opt2]
    x, y = make_data(1)[0]
    loss = loss_of(model, x, y)
    acc.backward(loss)
    opt1.step()
    opt2.step()
    assert opt1.last_report.loss == opt2.last_report.loss == pytest.approx(loss.item())  # both saw the backward
    opt1.close()
    assert "backward" in acc.__dict__  # opt2 still observes it
    opt2.close()
    assert "backward" not in acc.__dict__ and "unscale_gradients" not in acc.__dict__


def test_find_executable_batch_size_leaves_no_guard_of_a_failed_try_alive():
    """accelerate's documented retry on out-of-memory (``find_executable_batch_size``: ``accelerator.free_memory()``,
    then model, optimizer and scheduler built, prepared and guarded again each try). The tries that ran out of memory
    (a genuine allocation failure, ``DefaultCPUAllocator: can't allocate memory``, on their second step) must leave
    nothing behind. Before stop 51 the Accelerator's patched methods held every guard: each failed try's guard, its
    model (the memory the retry is meant to free) and its sentinel's hooks lived on, it observed every later loss, and
    the last ``close()`` left ``accelerator.backward`` patched."""
    import gc
    import weakref

    from accelerate.utils import find_executable_batch_size

    acc = _accelerator("bf16")
    tries: list[tuple[int, weakref.ref, weakref.ref]] = []

    @find_executable_batch_size(starting_batch_size=16)
    def inner(batch_size: int):
        acc.free_memory()
        model = make_model(0)
        inner_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(inner_opt, lambda k: 0.9**k)
        model, opt, sched = acc.prepare(model, inner_opt, sched)
        opt = ampguard.wrap(opt, accelerator=acc, model=model, config={"sentinel": "top"})
        tries.append((batch_size, weakref.ref(opt.guard), weakref.ref(model)))
        for step in range(3):
            rows = batch_size << 50 if step == 1 and batch_size > 12 else batch_size  # too big for any memory
            x = torch.randn(rows, 8)
            loss = loss_of(model, x, torch.zeros(batch_size, 1))
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        return opt, model, loss

    opt, model, loss = inner()
    gc.collect()
    assert [size for size, _, _ in tries] == [16, 14, 12]
    assert all(guard() is None for _, guard, _ in tries[:2])  # the failed tries' guards: gone
    # and the first failed try's model with its guard (the last one's frames stay in the last allocation error's
    # traceback, which CPython keeps until another exception replaces it: not ampguard's reference)
    assert tries[0][2]() is None
    assert acc._ampguard_hooks.open_guards() == [opt.guard]
    assert hook_count(model) == 5  # the live guard's sentinel only (the root's input and output, three blocks' outputs)
    assert opt.step_count == 3 and opt.last_report.loss == pytest.approx(loss.item())
    opt.close()
    assert "backward" not in acc.__dict__ and not hasattr(acc, "_ampguard_hooks")


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("prepared", ["with_the_optimizer", "after_wrap"])
def test_on_the_sync_free_path_the_guard_steps_the_prepared_scheduler_and_nothing_reads_the_skip(
        grad_accum, prepared, monkeypatch):
    """Issue 26. accelerate's ``AcceleratedScheduler.step()`` reads ``step_was_skipped`` every step. On the sync-free
    path (a fused optimizer on CUDA; emulated here: the tensor decision, reports decoded late) that read waits for
    the whole optimizer step, where the plain accelerate loop waits for nothing: one H100 run measured the guarded
    loop 1.14x the plain one. The guard now steps the prepared scheduler itself, once per taken step, before the
    next update: the LR every update sees is accelerate's rule (held on skipped steps) exactly, across real fp16
    overflows (loss scale 2**22) and an injected NaN, and nothing in the loop's calls reads the skip. Between
    steps the guard has advanced the scheduler as if the last step was taken: ``param_groups`` show accelerate's
    next LR after every taken step (one advance too many after a skipped one, undone before the next update), and
    ``get_last_lr()`` is accelerate's after every step (it reads the last step's skip flag: the one read)."""
    acc = _accelerator("fp16", grad_accum)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22, growth_interval=100)
    model = make_model(0)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if prepared == "with_the_optimizer":
        model, opt, sched = acc.prepare(model, inner, torch.optim.lr_scheduler.LambdaLR(inner, lambda k: 0.9**k))
        opt = ampguard.wrap(opt, accelerator=acc, model=model)
    else:
        model, opt = acc.prepare(model, inner)
        opt = ampguard.wrap(opt, accelerator=acc, model=model)
        sched = acc.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9**k))
    _sync_free(opt)
    faults.inject(opt, model, faults.output("0", "nan", steps=[6]))
    seen: list[float] = []  # the LR each update reads (skipped steps too: the fused kernel skips on device)
    inner.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    reads = {"n": 0}
    last_skipped = ampguard.reporter.Reporter.last_skipped

    def counted(self):
        reads["n"] += 1
        return last_skipped(self)

    monkeypatch.setattr(ampguard.reporter.Reporter, "last_skipped", counted)
    after_step, groups = [], []
    for x, y in make_data(10 * grad_accum):
        with acc.accumulate(model):
            acc.backward(loss_of(model, x, y))
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients and len(after_step) < 9:  # not after the last step: state_dict() reads first
            groups.append(opt.param_groups[0]["lr"])
            before = reads["n"]
            after_step.append(sched.get_last_lr()[0])
            reads["n"] = before  # get_last_lr() reads the skip (its value depends on it); the loop's calls do not
    assert reads["n"] == 0  # before: one read of the skip a step, from the scheduler
    skipped = [r.skipped for r in opt.history]
    assert len(skipped) == len(seen) == 10 and 6 in [s for s, k in enumerate(skipped) if k] and not skipped[9]
    assert 2 <= sum(skipped) <= 8  # real overflows at 2**22, and the NaN; and steps taken
    for s in range(10):
        assert seen[s] == 1e-2 * 0.9 ** sum(not k for k in skipped[:s]), f"step {s}: {seen}"
    for s in range(9):
        assert after_step[s] == 1e-2 * 0.9 ** sum(not k for k in skipped[:s + 1]), f"step {s}"
        ahead = 1e-2 * 0.9 ** (sum(not k for k in skipped[:s]) + 1)  # as if step s was taken
        assert groups[s] == (after_step[s] if not skipped[s] else ahead), f"step {s}: {groups}"
    assert sched.state_dict()["last_epoch"] == 10 - sum(skipped)  # the last step's advance applied first
    with pytest.raises(TypeError, match=r"Call scheduler.step\(\) with no arguments"):
        sched.step(3)
    assert sched.get_last_lr()[0] == 1e-2 * 0.9 ** (10 - sum(skipped))
    opt.close()  # accelerate's own methods back
    assert not any(n in sched.__dict__ for n in ("step", "get_last_lr", "state_dict"))
    assert "prepare_scheduler" not in acc.__dict__


@pytest.mark.parametrize("case", ["not_with_the_optimizer", "plateau", "two_optimizers"])
def test_a_scheduler_the_guard_cannot_step_stays_accelerates(case):
    """Where the guard cannot step an AcceleratedScheduler as accelerate would (it does not step with the optimizer,
    it steps on a metric, it holds another optimizer too), it is left as accelerate made it: no instance attribute,
    and its step() is accelerate's (which reads step_was_skipped where it checks it)."""
    acc = _accelerator("bf16")
    if case == "not_with_the_optimizer":
        acc.step_scheduler_with_optimizer = False
    model = make_model(0)
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    inner = torch.optim.AdamW(model.parameters() if case != "two_optimizers" else first, lr=1e-2)
    sched = (torch.optim.lr_scheduler.ReduceLROnPlateau(inner) if case == "plateau"
             else torch.optim.lr_scheduler.LambdaLR(inner, lambda k: 0.9**k))
    objs = [model, inner, sched] + ([torch.optim.SGD(second, lr=0.1)] if case == "two_optimizers" else [])
    prepared = acc.prepare(*objs)
    model, opt, sched = prepared[0], prepared[1], prepared[2]
    if case == "two_optimizers":  # one AcceleratedScheduler holding both optimizers, as accelerate builds it when
        sched.optimizers = [opt, prepared[3]]  # it finds none of its own (the full list)
    opt = ampguard.wrap(opt, accelerator=acc, model=model)
    assert not any(n in sched.__dict__ for n in ("step", "get_last_lr", "state_dict"))
    assert opt.guard._outcome.schedules.schedulers == []
    x, y = make_data(1)[0]
    acc.backward(loss_of(model, x, y))
    opt.step()
    sched.step(1.0) if case == "plateau" else sched.step()
    if case != "plateau":
        assert sched.get_last_lr()[0] == pytest.approx(1e-2 * 0.9)  # accelerate's own step ran
    opt.close()


@pytest.mark.parametrize(("accelerator_precision", "guard_kwargs"), [
    ("fp16", {"scaler": "accelerator's"}),  # even the right scaler and precision: guard after prepare
    ("bf16", {"precision": "bf16"}),
    ("fp16", {"scaler": "own"}),  # another GradScaler: backward scales with accelerate's
    ("fp16", {}),  # the guard picks bf16 on CPU, the accelerator runs fp16 with a scaler
    ("bf16", {"scaler": "own"}),
    ("no", {}),  # the guard picks bf16, the accelerator runs fp32
])
def test_wrap_before_prepare_is_refused_at_prepare_naming_the_order(accelerator_precision, guard_kwargs):
    acc = _accelerator(accelerator_precision)
    model = make_model(0)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if "scaler" in guard_kwargs:
        guard_kwargs = {"scaler": acc.scaler if guard_kwargs["scaler"] != "own" else torch.amp.GradScaler("cpu")}
    guard = ampguard.wrap(inner, model=model, **guard_kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda k: 0.9**k)
    before = snapshot(model, inner)
    with pytest.raises(ampguard.GuardStateError, match=r"Prepare first, then guard") as err:
        acc.prepare(guard, sched)
    assert ORDER in str(err.value)
    assert acc._optimizers == [] and acc._schedulers == [] and "backward" not in acc.__dict__
    assert_same(snapshot(model, inner), before)


@pytest.mark.parametrize("case", ["twice", "inner_guarded", "no_accelerator", "other_accelerator", "not_prepared",
                                  "not_an_accelerator", "other_scaler", "other_precision", "accelerate_version"])
def test_bad_input_is_refused_before_anything_changes(case, monkeypatch):
    acc, model, opt, _ = _prepared("fp16")
    kwargs: dict = {"model": model, "accelerator": acc}
    error: type[Exception] = ValueError
    if case == "twice":
        opt = ampguard.wrap(opt, **kwargs)
        error, match = ampguard.GuardStateError, "already guarded: ampguard.wrap"
    elif case == "inner_guarded":  # an AcceleratedOptimizer built by hand around a guard
        opt = AcceleratedOptimizer(ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), scaler=acc.scaler),
                                   scaler=acc.scaler)
        error, match = ampguard.GuardStateError, "inside this AcceleratedOptimizer is already guarded"
        del kwargs["accelerator"]
    elif case == "no_accelerator":
        del kwargs["accelerator"]
        error, match = TypeError, r"needs the Accelerator too"
    elif case == "other_accelerator":
        kwargs["accelerator"] = _accelerator("fp16")
        match = "not prepared by that Accelerator"
    elif case == "not_prepared":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        error, match = TypeError, r"prepare first, then guard"
    elif case == "not_an_accelerator":
        kwargs["accelerator"] = acc.state
        error, match = TypeError, "expects an accelerate.Accelerator"
    elif case == "other_scaler":
        kwargs["scaler"] = torch.amp.GradScaler("cpu")
        match = "not the accelerator's GradScaler"
    elif case == "other_precision":
        kwargs["precision"] = "bf16"
        match = "mixed_precision='fp16' with a GradScaler"
    else:
        import accelerate

        monkeypatch.setattr(accelerate, "__version__", "1.14.0")
        error, match = IntegrationVersionError, r"accelerate >=1.15,<1.17"
    cls, inner, listed, patched = type(opt), getattr(opt, "optimizer", None), list(acc._optimizers), dict(acc.__dict__)
    with pytest.raises(error, match=match):
        ampguard.wrap(opt, **kwargs)
    assert type(opt) is cls and getattr(opt, "optimizer", None) is inner
    assert acc._optimizers == listed and dict(acc.__dict__) == patched
    if case not in ("twice", "inner_guarded"):
        assert acc.scaler is None or "step" not in acc.scaler.__dict__


def test_clipping_on_a_micro_step_that_does_not_step_is_refused():
    acc, model, opt, _ = _prepared("fp16", grad_accum=2)
    opt = ampguard.wrap(opt, accelerator=acc, model=model)
    x, y = make_data(1)[0]
    with acc.accumulate(model):
        acc.backward(loss_of(model, x, y))
        assert not acc.sync_gradients
        grads = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(ampguard.GuardStateError, match=r"if accelerator\.sync_gradients"):
            acc.clip_grad_norm_(model.parameters(), 1.0)
    for g, p in zip(grads, model.parameters()):
        assert torch.equal(g, p.grad)  # still scaled, as they were


def test_a_hand_built_accelerated_optimizer_without_an_accelerator_takes_the_loss_by_hand():
    _accelerator("bf16")
    model = make_model(0)
    opt = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))  # built by hand, not prepared
    with pytest.warns(RuntimeWarning, match="no accelerator= given"):
        opt = ampguard.wrap(opt, model=model)
    x, y = make_data(1)[0]
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    assert opt.last_report.loss is None and not opt.step_was_skipped  # no loss given: unknown, not NaN
    opt.zero_grad()
    loss = loss_of(model, x, y)
    loss.backward()
    opt.observe_loss(loss, reduction="sum")
    opt.step()
    assert opt.last_report.loss == pytest.approx(loss.item())


# ------------------------------------------------------------------------------ the example
def test_example_runs() -> None:
    """examples/accelerate_train.py, run as a user runs it: exit 0 means the faulty step (and only
    it) was skipped and the loss went down; the last line says so."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "examples" / "accelerate_train.py"), "--epochs", "1"],
                          cwd=root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "skipped [5] (fault at [5])" in proc.stdout
