"""``ampguard report --plot``: no anomaly note hides behind a legend or runs off the figure.

Checked from matplotlib's own window extents of the drawn artists, on a real guarded run whose
anomalies crowd the right edge (the last step goes wrong) and on a long synthetic log with 200
anomalies written through ``JsonlExporter`` (``benchmarks/long_run_log.py``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import ampguard
from ampguard import faults, runlog
from ampguard.exporters import JsonlExporter

from ._models import guarded_steps, make_data, make_model, make_opt

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.text import Annotation  # noqa: E402

from ampguard.runlog import plotting  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _long_run_module():
    spec = importlib.util.spec_from_file_location("long_run_log", REPO / "benchmarks" / "long_run_log.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def _real_run(out: Path, steps: int = 30) -> Path:
    """A guarded fp16 run whose anomalies come in a burst and at the very last step (the right edge,
    where the legends sat)."""
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=4),
                        exporters=[JsonlExporter(str(out) + "/", every_step=True)])
    with faults.inject(opt, model, faults.loss("nan", steps=[4]), faults.grad("2.weight", "inf", steps=[10, 11, 12]),
                       faults.output("0", "nan", steps=[steps - 3]), faults.grad("0.weight", "nan", steps=[steps - 1])):
        guarded_steps(opt, model, make_data(steps))
    opt.close()
    return out


def _check_notes(run: runlog.Run) -> list[Annotation]:
    fig = plotting.figure(run)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        page = fig.bbox
        notes = [t for ax in fig.axes for t in ax.texts if isinstance(t, Annotation)]
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
        assert legends, "nothing to check against"
        boxes = [n.get_window_extent(renderer) for n in notes]
        legend_boxes = [g.get_window_extent(renderer) for g in legends]
        for note, box in zip(notes, boxes):
            text = note.get_text()
            assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, \
                f"note {text!r} at {box} runs off the figure {page}"
            for legend, lbox in zip(legends, legend_boxes):
                assert not box.overlaps(lbox), f"note {text!r} is behind a legend ({legend.get_texts()[0].get_text()})"
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                assert not boxes[i].overlaps(boxes[j]), (notes[i].get_text(), notes[j].get_text())
        # Every anomaly is in some note (a shared note counts each one it stands for).
        counts = [int(n.get_gid().split(":")[1]) for n in notes if (n.get_gid() or "").startswith("anomaly-note:")]
        assert len(counts) == len(notes) and sum(counts) == len(run.anomalies) > 0
        # Tick labels (the non-finite panel's row labels grow with the counts) stay on the page too.
        for ax in fig.axes:
            assert ax.get_tightbbox(renderer).x0 >= page.x0, ax.get_title()
        return notes
    finally:
        matplotlib.pyplot.close(fig)


def test_notes_of_a_real_run_stay_on_the_figure_and_clear_of_legends(tmp_path):
    run = runlog.load_run(_real_run(tmp_path / "run"))
    steps = {a.step for a in run.anomalies}
    assert {4, 10, 11, 12, 29} <= steps  # the burst and the last step really went wrong
    notes = _check_notes(run)
    assert any("rank" in n.get_text() or "module" in n.get_text() for n in notes)


def test_notes_of_a_long_run_with_200_anomalies(tmp_path):
    out = _long_run_module().write(tmp_path / "long", steps=2000, anomalies=200, ranks=1)
    run = runlog.load_run(out)
    assert len(run.anomalies) == 200 and run.ranks[0].steps_seen == 2000
    notes = _check_notes(run)
    assert 1 < len(notes) < 200  # crowded anomalies share notes; the notes say how many each holds
    assert any(n.get_text().startswith("steps ") for n in notes)
