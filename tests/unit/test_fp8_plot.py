"""``ampguard report --plot``: the fp8 panel, drawn from a JSONL log of REAL torchao float8 training (CPU:
``Float8LinearConfig(emulate=True)``) measured by ``Fp8Monitor``, written by the real ``JsonlExporter`` and read
back by the run-log reader; and no fp8 panel, the other panels unchanged, for a log without fp8 casts."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

torchao_float8 = pytest.importorskip("torchao.float8")
matplotlib = pytest.importorskip("matplotlib")

from ampguard import runlog  # noqa: E402
from ampguard.exporters import JsonlExporter  # noqa: E402
from ampguard.fp8 import Fp8Monitor  # noqa: E402
from ampguard.records import FP8_ROLES, RunInfo, StepReport  # noqa: E402
from ampguard.runlog import plotting  # noqa: E402
from ampguard.vocab import SkipReason  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

TITLE = "fp8 casts"
NAN_AT = 7  # a real NaN in the batch: non-finite input and grad_output casts, the step skipped
TINY_AT = 9  # a sampled step whose loss is scaled by 1e-30: grad_output underflows to 0 in fp8 (finite)
EVERY = 3  # Fp8Monitor(numerics_every=...): the underflow ratio on steps 0, 3, 6, 9, ...


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(16, 32))
    model.add_module("act", torch.nn.ReLU())
    model.add_module("fc2", torch.nn.Linear(32, 16))
    return torchao_float8.convert_to_float8_training(model, config=torchao_float8.Float8LinearConfig(emulate=True))


def fp8_reports(steps: int = 12, nan_at: int = NAN_AT, tiny_at: int | None = TINY_AT, every: int = EVERY,
                outliers: range = range(0)) -> list[StepReport]:
    """Train the float8 model ``steps`` steps (AdamW), measuring every cast with ``Fp8Monitor``; one
    ``StepReport`` per step whose ``fp8`` is the decoded casts. A step with a non-finite cast is skipped, as the
    guard would. On the steps of ``outliers`` one input element is 1e5 (an activation outlier: the input's scale
    follows it, and the elements below amax / 2^17.8 flush to zero in e4m3). docs/fp8_report.png is
    ``fp8_reports(60, nan_at=41, tiny_at=None, every=5, outliers=range(25, 36))``, written by :func:`write_log`
    and drawn by ``ampguard report LOG --plot docs/fp8_report.png``."""
    model = _model()
    monitor = Fp8Monitor(model, numerics_every=every)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    reports = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=g)
        if step in outliers:
            x[0, 0] = 1e5
        if step == nan_at:
            x[3, 5] = math.nan
        monitor.begin_step(step)
        loss = model(x).square().mean()
        value = float(loss.detach())
        (loss * (1e-30 if step == tiny_at else 1.0)).backward()
        collected = monitor.collect()
        bad = monitor.nonfinite(collected).item() == 1.0
        casts = monitor.decode(collected.tolist())
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(gr) for gr in grads])))
        if not bad:
            opt.step()
        opt.zero_grad(set_to_none=True)
        reports.append(StepReport(
            step=step, skipped=bad, reason=SkipReason.NONFINITE_LOSS if bad else None, loss=value,
            loss_scale=1.0, next_loss_scale=1.0, grad_norm=norm,
            nonfinite_grads=sum(not bool(gr.isfinite().all()) for gr in grads), nonfinite_loss=not math.isfinite(value),
            wall_time=1000.0 + step, fp8=casts))
    monitor.close()
    return reports


def write_log(path: Path, reports: list[StepReport]) -> Path:
    """The reports as the real ``JsonlExporter`` writes them (healthy steps on its writer thread)."""
    exporter = JsonlExporter(path)
    exporter.open(RunInfo(run_id="fp8-plot", rank=0, local_rank=0, world_size=1, precision="bf16",
                          backend="local", device="cpu", param_names=(), versions=()))
    for report in reports:
        exporter.export(report, [])
    exporter.close()
    return path


def _titles(fig) -> list[str]:
    return [t for ax in fig.axes if (t := ax.get_title(loc="left"))]


def _lines(fig) -> dict[str, tuple[list[float], list[float]]]:
    """Every labelled line of the figure (the twin axes' too): label -> (x, y)."""
    return {line.get_label(): ([float(v) for v in line.get_xdata()], [float(v) for v in line.get_ydata()])
            for ax in fig.axes for line in ax.get_lines() if not line.get_label().startswith("_")}


@pytest.fixture(scope="module")
def reports() -> list[StepReport]:
    return fp8_reports()


def test_the_fp8_panel_draws_the_logged_casts(reports, tmp_path):
    run = runlog.load_run(write_log(tmp_path / "events.jsonl", reports))
    logged = [[c.to_dict() for c in r.fp8 or ()] for r in run.ranks[0].reports]
    assert logged == [[c.to_dict() for c in r.fp8 or ()] for r in reports]  # every cast, NaN as "nan"
    fig = plotting.figure(run)
    try:
        (ax,) = [ax for ax in fig.axes if ax.get_title(loc="left").startswith(TITLE)]
        assert ax is fig.axes[len(_titles(fig)) - 1]  # the last panel (twin axes come after the panels)
        assert ax.get_yscale() == "log"
        lines = _lines(fig)
        for role in FP8_ROLES:
            worst, under, bad = [], [], []
            for r in reports:
                casts = [c for c in r.fp8 or () if c.role == role]
                if any(c.finite for c in casts):
                    worst.append((r.step, max(c.amax for c in casts if c.finite)))
                if any(c.underflow is not None for c in casts):
                    under.append((r.step, max(c.underflow for c in casts if c.underflow is not None)))
                if not all(c.finite for c in casts):
                    bad.append(r.step)
            assert lines[f"{role} amax"] == ([x for x, _ in worst], [y for _, y in worst]), role
            assert lines[f"{role} underflow"] == ([x for x, _ in under], [y for _, y in under]), role
            assert [x for x, _ in under] == [s for s in range(len(reports)) if s % EVERY == 0]  # sampled steps
            assert lines.get(f"{role} non-finite cast", ([], []))[0] == bad, role
        # what the training did, seen in the panel: the NaN step's input and grad_output casts marked, the
        # weight's not; grad_output flushed to zero whole on the step whose loss was scaled by 1e-30
        assert lines["input non-finite cast"][0] == lines["grad_output non-finite cast"][0] == [NAN_AT]
        assert "weight non-finite cast" not in lines
        assert dict(zip(*lines["grad_output underflow"]))[TINY_AT] == 1.0
        assert NAN_AT not in lines["input amax"][0]
    finally:
        matplotlib.pyplot.close(fig)


def test_a_log_without_fp8_casts_draws_the_same_panels_without_the_fp8_one(reports, tmp_path):
    with_fp8 = runlog.load_run(write_log(tmp_path / "fp8.jsonl", reports))
    without = runlog.load_run(write_log(tmp_path / "plain.jsonl", [dataclasses.replace(r, fp8=None) for r in reports]))
    assert all(r.fp8 is None for r in without.ranks[0].reports)
    figs = [plotting.figure(run) for run in (with_fp8, without)]
    try:
        titles = [_titles(fig) for fig in figs]
        assert not any(t.startswith(TITLE) for t in titles[1])
        assert titles[0][:-1] == titles[1] and titles[0][-1].startswith(TITLE)
        plain = {k: v for k, v in _lines(figs[0]).items() if not k.startswith(FP8_ROLES)}
        assert plain == _lines(figs[1])  # the other panels draw the same lines
        assert figs[0].get_size_inches()[1] > figs[1].get_size_inches()[1]
    finally:
        for fig in figs:
            matplotlib.pyplot.close(fig)
