"""Reliability (issue 15): restores that fail change nothing, logs that survive their own damage,
settings validated up front, steps without gradients, exporters that come back, and no side
effects on the user's process. Each test's fixture is the failing input the issue found."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ampguard
from ampguard import faults, runlog
from ampguard.exporters import JsonlExporter
from ampguard.runlog.command import report_main

from ._models import guarded_steps, make_data, make_model, make_opt

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------- 1. atomic load_state_dict
def _fp16_guard(growth_interval: int) -> tuple[Any, torch.nn.Module]:
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2048.0, growth_interval=growth_interval)
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16", scaler=scaler,
                        config={"spikes": {"grad_factor": 10.0, "warmup": 1}, "zclip": {"warmup": 1},
                                "escalation": {"snapshot_every": None}})
    return opt, model


def _deep(value: Any) -> Any:
    """A comparable copy: tensors as (dtype, shape, values) tuples."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.detach().cpu().flatten().tolist())
    if isinstance(value, dict):
        return {k: _deep(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_deep(v) for v in value]
    return value


def _everything(opt: Any, model: torch.nn.Module) -> dict[str, Any]:
    """Every piece of state a load could touch."""
    rep, pipe, ladder = opt._reporter, opt._pipeline, opt._reporter.ladder
    scaler = opt.scaler
    return _deep({
        "params": [p.detach().clone() for p in model.parameters()],
        "inner": opt.optimizer.state_dict(),
        "scale": scaler._scale, "growth_tracker": scaler._growth_tracker,
        "scaler_cfg": [scaler._init_scale, scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval,
                       scaler._init_growth_tracker],
        "step": opt.step_count, "stage": opt._stage.value,
        "counters": [rep.skipped_total, rep.consecutive_skips, list(rep.quarantine)],
        "history": [len(rep.history), [r.step for r in rep.history], rep.history._count],
        "anomalies": [(a.step, a.kind) for a in rep.anomalies],
        "device": [pipe.scale_state.overflow_run, pipe.spikes.grad_ema, pipe.spikes.loss_ema, pipe.spikes.count,
                   pipe.spikes.z_mean, pipe.spikes.z_var, pipe.spikes.clip_mean, pipe.spikes.clip_var,
                   pipe.spikes.clip_count],
        "ladder": ladder.state_dict(),
    })


_MISSING = object()
# Per field: values that are not what state_dict() writes. Each is tried alone.
_BAD_AMPGUARD = {
    "version": [None, 2, "1"],
    "precision": [None, "bf16", 16],
    "step": [None, "abc", -1, 1.5, True, 2**63],
    "skipped_total": [None, "1", -1, 100],
    "consecutive_skips": [None, -1, 1.0, 100],
    "overflow_run": [None, -1, "0", 2**31],
    "grad_ema": [None, "x", math.nan, math.inf, True, 10**400],
    "loss_ema": [None, "x", -math.inf, math.nan],
    "ema_count": [None, -1, 2**31, 2.0],
    "z_mean": [None, "x", math.nan, math.inf, True, 10**400],
    "z_var": [None, -1.0, math.inf, math.nan],
    "zclip_mean": [None, "x", -math.inf, 4e38],
    "zclip_var": [None, -1e-30, math.nan, "1"],
    "zclip_count": [None, -1, 2**31, 2.0, True],
    "quarantine": [5, "ab", None, {"a": 1}],
    "escalation": [5, "x", [], {"recent": "x"}, {"recent": [1.5]}, {"recent": [1], "rollbacks": -1},
                   {"recent": [1], "rollbacks": 2**63}],
}
_BAD_SCALER = {
    "scale": [None, "x", True, 0.0, -1.0, math.inf, math.nan, 10**400],
    "growth_factor": [None, "x", 0.0, math.inf],
    "backoff_factor": [None, "x", 0.0, 1.5, math.nan],
    "growth_interval": [None, 0, 2.5, 2**31],
    "_growth_tracker": [None, -1, 0.5, 2**31],
}


def _cases() -> list[tuple[str, Any]]:
    cases: list[tuple[str, Any]] = []
    for top in ("optimizer", "scaler", "ampguard"):
        cases += [(f"{top} removed", (top, _MISSING)), (f"{top}=None", (top, None)), (f"{top}='x'", (top, "x"))]
    cases += [("scaler={}", ("scaler", {})),
              ("optimizer={}", ("optimizer", {})),
              ("optimizer.state removed", (("optimizer", "state"), _MISSING)),
              ("optimizer.state=[]", (("optimizer", "state"), [])),
              ("optimizer.param_groups removed", (("optimizer", "param_groups"), _MISSING)),
              ("optimizer.param_groups=[]", (("optimizer", "param_groups"), [])),
              ("optimizer.param_groups=['x']", (("optimizer", "param_groups"), ["x"]))]
    for top, table in (("ampguard", _BAD_AMPGUARD), ("scaler", _BAD_SCALER)):
        for field, values in table.items():
            cases.append((f"{top}.{field} removed", ((top, field), _MISSING)))
            cases += [(f"{top}.{field}={v!r:.30}", ((top, field), v)) for v in values]
    return cases


def _corrupt(sd: dict[str, Any], where: Any, value: Any) -> dict[str, Any]:
    sd = copy.deepcopy(sd)
    *path, last = (where,) if isinstance(where, str) else where
    target = sd
    for key in path:
        target = target[key]
    if value is _MISSING:
        del target[last]
    else:
        target[last] = value
    return sd


@pytest.fixture(scope="module")
def later_checkpoint() -> dict[str, Any]:
    """A checkpoint from further on: step 7, a grown loss scale, spike averages, a skip, a quarantine."""
    opt, model = _fp16_guard(growth_interval=2)
    data = make_data(7, seed=3)
    for i, (x, y) in enumerate(data):
        with opt.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if i == 5:
            loss = loss * math.nan
        opt.backward(loss, batch_id=f"b{i}")
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    g = sd["ampguard"]
    assert (g["step"], g["skipped_total"], g["quarantine"]) == (7, 1, ["b5"]) and g["escalation"]["recent"] == [5]
    assert sd["scaler"]["scale"] != 2048.0 and g["ema_count"] > 0 and g["zclip_count"] > 0 and g["zclip_var"] > 0
    return sd


@pytest.mark.parametrize(("case", "how"), _cases(), ids=[c for c, _ in _cases()])
def test_failed_load_state_dict_changes_nothing(later_checkpoint, case, how):
    opt, model = _fp16_guard(growth_interval=1000)
    guarded_steps(opt, model, make_data(2))
    before = _everything(opt, model)
    assert before["step"] == 2 and opt.get_scale() == 2048.0
    with pytest.raises((ValueError, TypeError), match="Nothing was loaded"):
        opt.load_state_dict(_corrupt(later_checkpoint, *how))
    assert _everything(opt, model) == before
    # and the good checkpoint still loads into the same guard afterwards
    opt.load_state_dict(copy.deepcopy(later_checkpoint))
    assert opt.step_count == 7 and opt.get_scale() == later_checkpoint["scaler"]["scale"]


# ---------------------------------------------------------------------------------- 2. torn last line
def _logged_run(path: Path, steps: int, nan_at: list[int]) -> Any:
    """A guarded fp32 run logging to ``path``, its loss NaN at ``nan_at``; closed."""
    model = make_model()
    log = JsonlExporter(path, every_step=False)  # the anomalies and skipped steps only
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp32", exporters=[log])
    with faults.inject(opt, model, faults.loss("nan", steps=nan_at)):
        guarded_steps(opt, model, make_data(steps))
    opt.close()
    return opt


def _torn_after_last_anomaly(path: Path) -> str:
    """``path`` cut in the middle of its last anomaly record, as a kill or ENOSPC mid-write leaves it."""
    lines = path.read_text().splitlines(keepends=True)
    last = max(i for i, ln in enumerate(lines) if '"event":"anomaly"' in ln)
    torn = "".join(lines[:last]) + lines[last][: len(lines[last]) // 2]
    path.write_text(torn)
    return torn


def _anomaly_steps(run: Any) -> list[int]:
    return [a.step for a in run.anomalies]


def test_jsonl_open_ends_a_torn_line_and_says_so(tmp_path):
    log = tmp_path / "events.jsonl"
    first = _logged_run(log, 6, nan_at=[1, 4])
    torn = _torn_after_last_anomaly(log)  # step 4's anomaly half written, no close record
    second = _logged_run(log, 5, nan_at=[2])
    text = log.read_text()
    assert text.startswith(torn + "\n{")  # the fragment's line was ended before the new header
    recs = [json.loads(ln) for ln in text[len(torn) + 1:].splitlines()]
    assert recs[0]["event"] == "run" and recs[0]["run_id"] == second.run_info.run_id
    assert recs[1]["event"] == "torn_line" and recs[1]["bytes"] == len(torn) - torn.rfind("\n") - 1
    run = runlog.load_run(log)  # the latest run, its events under its own id
    assert run.run_id == second.run_info.run_id and _anomaly_steps(run) == [2] and run.closed
    assert [r.step for r in run.ranks[0].reports] == [2]
    assert any("torn record" in p and "ended before this run" in p for p in run.problems)
    old = runlog.load_run(log, run_id=first.run_info.run_id)
    assert _anomaly_steps(old) == [1] and not old.closed  # step 4's record was torn away


def test_reader_keeps_runs_apart_when_a_run_header_is_glued_to_a_torn_record(tmp_path):
    # What an unrepaired append leaves (an older ampguard, another writer): the fragment and the next
    # run's header on one line.
    first = _logged_run(tmp_path / "a.jsonl", 6, nan_at=[1, 4])
    torn = _torn_after_last_anomaly(tmp_path / "a.jsonl")
    second = _logged_run(tmp_path / "b.jsonl", 5, nan_at=[2])
    log = tmp_path / "glued" / "events.jsonl"
    log.parent.mkdir()
    log.write_text(torn + (tmp_path / "b.jsonl").read_text())
    run = runlog.load_run(log)
    assert run.run_id == second.run_info.run_id and _anomaly_steps(run) == [2] and run.closed
    assert run.other_runs == [first.run_info.run_id]
    assert any("torn record" in p for p in run.problems)
    assert _anomaly_steps(runlog.load_run(log, run_id=first.run_info.run_id)) == [1]


# ---------------------------------------------------------------------------------- 3. ampguard report on damage
@pytest.fixture(scope="module")
def good_log(tmp_path_factory) -> list[str]:
    """A closed run's log lines: run, anomaly+skipped at steps 1 and 4, close."""
    log = tmp_path_factory.mktemp("good") / "events.jsonl"
    _logged_run(log, 6, nan_at=[1, 4])
    lines = log.read_text().splitlines()
    assert [json.loads(ln)["event"] for ln in lines] == ["run", "anomaly", "skipped", "anomaly", "skipped", "close"]
    return lines


def _with_field(line: str, field: str, raw_json: str) -> str:
    """``line`` with ``field`` set to ``raw_json``, written as is (``1e400``, ``Infinity``: no
    well-behaved JSON writer makes them, a damaged or foreign file can hold them)."""
    return _with_nested_field(line, (field,), raw_json)


def _report(tmp_path: Path, lines: list[str], capsys: Any) -> tuple[int, str, str]:
    log = tmp_path / "events.jsonl"
    log.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    rc = report_main([str(log), "--json"])
    out, err = capsys.readouterr()
    return rc, out, err


def _with_nested_field(line: str, path: tuple[str, ...], raw_json: str) -> str:
    rec = json.loads(line)
    target = rec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = "@@"
    return json.dumps(rec, separators=(",", ":")).replace('"@@"', raw_json)


_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(("line", "damage"), [
    pytest.param(4, lambda ln: _with_field(ln, "step", "1e400"), id="step 1e400"),  # OverflowError before
    pytest.param(4, lambda ln: _with_field(ln, "step", "Infinity"), id="step Infinity"),  # OverflowError before
    pytest.param(2, lambda ln: _with_field(ln, "step", "-Infinity"), id="step -Infinity"),
    pytest.param(4, lambda ln: _with_field(ln, "nonfinite_grads", "1e400"), id="nonfinite_grads 1e400"),
    pytest.param(4, lambda ln: _DEEP, id="100k-deep array"),  # RecursionError before
    pytest.param(4, lambda ln: _with_field(ln, "rank", '"x"'), id="rank 'x'"),  # rejected the whole log before
    pytest.param(4, lambda ln: _with_field(ln, "rank", "1e400"), id="rank 1e400"),
    pytest.param(4, lambda ln: _with_field(ln, "skipped", '"x"'), id="skipped 'x'"),
    pytest.param(3, lambda ln: _with_field(ln, "params", "5"), id="params 5"),
    pytest.param(5, lambda ln: _with_field(ln, "steps", "Infinity"), id="close steps Infinity"),
])
def test_report_skips_a_damaged_record_with_one_warning(tmp_path, capsys, good_log, line, damage):
    lines = list(good_log)
    lines[line] = damage(lines[line])
    rc, out, err = _report(tmp_path, lines, capsys)
    assert rc == 0 and "Traceback" not in err
    warnings_ = [w for w in err.splitlines() if w.startswith("ampguard report: warning:")]
    assert len(warnings_) == 1 and "skipped" in warnings_[0], err
    s = json.loads(out)  # the other records are all read: a skipped step's report is in its anomaly too
    assert [a["step"] for a in s["anomalies"]] == ([1] if line == 3 else [1, 4])
    assert s["skipped"] == 2 and s["steps"] == (6 if line != 5 else 5)


@pytest.mark.parametrize("text", [_DEEP + "\n", "1e400\n", '{"event":' * 50_000 + "\n"],
                         ids=["100k-deep array", "1e400", "50k nested objects"])
def test_report_on_a_file_with_no_record_exits_2_with_one_line(tmp_path, capsys, text):
    log = tmp_path / "events.jsonl"
    log.write_text(text)
    capsys.readouterr()
    rc = report_main([str(log)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "Traceback" not in err
    assert err.startswith("ampguard report: error: ") and len(err.strip().splitlines()) == 1


def test_a_run_record_with_a_damaged_field_still_starts_its_run(tmp_path, capsys, good_log):
    lines = list(good_log)
    lines[0] = _with_field(_with_field(lines[0], "world_size", "1e400"), "time", "Infinity")
    rc, out, err = _report(tmp_path, lines, capsys)
    assert rc == 0 and "Traceback" not in err
    assert "'world_size' is" in err and "'time' is" in err
    assert json.loads(out)["skipped"] == 2


def test_no_field_of_any_record_can_make_the_reader_raise(tmp_path, good_log):
    """Every field of every record, and of an anomaly's report, set in turn to values ampguard never
    writes: the reader skips or ignores the damage; only a first line that is no event record at
    all (its 'event' replaced, or nested deeper than any record) makes the file "not an ampguard
    event log" (``ampguard report``: one line, exit 2)."""
    bad = ["1e400", "-1e400", "Infinity", "NaN", '"x"', "null", "[]", "{}", "-1", "1" + "0" * 400, "true",
           '"Infinity"', "1.5", "[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]"]
    log = tmp_path / "events.jsonl"
    tried = 0
    for i, line in enumerate(good_log):
        rec = json.loads(line)
        fields = [(k,) for k in rec] + [("report", k) for k in rec.get("report", ())]
        for field in fields:
            for value in bad:
                lines = list(good_log)
                lines[i] = _with_nested_field(line, field, value)
                log.write_text("\n".join(lines) + "\n")
                tried += 1
                try:
                    run = runlog.load_run(log)
                    json.dumps(runlog.summary(run).to_dict(), allow_nan=False)
                    runlog.format_summary(runlog.summary(run))
                except runlog.RunLogError:
                    assert i == 0 and (field == ("event",) or value.startswith("[[")), (i, field, value)
    assert tried > 1000


# ---------------------------------------------------------------------------------- 4. settings
@pytest.mark.parametrize(("field", "value"), [("forensics", "no"), ("forensics", "false"), ("forensics", 0),
                                              ("forensics", None)])
def test_config_booleans_are_validated(field, value):
    with pytest.raises(ValueError, match=rf"GuardConfig\.{field}={value!r}; allowed: True \| False"):
        ampguard.GuardConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"GuardConfig\.{field}="):
        ampguard.GuardConfig.from_dict({field: value})


def test_wrap_model_must_be_a_module():
    model = make_model()
    inner = make_opt(model)
    before = dict(vars(inner))
    with pytest.raises(TypeError, match=r"wrap\(model=\.\.\.\) expects the torch.nn.Module .* got str 'x'"):
        ampguard.wrap(inner, model="x")
    assert vars(inner) == before  # raised before anything changed


def test_wrap_accepts_one_exporter_and_explains_a_wrong_one(tmp_path):
    model = make_model()
    log = JsonlExporter(tmp_path / "e.jsonl", every_step=False)
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp32", exporters=log)
    guarded_steps(opt, model, make_data(2))
    opt.close()
    assert [json.loads(x)["event"] for x in (tmp_path / "e.jsonl").read_text().splitlines()] == ["run", "close"]
    for bad in ("events.jsonl", 5):
        with pytest.raises(TypeError, match=r"pass an exporter or a list of them"):
            ampguard.wrap(make_opt(model), model=model, exporters=bad)


def test_wrap_refuses_parameters_on_several_device_types():
    model = make_model()
    meta = torch.nn.Linear(2, 2, device="meta")
    inner = torch.optim.SGD([*model.parameters(), *meta.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"parameter 'group0\.param4' is on the meta device .* cpu \(4\), meta \(2\)"):
        ampguard.wrap(inner, model=model)
    on_meta = torch.optim.SGD(meta.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"on the meta device"):
        ampguard.wrap(on_meta)


# ---------------------------------------------------------------------------------- 5. no gradients at all
def _detached_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss that needs grad but reaches no parameter: the model's output detached."""
    outside = torch.ones((), requires_grad=True)  # not the optimizer's
    return torch.nn.functional.mse_loss(model(x).detach().float() * outside, y)


@pytest.mark.parametrize("kind", ["adamw", "adamw_fused", "sgd"])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_a_step_without_gradients_is_skipped_with_an_anomaly_and_the_guard_stays_usable(precision, kind):
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if precision == "fp16" else None  # no natural overflow
    opt = ampguard.wrap(make_opt(model, kind), model=model, precision=precision, scaler=scaler,
                        config={"clip_grad_norm": 1.0, "spikes": {"grad_factor": 5.0, "warmup": 1}})
    data = make_data(5)
    guarded_steps(opt, model, data[:2])
    before = [p.detach().clone() for p in model.parameters()]
    scale = opt.get_scale()
    with opt.autocast():
        loss = _detached_loss(model, *data[2])
    opt.backward(loss)
    opt.step()  # before: RuntimeError "Expected !nested_tensorlist[0].empty()"
    opt.zero_grad()
    r = opt.last_report
    assert r.skipped and r.reason == "no_gradients" and not r.nonfinite and r.loss == pytest.approx(loss.item())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and opt.get_scale() == scale
    (a,) = opt.anomalies
    assert a.kind == "no_gradients" and a.step == 2
    assert a.detail.startswith("no parameter received a gradient: is the model's output detached?")
    guarded_steps(opt, model, data[3:])  # before: "No inf checks were recorded for this optimizer" (fp16)
    assert [h.skipped for h in opt.history] == [False, False, True, False, False]
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.skipped_steps == 1
    opt.close()


def test_no_gradients_after_zero_grad_keeping_tensors_and_from_a_framework_backward():
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    data = make_data(4)
    guarded_steps(opt, model, data[:1])
    # zero_grad(set_to_none=False): the gradients exist (zeros), a backward that reaches none leaves them as they were
    opt.zero_grad(set_to_none=False)
    with opt.autocast():
        opt.backward(_detached_loss(model, *data[1]))
    opt.step()
    assert opt.last_report.reason == "no_gradients"
    opt.zero_grad()
    # a framework's own backward, the loss given with observe_loss: the same skip, not a call-order error
    with opt.autocast():
        loss = _detached_loss(model, *data[2])
    opt.observe_loss(loss)
    opt.scaler.scale(loss).backward()
    opt.step()
    assert opt.last_report.reason == "no_gradients"
    opt.zero_grad()
    # no backward at all is still a call-order error
    with pytest.raises(ampguard.GuardStateError, match="no backward in between"):
        opt.step()
    guarded_steps(opt, model, data[3:])
    assert [h.reason for h in opt.history] == [None, "no_gradients", "no_gradients", None]


# ---------------------------------------------------------------------------------- 6. exporters come back
def test_jsonl_exporter_comes_back_after_a_real_write_failure_with_every_record(tmp_path):
    from . import _disk_full_run as run_

    log = tmp_path / "events.jsonl"
    p = subprocess.run([sys.executable, "-m", "tests.unit._disk_full_run", str(log)], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=240)
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    up, errors = "ampguard_exporter_up", "ampguard_exporter_errors_total"
    assert seen["while_full"][up] == 0 and seen["while_full"][errors] >= 5  # one failed retry per step
    assert seen["after"][up] == 1 and seen["after"][errors] == seen["while_full"][errors] + 1
    assert p.stderr.count("ampguard: exporter JsonlExporter.export() failed: OSError") == 1  # once
    assert "Traceback (most recent call last)" not in p.stderr  # one line, not a traceback
    assert "JsonlExporter works again after 9 failed call(s)" in p.stderr
    lines = log.read_text().splitlines()
    torn = [i for i, ln in enumerate(lines) if _parses(ln) is None]
    assert len(torn) == 1  # the record the limit cut short: its line ended, then said so
    assert json.loads(lines[torn[0] + 1])["event"] == "torn_line"
    recs = [json.loads(ln) for i, ln in enumerate(lines) if i not in torn]
    anomalies = [r for r in recs if r["event"] == "anomaly"]
    # every anomaly once and complete: those of the full spell too, handed over when writing worked again
    assert [a["step"] for a in anomalies] == run_.NAN_AT
    assert all(a["kind"] == "nonfinite_loss" and a["report"]["step"] == a["step"] and a["report"]["skipped"]
               for a in anomalies)
    assert [r["step"] for r in recs if r["event"] == "skipped"] == run_.NAN_AT
    assert recs[-1] == {**recs[-1], "event": "close", "steps": run_.STEPS}
    run = runlog.load_run(log)
    assert [a.step for a in run.anomalies] == run_.NAN_AT and run.closed
    assert any("after the write error" in problem for problem in run.problems)


def _parses(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------- 7. the user's peak memory
class _Allocator:
    """The caching allocator's two numbers per kind as torch keeps them: current and peak-since-reset."""

    def __init__(self) -> None:
        self.current = {"allocated_bytes": 0, "reserved_bytes": 0}
        self.peak = dict(self.current)

    def malloc(self, n: int) -> None:
        for kind in self.current:
            self.current[kind] += n
            self.peak[kind] = max(self.peak[kind], self.current[kind])

    def free(self, n: int) -> None:
        for kind in self.current:
            self.current[kind] -= n

    def stats(self, device: Any) -> dict[str, Any]:
        return {k: {"all": {"current": self.current[k], "peak": self.peak[k]}} for k in self.current}

def test_the_exporters_memory_reading_leaves_the_users_peak_alone():
    from ampguard.exporters.memory import MemoryPeaks

    alloc = _Allocator()
    peaks = MemoryPeaks("cuda:0", stats=alloc.stats)
    alloc.malloc(512 << 20)  # the user's own peak, before the guarded steps
    alloc.free(512 << 20)
    seen = []
    for activations in (64 << 20, 64 << 20, 256 << 20, 64 << 20):  # one step each
        alloc.malloc(activations)
        alloc.free(activations)
        seen.append(peaks.read()[0])  # type: ignore[index]
    # the high-water mark, and the user's peak intact (nothing is ever reset)
    assert seen == [512 << 20] * 4 and alloc.peak["allocated_bytes"] == 512 << 20
    assert MemoryPeaks("cpu", stats=alloc.stats).read() is None  # off CUDA: nothing rather than a wrong number


def test_memory_tracking_settings():
    for old in ("track_memory", "memory_peak_per_step"):  # the exporters read memory themselves
        with pytest.raises(TypeError, match=rf"GuardConfig has no field '{old}' any more"):
            ampguard.GuardConfig(**{old: True})
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model)
    guarded_steps(opt, model, make_data(1))
    assert not hasattr(opt.last_report, "memory_allocated_peak")  # the exporters read memory, not the guard


# ---------------------------------------------------------------------------------- 9. the bind address
def test_default_bind_is_every_interface_documented_and_loopback_is_one_argument_away():
    from ampguard.exporters import PrometheusExporter

    doc = " ".join((PrometheusExporter.__doc__ or "").split())
    assert 'The default, ``"0.0.0.0"``, is every IPv4 interface' in doc
    assert "run id" in doc and 'addr="127.0.0.1"' in doc
    readme = (REPO / "README.md").read_text()
    monitoring = readme[readme.index("## Monitoring"):readme.index("## The `ampguard` command")]
    assert "binds `0.0.0.0` by default" in monitoring and 'addr="127.0.0.1"' in monitoring
    default, loopback = PrometheusExporter(port=0), PrometheusExporter(port=0, addr="127.0.0.1")
    try:
        default.start(local_rank=0)
        loopback.start(local_rank=0)
        assert default._server.server_address[0] == "0.0.0.0"
        assert loopback._server.server_address[0] == "127.0.0.1" and loopback.url.startswith("http://127.0.0.1:")
    finally:
        default.close()
        loopback.close()
