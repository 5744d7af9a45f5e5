"""The guard speaks through the ``ampguard`` logger, and close()/summary() give the run's summary: the
same table ``ampguard report`` prints from the run's event log."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

import ampguard
from ampguard.runlog import RunSummary, format_summary, load_run, summary

from ._models import guarded_steps, make_data, make_model, make_opt


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ampguard"]


def _train(opt, model, batches, n, *, bad=lambda step: False, overflow=False):
    """``n`` steps over ``batches``; a bad batch where ``bad(step)``: an fp16 activation overflow
    (an inf loss, ``overflow=True``) or a missing value (a NaN feature: a NaN loss)."""
    data = [batches[step % len(batches)] for step in range(n)]
    data = [(x * 1e6 if overflow else x.clone().index_fill_(1, torch.tensor([2]), math.nan), y) if bad(step)
            else (x, y) for step, (x, y) in enumerate(data)]
    guarded_steps(opt, model, data)


def test_a_healthy_run_logs_nothing_but_the_summary_and_close_returns_it(caplog):
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16")
    log = logging.getLogger("ampguard")  # a library's logger: the user's configuration decides
    assert log.handlers == [] and log.level == logging.NOTSET and log.propagate
    caplog.set_level(logging.DEBUG, logger="ampguard")
    _train(opt, model, make_data(4), 12)
    assert _records(caplog) == []  # nothing formatted or said on healthy steps
    result = opt.close()
    assert isinstance(result, RunSummary) and result.steps == 12 and result.skipped == 0 and result.closed
    (said,) = _records(caplog)
    assert said.levelno == logging.INFO and "run summary" in said.getMessage()
    assert format_summary(result) in said.getMessage()
    assert opt.close() is result  # idempotent, the same summary
    assert opt.summary() is result


def test_summary_is_the_table_ampguard_report_prints_from_the_event_log(tmp_path):
    # fp16 with a tiny growth interval: the scale grows, overflows genuinely on bad batches, backs off
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    log = tmp_path / "events.jsonl"
    opt = ampguard.wrap(make_opt(model), model=model, scaler=scaler,
                        exporters=[ampguard.JsonlExporter(log, every_step=True)])
    _train(opt, model, make_data(6), 40, bad=lambda s: s in (7, 8, 21))
    live = opt.summary()  # while running: not closed yet
    assert not live.closed and live.steps == 40
    closed = opt.close()
    from_log = summary(load_run(log))
    assert closed.skipped_by_reason["nonfinite_loss"] == 3 and closed.skipped == from_log.skipped
    assert closed.skipped_by_reason == from_log.skipped_by_reason
    assert closed.anomalies_by_kind == from_log.anomalies_by_kind and closed.anomalies_by_kind
    assert closed.ranks[0].scale_min == from_log.ranks[0].scale_min < closed.ranks[0].scale_max
    assert closed.ranks[0].scale_max == from_log.ranks[0].scale_max
    assert closed.ranks[0].nonfinite_loss_steps == 3

    def table(s):
        return [line for line in format_summary(s).splitlines() if not line.startswith("  log: ")]

    assert table(closed) == table(from_log)  # the same table, line for line


def test_each_anomaly_is_said_with_step_rank_and_what_to_do_then_rate_limited(caplog):
    from ampguard.logs import REPEAT_EVERY

    caplog.set_level(logging.INFO, logger="ampguard")
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16", config={"max_consecutive_skips": None})
    bad = {3, 5, 40, 110, 150}
    _train(opt, model, make_data(4), 160, bad=lambda s: s in bad)
    said = [r for r in _records(caplog) if "nonfinite_loss" in r.getMessage()]
    # the first of a kind at once; the same kind again only REPEAT_EVERY steps later, with a count
    assert [r.ampguard_step for r in said] == [3, 110]  # type: ignore[attr-defined]
    assert REPEAT_EVERY == 100
    assert said[0].getMessage().startswith("step 3, rank 0: nonfinite_loss: loss was nan")
    assert "What to do: the loss itself was NaN/inf" in said[0].getMessage()
    assert "[2 more like it since step 3 not shown]" in said[1].getMessage()
    assert all(r.levelno == logging.WARNING and r.ampguard_rank == 0 for r in said)  # type: ignore[attr-defined]


def test_the_scale_reaching_its_floor_is_an_error(caplog):
    caplog.set_level(logging.INFO, logger="ampguard")
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    opt = ampguard.wrap(make_opt(model), model=model, scaler=scaler, config={"min_scale": 2.0})
    _train(opt, model, make_data(4), 6, bad=lambda s: s in (1, 2, 3), overflow=True)
    floor = [r for r in _records(caplog) if "scale_floor" in r.getMessage()]
    assert len(floor) == 1 and floor[0].levelno == logging.ERROR
    assert "precision='bf16'" in floor[0].getMessage()


def test_a_skip_rate_over_the_threshold_is_said_once_per_window(caplog):
    from ampguard.logs import SKIP_WINDOW

    caplog.set_level(logging.INFO, logger="ampguard")
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16")
    # every other batch is bad (intermittent trouble, never two skips in a row)
    _train(opt, model, make_data(4), 2 * SKIP_WINDOW + 20, bad=lambda s: s % 2 == 1)
    rate = [r for r in _records(caplog) if "of the last" in r.getMessage()]
    assert [r.ampguard_step for r in rate] == [SKIP_WINDOW - 1, 2 * SKIP_WINDOW - 1]  # type: ignore[attr-defined]
    assert rate[0].levelno == logging.WARNING
    assert "50 of the last 100 steps were skipped (over 25%; nonfinite_loss 50)" in rate[0].getMessage()


def test_forensics_findings_are_said_once(caplog):
    caplog.set_level(logging.INFO, logger="ampguard")

    class Log(torch.nn.Module):
        def forward(self, x):
            return torch.log(x)  # NaN for a negative input, in any precision

    torch.manual_seed(0)
    model = torch.nn.Sequential(Log(), torch.nn.Linear(8, 1))
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-3), model=model, precision="bf16")
    g = torch.Generator().manual_seed(0)
    for step in range(8):
        x = torch.randn(4, 8, generator=g)
        with opt.autocast():  # steps 2, 4, 6: a genuine log of negative numbers
            loss = model(x if step in (2, 4, 6) else x.abs() + 1.0).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    found = [r.getMessage() for r in _records(caplog) if r.getMessage().startswith("step 4, rank 0: forensics")]
    assert found == ["step 4, rank 0: forensics found where the first non-finite value arose: module 0, phase "
                     "forward, cause nan (first seen on this step; opt.anomalies has every step it explains). What to "
                     "do: module 0's forward is non-finite in fp32 too: its own math (a log of 0, a division by 0, a "
                     "square root of a negative) or its input; check that module and this batch"]
    assert len([r for r in _records(caplog) if "forensics found" in r.getMessage()]) == 1  # not again at 6
    assert math.isnan(opt.history[4].loss)


def test_a_long_run_of_skipped_steps_keeps_the_voice_flat_and_its_counts_exact():
    """The voice keeps counts, the first report and the last KEEP notable reports and anomalies:
    1000 more skipped steps add (next to) nothing to its memory (before: ~750 B per step), and the
    summary still counts every one of them."""
    import gc
    import tracemalloc

    from ampguard.logs import KEEP

    from ._models import loss_of

    model = make_model()
    config = ampguard.GuardConfig(max_consecutive_skips=None, history_size=4, max_anomalies=4)
    opt = ampguard.wrap(make_opt(model), precision="bf16", config=config)  # no model: no forensics
    (x, y), = make_data(1)
    bad = x.clone().index_fill_(1, torch.tensor([2]), math.nan)

    def run(n: int) -> None:
        for _ in range(n):
            opt.backward(loss_of(model, bad, y))
            opt.step()
            opt.zero_grad()

    run(KEEP + 50)
    # Only what ampguard's own code allocates: a thread another test left running (a W&B service
    # retrying its connection) allocates too, and tracemalloc traces every thread.
    mine = [tracemalloc.Filter(True, str(Path(ampguard.__file__).parent / "*"), all_frames=True)]
    tracemalloc.start(5)
    try:
        gc.collect()  # what is kept, not what the cyclic collector has yet to free
        before = tracemalloc.take_snapshot().filter_traces(mine)
        run(1000)
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(mine)
    finally:
        tracemalloc.stop()
    grown = sum(d.size_diff for d in after.compare_to(before, "filename"))
    assert grown < 100_000, grown
    voice = opt._outcome.voice
    assert len(voice.kept) == KEEP and len(voice.anomalies) == KEEP
    result = opt.close()
    steps = KEEP + 1050
    assert result.steps == steps and result.skipped == steps == result.skipped_by_reason["nonfinite_loss"]
    assert result.ranks[0].skipped == steps and result.ranks[0].nonfinite_loss_steps == steps
    assert result.anomalies_by_kind == {"nonfinite_loss": steps} and len(result.anomalies) == KEEP
    assert result.anomalies[-1].step == steps - 1
