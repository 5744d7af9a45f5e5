"""The per-step numbers the run trackers (W&B, MLflow) log: a :class:`~ampguard.records.StepReport`'s
own fields, each under ``ampguard/<field>``, the values the JSONL log holds for the same step."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from ..errors import BackendUnavailableError
from ..records import Anomaly, RunInfo, StepReport
from ._fp8 import fp8_scalars

__all__ = ["KEY_PREFIX", "STEP_KEY", "optional_module", "run_params", "step_scalars"]

KEY_PREFIX = "ampguard/"
STEP_KEY = KEY_PREFIX + "step"
"""The guard's step number (W&B's x-axis for every ``ampguard/*`` key; MLflow's ``step``)."""

#: Fields logged on every step (booleans as 0/1).
_EVERY_STEP = ("skipped", "loss_scale", "next_loss_scale", "grad_norm", "nonfinite_grads", "nonfinite_loss",
               "clip_coef", "grad_spike", "loss_spike", "scale_backoff", "scale_growth")
#: Fields logged on the steps that carry them (the loss when one was given, sampled numerics, adaptive
#: thresholds).
_WHEN_SET = ("loss", "grad_zero_fraction", "headroom_log2", "spike_threshold", "clip_threshold")
#: Fields of (name, value) pairs: one key per name, ``ampguard/<field>/<name>``.
_PER_NAME = ("module_grad_norms", "module_update_ratios")


def step_scalars(report: StepReport, anomalies: Sequence[Anomaly]) -> dict[str, float]:
    """``{"ampguard/step": step, "ampguard/loss": ..., ..., "ampguard/anomalies": n}`` for one step.
    Non-finite values stay as they are (NaN, inf): the same numbers as the JSONL log."""
    out: dict[str, float] = {STEP_KEY: report.step}
    for field in _EVERY_STEP:
        out[KEY_PREFIX + field] = float(getattr(report, field))
    for field in _WHEN_SET:
        value = getattr(report, field)
        if value is not None:
            out[KEY_PREFIX + field] = float(value)
    for i, value in enumerate(report.group_zero_fractions or ()):
        out[f"{KEY_PREFIX}group_zero_fractions/{i}"] = float(value)
    for field in _PER_NAME:
        for name, value in getattr(report, field) or ():
            out[f"{KEY_PREFIX}{field}/{name}"] = float(value)
    out.update(fp8_scalars(report.fp8, KEY_PREFIX))  # bounded: metrics.FP8_MODULES modules + "_other"
    out[KEY_PREFIX + "anomalies"] = float(len(anomalies))
    return out


def run_params(info: RunInfo) -> dict[str, str]:
    """The run's facts as flat strings (``ampguard.run_id``, ``ampguard.precision``, ``ampguard.torch_version``...)."""
    out = {f"ampguard.{k}": str(v) for k, v in info.to_dict().items()
           if k not in ("param_names", "versions", "modules")}
    out.update({f"ampguard.{pkg}_version": str(v) for pkg, v in info.versions})
    return out


def optional_module(exporter: str, extra: str, *names: str) -> Any:
    """Import ``names`` (an optional backend and the submodules used) and return the first; a missing
    one raises :class:`~ampguard.errors.BackendUnavailableError` naming the pip extra."""
    try:
        modules = [importlib.import_module(name) for name in names]
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{exporter} needs the {extra} package: pip install 'ampguard[{extra}]'") from exc
    return modules[0]
