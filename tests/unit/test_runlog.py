"""ampguard report / ampguard.runlog: event logs written by real guarded runs, read back.

The logs come from training a tiny model through ``ampguard.wrap`` with faults injected by
``ampguard.faults``; what the reader says is checked against what the guard itself recorded
(``opt.history``, ``opt.anomalies``). The command is run as a subprocess, as a user runs it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import ampguard
from ampguard import faults, runlog
from ampguard.errors import AmpGuardError, BackendUnavailableError
from ampguard.exporters import JsonlExporter
from ampguard.vocab import AnomalyKind, Cause, Phase, SkipReason

from ._models import guarded_steps, make_data, make_model, make_opt

REPO = Path(__file__).resolve().parents[2]
STEPS = 24


def _faults():
    return (
        faults.loss("nan", steps=[3]),  # a NaN loss (also arms forensics)
        faults.grad("2.weight", "inf", steps=[8, 9]),  # overflow twice: the scale backs off twice
        faults.output("0", "nan", steps=[14]),  # localised by forensics: module "0", forward
    )


def _train(out: Path, steps: int = STEPS, close: bool = True, every_step: bool = True) -> ampguard.GuardedOptimizer:
    model = make_model()
    opt = ampguard.wrap(
        make_opt(model), model=model, precision="fp16",
        scaler=torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=4),
        exporters=[JsonlExporter(str(out) + "/", every_step=every_step)],
    )
    with faults.inject(opt, model, *_faults()):
        guarded_steps(opt, model, make_data(steps))
    if close:
        opt.close()
    return opt


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, ampguard.GuardedOptimizer]:
    out = tmp_path_factory.mktemp("run") / "run"
    opt = _train(out)
    return out, opt


def _cli(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "ampguard.runlog", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


# ---------------------------------------------------------------------------------- library
def test_series_are_the_guards_own_reports(good):
    out, opt = good
    run = runlog.load_run(out)
    assert list(run.ranks) == [0] and run.closed and not run.problems
    assert run.run_id == opt.run_info.run_id and run.info["precision"] == "fp16"
    log = run.ranks[0]
    assert log.paths == [out / "events-rank0.jsonl"] and log.every_step
    hist = list(opt.history)
    assert log.step == [r.step for r in hist] == list(range(STEPS))
    assert log.skipped == [r.skipped for r in hist]
    assert log.reason == [r.reason for r in hist]
    assert log.loss_scale == [r.loss_scale for r in hist]
    assert log.nonfinite_grads == [r.nonfinite_grads for r in hist]
    assert all(_same(a, b.loss) for a, b in zip(log.loss, hist))
    assert all(_same(a, b.grad_norm) for a, b in zip(log.grad_norm, hist))
    assert [(a.step, a.kind, a.detail, a.ranks, a.params, a.module, a.phase, a.cause) for a in run.anomalies] == [
        (a.step, a.kind, a.detail, a.ranks, a.params, a.module, a.phase, a.cause) for a in opt.anomalies]


def test_summary_numbers_match_the_guard(good):
    out, opt = good
    s = runlog.summary(runlog.load_run(out))
    hist = list(opt.history)
    assert s.steps == opt.step_count == STEPS
    skipped = Counter(r.reason for r in hist if r.skipped)
    assert s.skipped == sum(skipped.values()) == 4
    assert s.skipped_by_reason == dict(skipped) == {"nonfinite_loss": 2, "nonfinite_grad": 2}
    scales = [x for r in hist for x in (r.loss_scale, r.next_loss_scale)]
    r0 = s.ranks[0]
    assert (r0.scale_min, r0.scale_max, r0.scale_last) == (min(scales), max(scales), hist[-1].next_loss_scale)
    assert r0.scale_min < 1024.0 < r0.scale_max  # backed off, and grew again
    assert r0.nonfinite_loss_steps == sum(r.nonfinite_loss for r in hist) == 2
    assert r0.nonfinite_grad_steps == sum(r.nonfinite_grads > 0 for r in hist)
    assert r0.nonfinite_grad_tensors == sum(r.nonfinite_grads for r in hist)
    assert r0.closed and r0.steps == STEPS and r0.skipped == 4
    localised = [a for a in s.anomalies if a.module]
    assert [(a.step, a.kind, a.module, a.phase, a.cause) for a in localised] == [
        (8, "overflow", "2", "backward", "overflow"),  # an inf in 2.weight's gradient: owner module named
        (9, "overflow", "2", "backward", "overflow"),
        # an injected value, no replay: not reproduced by recompute (issue 14: "transient" needs a clean replay)
        (14, "nonfinite_loss", "0", "forward", "not_reproduced")]
    assert s.anomalies_by_kind == dict(Counter(a.kind for a in opt.anomalies))
    json.dumps(s.to_dict(), allow_nan=False)  # strict JSON
    text = runlog.format_summary(s)
    assert "nonfinite_grad" in text and "not_reproduced" in text and "(finished)" in text


def test_only_skipped_steps_logged_and_run_in_progress(tmp_path):
    opt = _train(tmp_path, steps=10, close=False, every_step=False)  # like a run killed before close()
    run = runlog.load_run(tmp_path / "events-rank0.jsonl")
    assert not run.closed and not run.ranks[0].every_step
    assert run.ranks[0].step == [r.step for r in opt.history if r.skipped] == [3, 8, 9]
    s = runlog.summary(run)
    assert s.steps == 10 and s.skipped == 3  # steps: one past the last logged step
    assert "still running, or killed" in runlog.format_summary(s)
    opt.close()


def test_append_only_log_with_two_runs_reads_the_latest(tmp_path):
    first = _train(tmp_path, steps=6)
    second = _train(tmp_path, steps=12)
    run = runlog.load_run(tmp_path)
    assert run.run_id == second.run_info.run_id and run.other_runs == [first.run_info.run_id]
    assert runlog.summary(run).steps == 12 and any("other run" in p for p in run.problems)
    older = runlog.load_run(tmp_path, run_id=first.run_info.run_id)
    assert runlog.summary(older).steps == 6
    with pytest.raises(runlog.RunLogError, match="no run 'nope'"):
        runlog.load_run(tmp_path, run_id="nope")


def test_bad_input_raises_run_log_error(tmp_path):
    assert issubclass(runlog.RunLogError, AmpGuardError)
    with pytest.raises(runlog.RunLogError, match="no such file"):
        runlog.load_run(tmp_path / "missing")
    with pytest.raises(runlog.RunLogError, match=r"no \*\.jsonl"):
        runlog.load_run(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    with pytest.raises(runlog.RunLogError, match="not an ampguard event log"):
        runlog.load_run(tmp_path / "data.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(runlog.RunLogError, match="no records"):
        runlog.load_run(tmp_path / "empty.jsonl")


def test_summary_is_a_frozen_record_and_to_dict_is_the_json(good):
    out, _ = good
    s = runlog.summary(runlog.load_run(out))
    assert isinstance(s, runlog.RunSummary) and isinstance(s.ranks[0], runlog.RankSummary)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.steps = 0  # type: ignore[misc]
    d = s.to_dict()
    assert list(d) == ["path", "run", "closed", "steps", "skipped", "skipped_by_reason", "ranks", "anomalies",
                       "anomalies_by_kind", "problems"]
    assert list(d["ranks"]) == ["0"] and d["ranks"]["0"]["steps"] == s.ranks[0].steps == STEPS
    assert d["ranks"]["0"]["files"] == [str(out / "events-rank0.jsonl")]
    assert d["anomalies"] == [a.to_dict() for a in s.anomalies] and d["run"]["precision"] == "fp16"


def test_logged_anomaly_is_an_anomaly_with_the_vocabulary(good):
    run = runlog.load_run(good[0])
    a = next(a for a in run.anomalies if a.module)
    assert isinstance(a, ampguard.Anomaly)
    assert (a.kind, a.phase, a.cause) == (AnomalyKind.OVERFLOW, Phase.BACKWARD, Cause.OVERFLOW)
    assert type(a.kind) is AnomalyKind and type(a.phase) is Phase and type(a.cause) is Cause
    assert list(a.to_dict())[-2:] == ["reason", "logged_by"] and a.to_dict()["logged_by"] == [0]
    assert all(r is None or type(r) is SkipReason for r in run.ranks[0].reason)


def test_words_this_version_does_not_know_are_read_as_logged(tmp_path):
    # A log written by another ampguard version: a skip reason and an anomaly kind unknown here.
    records = [
        {"event": "run", "run_id": "r1", "rank": 0, "world_size": 1, "precision": "fp16", "time": 1.0},
        {"event": "skipped", "step": 0, "skipped": True, "reason": "future_reason", "loss": 1.0, "loss_scale": 8.0,
         "grad_norm": 1.0},
        {"event": "anomaly", "step": 0, "kind": "future_kind", "detail": "d", "phase": "elsewhere", "ranks": []},
        {"event": "close", "rank": 0, "steps": 1},
    ]
    (tmp_path / "events-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = runlog.load_run(tmp_path)
    assert not run.problems and run.ranks[0].reason == ["future_reason"]
    (a,) = run.anomalies
    assert (a.kind, a.phase) == ("future_kind", "elsewhere")
    s = runlog.summary(run)
    assert s.skipped_by_reason == {"future_reason": 1} and s.anomalies_by_kind == {"future_kind": 1}
    assert "future_kind" in runlog.format_summary(s)


def test_plot_without_matplotlib_names_the_extra(good, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(BackendUnavailableError, match=r"ampguard\[cli\]"):
        runlog.plot(runlog.load_run(good[0]), tmp_path / "x.png")


# ---------------------------------------------------------------------------------- two ranks
def _two_rank_body(rank: int, world_size: int, out: str) -> list[tuple]:
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = ampguard.wrap(make_opt(ddp), model=ddp, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=4),
                        exporters=[JsonlExporter(out + "/", every_step=True)])
    with faults.inject(opt, ddp, faults.loss("nan", steps=[3], ranks=[1]), faults.grad("2.weight", "inf", steps=[6]),
                       faults.output("0", "nan", steps=[10], ranks=[1])):
        guarded_steps(opt, ddp, make_data(14, seed=rank))
    opt.close()
    return [(r.step, r.skipped, r.reason, r.nonfinite_ranks, r.loss_scale) for r in opt.history]


@pytest.mark.distributed
def test_two_ranks_merged_and_attributed(tmp_path):
    from tests.distributed._common import spawn

    histories = spawn(_two_rank_body, 2, out=str(tmp_path))
    run = runlog.load_run(tmp_path)
    assert sorted(run.ranks) == [0, 1] and run.closed and not run.problems
    for rank, hist in enumerate(histories):
        log = run.ranks[rank]
        assert [(r.step, r.skipped, r.reason, r.nonfinite_ranks, r.loss_scale) for r in log.reports] == hist
    s = runlog.summary(run)
    assert s.steps == 14 and s.skipped_by_reason == {"nonfinite_loss": 2, "nonfinite_grad": 1}
    assert (s.ranks[0].nonfinite_loss_steps, s.ranks[1].nonfinite_loss_steps) == (0, 2)
    assert (s.ranks[0].nonfinite_grad_steps, s.ranks[1].nonfinite_grad_steps) == (1, 2)
    # Every rank logs each anomaly; the report lists it once, with the origin rank's diagnosis.
    by_step = {a.step: a for a in s.anomalies}
    assert by_step[3].ranks == (1,) and by_step[3].logged_by == (0, 1)
    assert (by_step[10].module, by_step[10].phase, by_step[10].ranks) == ("0", "forward", (1,))
    png = runlog.plot(run, tmp_path / "two.png")
    assert png.stat().st_size > 20_000


# ---------------------------------------------------------------------------------- command line
def test_cli_table(good):
    out, opt = good
    p = _cli(out)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert f"steps {STEPS}   skipped 4 (16.7%)" in lines
    assert any(line.split() == ["nonfinite_loss", "2"] for line in lines)
    assert any(line.split() == ["nonfinite_grad", "2"] for line in lines)
    assert opt.run_info.run_id in p.stdout and "Traceback" not in p.stderr


def test_cli_json(good):
    out, opt = good
    p = _cli(out / "events-rank0.jsonl", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s == runlog.summary(runlog.load_run(out / "events-rank0.jsonl")).to_dict()
    assert s["steps"] == STEPS and s["skipped_by_reason"] == {"nonfinite_loss": 2, "nonfinite_grad": 2}
    assert [(a["step"], a["kind"]) for a in s["anomalies"]] == [(a.step, a.kind) for a in opt.anomalies]


def test_cli_plot(good, tmp_path):
    mpimg = pytest.importorskip("matplotlib.image")
    png = tmp_path / "sub" / "report.png"
    p = _cli(good[0], "--plot", png)
    assert p.returncode == 0, p.stderr
    assert png.is_file() and png.stat().st_size > 20_000
    assert mpimg.imread(png).shape[:2] == (1200, 1600)
    assert f"picture: {png}" in p.stdout


def test_cli_truncated_last_line(good, tmp_path):
    text = (good[0] / "events-rank0.jsonl").read_text()
    cut = text[: len(text) - 40]  # the close record, half written: a run killed mid-write
    (tmp_path / "events-rank0.jsonl").write_text(cut)
    p = _cli(tmp_path)
    assert p.returncode == 0, p.stderr
    assert "ampguard report: warning:" in p.stderr and "truncated" in p.stderr
    assert "still running, or killed" in p.stdout and f"steps {STEPS}" in p.stdout
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("case", ["missing", "not_ampguard", "not_json", "empty_dir"])
def test_cli_bad_input_exit_2_one_line(tmp_path, case):
    if case == "missing":
        target = tmp_path / "nope"
    elif case == "empty_dir":
        target = tmp_path
    else:
        target = tmp_path / "x.jsonl"
        target.write_text('{"step": 1, "loss": 0.5}\n' if case == "not_ampguard" else "step,loss\n1,0.5\n")
    p = _cli(target)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert p.stderr.startswith("ampguard report: error: ") and len(p.stderr.strip().splitlines()) == 1


def test_cli_usage_errors_exit_2():
    p = _cli()
    assert p.returncode == 2 and "RUN_DIR_OR_EVENTS.jsonl" in p.stderr and "Traceback" not in p.stderr
    h = _cli("--help")
    assert h.returncode == 0 and "--plot" in h.stdout and "--json" in h.stdout
