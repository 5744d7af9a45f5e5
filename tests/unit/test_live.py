"""Watching a run: :class:`ampguard.ConsoleExporter` (the live view the demo uses) and
``ampguard report --follow``, drawn by rich onto string consoles, from real guarded runs."""

from __future__ import annotations

import io
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

import ampguard
from ampguard import faults, runlog
from ampguard.exporters import JsonlExporter
from ampguard.records import RunInfo
from ampguard.runlog import command

from ._models import loss_of, make_data, make_model, make_opt

rich_console = pytest.importorskip("rich.console")

STEPS = 20
FAULTS = (4, 12)  # a NaN loss at step 4; a NaN output of module "0" (forensics localises it) at step 12


def _console(terminal: bool = True) -> tuple[rich_console.Console, io.StringIO]:
    buf = io.StringIO()
    return rich_console.Console(file=buf, force_terminal=terminal, width=160, color_system=None), buf


def _train(exporters: list, steps: int = STEPS, *, close: bool = True, pause: float = 0.0) -> ampguard.GuardedOptimizer:
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu", init_scale=1024.0), exporters=exporters)
    with faults.inject(opt, model, faults.loss("nan", steps=[FAULTS[0]]), faults.output("0", "nan", steps=[FAULTS[1]])):
        for x, y in make_data(steps):
            with opt.autocast():
                loss = loss_of(model, x, y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            time.sleep(pause)
    if close:
        opt.close()
    return opt


# ---------------------------------------------------------------------------------- ConsoleExporter
def test_console_exporter_draws_the_run_live_and_rate_limits_its_redraws():
    fast_console, fast_out = _console()
    slow_console, slow_out = _console()
    fast = ampguard.ConsoleExporter(console=fast_console, refresh_s=0, total_steps=STEPS)
    slow = ampguard.ConsoleExporter(console=slow_console, refresh_s=3600, total_steps=STEPS)
    opt = _train([fast, slow])
    assert [a.step for a in opt.anomalies if a.kind == "nonfinite_loss"] == list(FAULTS)
    assert not fast.plain and not slow.plain  # a terminal: the live table
    # refresh_s=0 redraws every step; an hour's limit only at open, on each step with an anomaly, at close.
    anomaly_steps = len({a.step for a in opt.anomalies})
    assert fast.redraws >= STEPS + 1
    assert slow.redraws == 1 + anomaly_steps + 1 < fast.redraws
    last_frame = slow_out.getvalue().split("ampguard run ")[-1]
    assert last_frame.startswith(f"{opt.run_info.run_id}: fp16, 1 rank(s)   {STEPS}/{STEPS} steps")
    for text in ("nonfinite_loss", "loss scale", "skipped by reason", "last anomalies", "forward"):
        assert text in last_frame, text
    row = next(line for line in last_frame.splitlines() if line.startswith("│") and f" {STEPS - 1} " in line)
    assert f"{opt.skipped_steps} (" in row and f"{opt.get_scale():g}" in row  # the guard's own numbers
    assert fast_out.getvalue().count("ampguard run ") == fast.redraws


def test_console_exporter_prints_plain_lines_off_a_terminal():
    console, out = _console(terminal=False)
    exporter = ampguard.ConsoleExporter(console=console, every=5)
    opt = _train([exporter])
    assert exporter.plain
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"ampguard run {opt.run_info.run_id}: fp16, 1 rank(s)")
    flagged = [line for line in lines if line.startswith("  ! step ")]
    assert [line.split()[2] for line in flagged] == [str(a.step) for a in opt.anomalies]
    assert "[0, forward, " in flagged[-1]  # where forensics localised it
    status = [line for line in lines if line.startswith("step ")]
    skipped = [r.step for r in opt.history if r.skipped]
    every_5th = {s for s in range(STEPS) if (s + 1) % 5 == 0}
    assert [int(line.split()[1]) for line in status] == sorted(set(skipped) | every_5th)
    assert lines[-1] == f"closed after {STEPS} steps: {len(skipped)} skipped, {len(opt.anomalies)} anomalies"
    assert "\x1b[" not in out.getvalue()


def test_console_exporter_draws_on_rank_0_only_unless_asked():
    info = RunInfo(run_id="r", rank=1, local_rank=1, world_size=2, precision="bf16", backend="torch.distributed",
                   device="cpu", param_names=())
    console, out = _console()
    quiet = ampguard.ConsoleExporter(console=console)
    quiet.open(info)
    opt = _train([])  # reports of a real run, handed to the exporter as rank 1's guard would
    for r in opt.history:
        quiet.export(r, [])
    quiet.close()
    assert out.getvalue() == "" and quiet.redraws == 0
    console, out = _console(terminal=False)
    loud = ampguard.ConsoleExporter(console=console, all_ranks=True)
    loud.open(info)
    loud.close()
    assert out.getvalue().startswith("ampguard run r: bf16, 2 rank(s)")


def test_console_exporter_failure_never_stops_training(tmp_path, caplog):
    dead = open(tmp_path / "closed.txt", "w")  # noqa: SIM115 - a terminal that went away
    dead.close()
    exporter = ampguard.ConsoleExporter(console=rich_console.Console(file=dead, force_terminal=False), every=1)
    jsonl = JsonlExporter(tmp_path / "events.jsonl", every_step=True)
    with caplog.at_level(logging.ERROR, logger="ampguard.exporters"):
        opt = _train([exporter, jsonl])
    assert len(opt.history) == STEPS
    assert any("ConsoleExporter.open() failed" in r.getMessage() for r in caplog.records)
    assert runlog.load_run(tmp_path / "events.jsonl").ranks[0].steps_seen == STEPS  # the other exporter went on


def test_console_exporter_refuses_bad_arguments():
    for kwargs, msg in (({"refresh_s": -1}, "refresh_s=-1"), ({"every": 0}, "every=0"),
                        ({"total_steps": 0}, "total_steps=0"), ({"recent": -1}, "recent=-1")):
        with pytest.raises(ValueError, match=msg):
            ampguard.ConsoleExporter(**kwargs)


# ---------------------------------------------------------------------------------- report --follow
def _follow_in_thread(path: Path, **kwargs) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def body() -> None:
        result["rc"] = command.follow(path, **kwargs)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, result


def test_follow_redraws_as_a_real_run_grows_and_stops_when_it_ends(tmp_path):
    out = tmp_path / "run"
    out.mkdir()  # no log yet: follow waits for one
    console, buf = _console()
    t, result = _follow_in_thread(out, interval=0.02, console=console)
    time.sleep(0.2)
    opt = _train([JsonlExporter(str(out) + "/", every_step=True)], pause=0.03)
    t.join(timeout=60)
    assert not t.is_alive() and result["rc"] == 0  # the close record ended it
    frames = buf.getvalue().split("ampguard run ")[1:]
    assert buf.getvalue().startswith("\x1b[?25l") or "waiting for event logs" in buf.getvalue()
    steps_seen = [int(f.split("\nsteps ")[1].split()[0]) for f in frames]
    assert len(set(steps_seen)) >= 3 and steps_seen == sorted(steps_seen)  # redrawn as it grew
    assert frames[-1].startswith(f"{opt.run_info.run_id}  (finished)") and steps_seen[-1] == STEPS
    assert "anomalies 2" in frames[-1] and "nonfinite_loss" in frames[-1]


def test_follow_stops_on_its_timeout_when_the_run_stalls(tmp_path, capsys):
    out = tmp_path / "run"
    # no close record: killed; its 6 steps on disk first (flush() drains the log's background writer, which a loaded
    # machine let fall behind the first read: the fresh clone's make test of stop 50 saw "step 5")
    _train([JsonlExporter(str(out) + "/", every_step=True)], steps=6, close=False).flush()
    console, buf = _console(terminal=False)
    started = time.monotonic()
    rc = command.follow(out, interval=0.02, timeout=0.3, console=console)
    assert rc == 1 and time.monotonic() - started < 10
    assert "no new record for 0.3s and the run has not ended" in capsys.readouterr().err
    text = buf.getvalue()
    assert text.splitlines()[0].endswith("step 6, skipped 1, anomalies 1 (running)")  # off a terminal: a line
    assert "no close record: still running, or killed" in text  # then the whole summary


def test_follow_refuses_a_missing_path(tmp_path):
    with pytest.raises(runlog.RunLogError, match="no such file"):
        command.follow(tmp_path / "nope", interval=0.01, timeout=0.05)


# ---------------------------------------------------------------------------------- progress
def test_reading_a_large_log_shows_progress_with_an_estimate(tmp_path):
    out = tmp_path / "run"
    _train([JsonlExporter(str(out) + "/", every_step=True)])
    calls: list[tuple[int, int]] = []
    run = runlog.load_run(out, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] and [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert run.ranks[0].steps_seen == STEPS
    console, buf = _console()
    again = command._load_with_progress(str(out), None, console, threshold=0)  # every log counts as large here
    assert again.ranks[0].reports == run.ranks[0].reports
    assert "reading 0 MiB of event logs" in buf.getvalue() and "100%" in buf.getvalue() and "eta" in buf.getvalue()
    console, buf = _console()
    command._load_with_progress(str(out), None, console)  # a small log: no bar
    assert buf.getvalue() == ""


# ---------------------------------------------------------------------------------- preflight
def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _tiny_batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01)


class _Slow(torch.nn.Module):
    """A model whose step is slow for its device, as a big model's is on a CPU (a real wait: sleep)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _tiny_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.4)
        return self.inner(x)


def test_preflight_warns_of_a_slow_trial_while_its_first_step_still_runs(caplog):
    calls: list[tuple[int, int, str]] = []
    warned_at: list[int] = []

    class Spy(logging.Handler):  # when, in progress calls, the warning came
        def emit(self, record: logging.LogRecord) -> None:
            warned_at.append(len(calls))

    spy = Spy()
    logging.getLogger("ampguard.preflight").addHandler(spy)
    try:
        with caplog.at_level(logging.WARNING, logger="ampguard.preflight"):
            ampguard.preflight(_Slow, _tiny_batch, _sgd, steps=5, precision=("fp16", "bf16"), device="cpu",
                               warn_after_s=0.5, progress=lambda *a: calls.append(a))
    finally:
        logging.getLogger("ampguard.preflight").removeHandler(spy)
    (record,) = [r for r in caplog.records if r.name == "ampguard.preflight"]
    assert warned_at == [1]  # after the first trial began, before its first step ended (a step takes 0.4 s)
    msg = record.getMessage()
    assert msg.startswith("a fp16 trial step has run for 0.05 s on cpu and is not done: 5 steps x 2 candidate(s) "
                          "will take more than 0.5 s.")
    assert "smaller model or batch" in msg and "--device cuda" in msg and "try bf16" in msg
    steps = [(i + 1, 10, "fp16" if i < 5 else "bf16") for i in range(10)]
    assert calls == [(0, 10, "fp16"), *steps[:5], (5, 10, "bf16"), *steps[5:]]


def test_preflight_is_quiet_when_its_trials_are_quick(caplog):
    with caplog.at_level(logging.WARNING, logger="ampguard.preflight"):
        ampguard.preflight(_tiny_model, _tiny_batch, _sgd, steps=5, precision=("bf16",), device="cpu")
    assert not [r for r in caplog.records if r.name == "ampguard.preflight"]
    with pytest.raises(ValueError, match="warn_after_s=0"):
        ampguard.preflight(_tiny_model, _tiny_batch, _sgd, steps=5, precision=("bf16",), warn_after_s=0)


def test_preflight_progress_bar_shows_the_time_left():
    from ampguard.cli import _progress_bar

    console, buf = _console()
    with _progress_bar(console) as progress:
        ampguard.preflight(_tiny_model, _tiny_batch, _sgd, steps=5, precision=("fp16", "bf16"), device="cpu",
                           progress=progress)
    text = buf.getvalue()
    assert "preflight: bf16 trial" in text and "10/10 steps, eta" in text and "0:00:00" in text


def test_ctrl_c_stops_follow_between_its_steps_not_inside_one(tmp_path, capsys):
    """Ctrl-C during a step of the loop (here inside its clock: in a run, an import or a read of the logs) lets that
    step finish and stops follow at the next check, with the summary and exit code 0; the SIGINT handler is put back.
    Before stop 50 the KeyboardInterrupt was raised wherever the interpreter was, which can leave importlib's or an
    I/O lock held: one `report --follow` under test never exited after its SIGINT."""
    import os
    import signal

    out = tmp_path / "run"
    _train([JsonlExporter(str(out) + "/", every_step=True)], steps=4, close=False)
    console, buf = _console(terminal=False)
    finished: list[bool] = []
    calls = [0]

    def clock() -> float:
        calls[0] += 1
        if calls[0] == 2:  # the loop's first step, as it takes the logs' change
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here, as at any bytecode
            finished.append(True)  # the rest of the step still runs
        return time.monotonic()

    before = signal.getsignal(signal.SIGINT)
    rc = command.follow(out, interval=0.01, timeout=30, console=console, clock=clock)  # the timeout: rc 1
    assert rc == 0 and finished == [True]
    assert signal.getsignal(signal.SIGINT) is before
    text = buf.getvalue()  # the step's status line, then the summary
    assert text.splitlines()[0].endswith("(running)") and "no close record: still running, or killed" in text


_WAIT_INTERRUPTED = r"""
import signal, sys, threading, time
from ampguard.runlog import command

fired = []

def hook(frame, event, arg):  # SIGINT at follow's first wait, once: inside Condition.wait (an Event's, whose lock
    # is held there) or as time.sleep begins; its handler then runs at the next bytecode, inside that wait
    if not fired and ((event == "call" and frame.f_code is threading.Condition.wait.__code__)
                      or (event == "c_call" and arg is time.sleep)):
        fired.append(event)
        signal.raise_signal(signal.SIGINT)

sys.setprofile(hook)
rc = command.follow(sys.argv[1], interval=0.5, timeout=30)
sys.setprofile(None)
print("rc", rc, fired)
"""


def test_ctrl_c_inside_follows_wait_ends_it(tmp_path):
    """Ctrl-C while follow waits between two reads of the logs, with the wait's own lock held: the SIGINT raised at
    the wait's first call, so its handler runs inside it. Before stop 58 the flag was a ``threading.Event``: its
    ``set()``, run by the handler inside that Event's ``wait()``, waited for ever on the lock its own thread held (a
    `report --follow` under test outlived its SIGINT by 60 s, tests/integration/test_cli.py). Now the handler sets a
    plain flag, and the wait ends within a nap. In a child process: the failure is a hang."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    _train([JsonlExporter(str(out) + "/", every_step=True)], steps=2, close=False)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _WAIT_INTERRUPTED, str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail("follow outlived a SIGINT raised inside its wait by 60 s (a lock the handler waits on)")
    assert proc.returncode == 0, stderr
    last = stdout.splitlines()[-1]
    assert last.startswith("rc 0 [") and last != "rc 0 []", stdout  # interrupted (rc 0), by the hook's signal
