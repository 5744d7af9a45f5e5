"""One real guarded fp16 CPU training, logged by JSONL and by the exporter under test side by side.

Nothing is injected: at the default scale (65536) step 3's scaled gradients overflow fp16 (a genuine
overflow: skipped, the scale backs off), and step 4's inputs are scaled by 1e30, which overflows the
fp16 forward (a genuine non-finite loss). Every exporter must show the same steps and values as the
JSONL log of the same run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ampguard
from ampguard.exporters import JsonlExporter

from ._models import loss_of, make_data, make_model, make_opt

STEPS = 10
BIG_INPUT_AT = 4
#: StepReport fields every run tracker logs on every step, as ``ampguard/<field>`` (booleans as 0/1).
FIELDS = ("skipped", "loss", "loss_scale", "next_loss_scale", "grad_norm", "nonfinite_grads", "nonfinite_loss",
          "clip_coef", "scale_backoff", "scale_growth")


def train(out: Path, *exporters: Any, steps: int = STEPS,
          after_step: Callable[[int], None] | None = None) -> tuple[ampguard.GuardedOptimizer, list[dict[str, Any]]]:
    """Train with ``exporters`` beside ``JsonlExporter(out/events.jsonl, every_step=True)``; closed.
    ``after_step(step)`` runs after each step. Returns the guard and the JSONL log's step records
    (``step`` and ``skipped`` events), one per step."""
    model = make_model()
    log = out / "events.jsonl"
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16",
                        exporters=[JsonlExporter(log, every_step=True), *exporters])
    for i, (x, y) in enumerate(make_data(steps)):
        if i == BIG_INPUT_AT:
            x = x * 1e30
        with opt.autocast():
            loss = loss_of(model, x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(i)
    opt.close()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps_logged = [r for r in records if r["event"] in ("step", "skipped")]
    assert [r["step"] for r in steps_logged] == list(range(steps))
    kinds = {a["kind"] for a in records if a["event"] == "anomaly"}
    assert {"overflow", "nonfinite_loss"} <= kinds, kinds  # the run really went non-finite, twice
    return opt, steps_logged


def number(value: Any) -> float:
    """A JSONL value as a float ("nan"/"inf"/"-inf" strings, booleans as 0/1)."""
    return float(value)


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def expected(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """``ampguard/<field>`` -> [(step, value)] from the JSONL records."""
    return {f"ampguard/{f}": [(r["step"], number(r[f])) for r in records] for f in FIELDS}
