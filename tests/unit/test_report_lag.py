"""The report lag of the sync-free path (fused optimizer on CUDA; emulated here on CPU with
``_lagged_reports``): ``step()`` never waits on the previous step's report copy. Step S's report is
decoded at step S+2's ``step()`` (the host may run two steps ahead of the device), or at S+1's
where the next update needs it (a registered scheduler, the ladder); readers decode on demand.

Healthy reports then wait for their batch (``ampguard.reporter.REPORT_BATCH``): decoded, logged and exported
up to 16 at a time, while a report that asks for something (here a real fp16 overflow) is decoded at its own
fixed point with every report before it. The lag tests turn the batches off (``AMPGUARD_REPORT_BATCH=0``)."""

from __future__ import annotations

import math

import pytest
import torch

import ampguard
from ampguard.reporter import REPORT_BATCH


class _Seen:
    """An exporter that writes down, at each export, the step the guard is at and the report's step."""

    def __init__(self) -> None:
        self.at: list[tuple[int, int]] = []
        self.opt: ampguard.GuardedOptimizer | None = None

    def open(self, info) -> None:
        pass

    def export(self, report, anomalies) -> None:
        assert self.opt is not None
        self.at.append((self.opt.step_count, report.step))

    def close(self) -> None:
        pass


def _run(steps: int, *, schedule: bool = False, config: dict | None = None, lagged: bool = True,
         overflow_at: int | None = None, seen: _Seen | None = None) -> list[list[int]]:
    """The steps whose reports are still pending after each step() call. ``overflow_at``: that step's batch is
    x 6e4, which overflows the fp16 autocast's first linear layer (a non-finite loss: skipped)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu"), config=config, exporters=[seen] if seen else ())
    if seen is not None:
        seen.opt = opt
    if lagged:  # the fused CUDA path's tensor decision, its lag
        opt._pipeline.host_decision, opt._lagged_reports = False, True
    if schedule:
        opt.schedule(torch.optim.lr_scheduler.StepLR(opt, step_size=2))
    pending = []
    for step in range(steps):
        x = torch.randn(4, 8) * (6e4 if step == overflow_at else 1.0)
        with opt.autocast():
            loss = model(x).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        pending.append([p.step for p in opt._reporter._pending])
    opt.close()
    return pending


@pytest.fixture
def per_step(monkeypatch):
    """Each report decoded at its own fixed point (no batches)."""
    monkeypatch.setenv("AMPGUARD_REPORT_BATCH", "0")


@pytest.mark.usefixtures("per_step")
def test_step_waits_on_no_previous_report():
    # after step S's step(): S's own copy and S-1's are in flight; S-2's was decoded at S's step()
    assert _run(5) == [[0], [0, 1], [1, 2], [2, 3], [3, 4]]


@pytest.mark.parametrize("why", ["schedule", "ladder"])
def test_a_scheduler_or_the_ladder_reads_the_previous_step_first(why, monkeypatch):
    # the ladder acts on every decoded report, so none waits for a batch; a scheduler needs only each step's skip
    # flag, so with batches its healthy reports wait (next test): here each is decoded at its fixed point
    if why == "schedule":
        monkeypatch.setenv("AMPGUARD_REPORT_BATCH", "0")
    # the next update's LR (held on a skipped step), the snapshot the ladder names: one step late
    config = {"escalation": ampguard.Escalation(snapshot_every=2)} if why == "ladder" else None
    assert _run(4, schedule=why == "schedule", config=config) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("lagged", [True, False], ids=["sync-free", "host"])
def test_healthy_reports_are_exported_in_batches_and_all_by_close(lagged):
    seen = _Seen()
    pending = _run(40, lagged=lagged, seen=seen)
    assert [step for _, step in seen.at] == list(range(40))  # each once, in order, the last ones by close()
    assert max(map(len, pending)) <= REPORT_BATCH + 1  # never more than a batch (and the lag's copies) behind
    exported_at = [at for at, _ in seen.at[:32]]
    assert len(set(exported_at)) <= 4  # 32 healthy reports in a few batches, not 32 fixed points
    assert all(at - step <= REPORT_BATCH + 2 for at, step in seen.at)


@pytest.mark.parametrize("lagged", [True, False], ids=["sync-free", "host"])
def test_a_report_that_asks_for_something_is_decoded_at_its_own_fixed_point(lagged):
    # a real overflow at step 7, in the middle of a batch: its report, and the six healthy ones before it, leave
    # when the lag allows (step 9's step() on the sync-free path, step 7's own on the host path)
    seen = _Seen()
    _run(12, lagged=lagged, overflow_at=7, seen=seen)
    at = dict((step, when) for when, step in seen.at)
    assert at[7] == (9 if lagged else 8)  # step_count at export: after step 8's update, or step 7's own
    assert all(at[s] == at[7] for s in range(7))  # those before it go with it, in order
    assert [step for _, step in seen.at] == list(range(12))


def test_a_reader_decodes_what_waits_for_its_batch():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model, precision="bf16")
    for _ in range(5):
        with opt.autocast():
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    assert len(opt._reporter._pending) == 5  # waiting for their batch
    assert [r.step for r in opt.history] == [0, 1, 2, 3, 4] and math.isfinite(opt.last_report.grad_norm)
    opt.close()


@pytest.mark.parametrize("lagged", [True, False], ids=["sync-free", "host"])
def test_step_was_skipped_reads_the_flag_and_decodes_nothing(lagged):
    # accelerate's optimizer_step_was_skipped reads it after every step: the answer is the step's report's, a real
    # overflow included, and the healthy reports behind it still wait for their batch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu"))
    if lagged:
        opt._pipeline.host_decision, opt._lagged_reports = False, True
    answers, waiting = [], []
    for step in range(10):
        with opt.autocast():
            loss = model(torch.randn(4, 8) * (6e4 if step in (3, 8) else 1.0)).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        answers.append(opt.step_was_skipped)
        waiting.append(len(opt._reporter._pending))
        opt.zero_grad()
    assert answers == [r.skipped for r in opt.history]
    assert answers[3] and answers[8] and not any(answers[:3])
    assert waiting[2] >= 3  # read after steps 0-2: nothing decoded (step 3's overflow then decodes them with it)
    opt.close()


def test_a_scheduler_steps_for_the_healthy_steps_that_wait_for_their_batch():
    # the LR each update reads is the one a per-step decode gives (tests/unit/test_schedule.py: the eager loop's,
    # across real overflows), while the healthy reports wait
    def lrs(batch: str) -> tuple[list[float], int]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AMPGUARD_REPORT_BATCH", batch)
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
            opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model,
                                precision="fp16", scaler=torch.amp.GradScaler("cpu"))
        opt._pipeline.host_decision, opt._lagged_reports = False, True
        opt.schedule(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
        seen, waiting = [], 0
        for step in range(12):
            with opt.autocast():
                loss = model(torch.randn(4, 8) * (6e4 if step == 5 else 1.0)).float().pow(2).mean()
            opt.backward(loss)
            opt.step()
            seen.append(opt.optimizer.param_groups[0]["lr"])
            waiting = max(waiting, len(opt._reporter._pending))
            opt.zero_grad()
        opt.close()
        return seen, waiting

    batched, waited = lrs("1")
    per_step, _ = lrs("0")
    assert batched == per_step and waited > 2
