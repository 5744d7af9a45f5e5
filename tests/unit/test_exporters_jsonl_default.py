"""A JsonlExporter made with its defaults keeps a complete event log: every step, so ``ampguard report
--plot`` draws the loss, loss-scale and gradient-norm lines (not only the skipped steps' dots)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import ampguard
from ampguard import runlog
from ampguard.exporters import JsonlExporter
from ampguard.runlog.plotting import _series

from ._models import loss_of, make_data, make_model, make_opt
from ._tracked_run import BIG_INPUT_AT

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


def _run(out: Path) -> ampguard.GuardedOptimizer:
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16", exporters=[JsonlExporter(str(out) + "/")])
    for i, (x, y) in enumerate(make_data(STEPS)):
        with opt.autocast():
            loss = loss_of(model, x * 1e30 if i == BIG_INPUT_AT else x, y)  # a genuine non-finite loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    opt.close()
    return opt


def test_the_default_log_holds_every_step_and_the_report_draws_its_lines(tmp_path):
    opt = _run(tmp_path)
    assert opt.history[BIG_INPUT_AT].skipped
    run = runlog.load_run(tmp_path)
    (log,) = run.ranks.values()
    assert log.every_step and [r.step for r in log.reports] == list(range(STEPS))
    for attr in ("loss", "loss_scale", "grad_norm"):
        ((_, _, xs, _),) = _series([log], attr, positive=attr != "loss")
        finite = [r.step for r in opt.history if math.isfinite(getattr(r, attr))]
        assert xs == finite, attr  # a point for every step with a finite value: a line, not the skips alone
    p = subprocess.run([sys.executable, "-m", "ampguard.runlog", str(tmp_path), "--plot", str(tmp_path / "r.png"),
                        "--json"], capture_output=True, text=True, cwd=REPO, timeout=240)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "r.png").stat().st_size > 0
    rank = json.loads(p.stdout)["ranks"]["0"]
    assert rank["logged_steps"] == rank["steps"] == STEPS and rank["every_step"]
