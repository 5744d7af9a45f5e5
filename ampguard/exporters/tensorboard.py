"""TensorBoardExporter: scalars per step and per-parameter gradient-norm histograms.

tensorboard is optional (``pip install 'ampguard[tensorboard]'``); it is imported when the
exporter opens, never by ``import ampguard``.

Tags (under ``ampguard/``): ``loss``, ``loss_scale`` (the scale that multiplied the step's
loss, as ``StepReport.loss_scale``), ``grad_norm``, ``skipped`` (0/1 per step),
``skipped_steps`` (running total), ``nonfinite_grads`` (tensors this step),
``nonfinite_steps`` (running total), ``module_grad_norm/<module>`` and
``module_update_ratio/<module>`` (the leading indicators, on the steps ``GuardConfig.numerics_every``
samples); histograms ``param_grad_norms`` (every parameter's
norm, one histogram) and ``grad_norm/<param name>`` (one per parameter), written every
``histogram_every`` steps from ``StepReport.param_norms`` (finite values only; those steps
need ``GuardConfig.param_norms_every`` to deliver norms). A non-finite loss or norm is not
written as a scalar: the step shows up in ``skipped`` and ``nonfinite_*`` instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from ..errors import BackendUnavailableError
from ..records import Anomaly, RunInfo, StepReport
from ._fp8 import fp8_scalars

__all__ = ["TensorBoardExporter"]

#: (tag, ``StepReport`` field) of the scalars written only when finite.
_FINITE_SCALARS = (
    ("ampguard/loss", "loss"),
    ("ampguard/loss_scale", "loss_scale"),
    ("ampguard/grad_norm", "grad_norm"),
)


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # tensorboard not installed
        raise BackendUnavailableError(
            "TensorBoardExporter needs the tensorboard package: pip install 'ampguard[tensorboard]'"
        ) from exc
    return SummaryWriter


class TensorBoardExporter:
    """Write the guard's reports as TensorBoard events.

    - ``log_dir``: where rank 0 writes (``all_ranks=True``: rank R writes ``log_dir/rank{R}``).
    - ``all_ranks``: False (default) exports from rank 0 only (every rank holds the same global
      decision); True gives every rank its own run directory.
    - ``histogram_every``: per-parameter grad-norm histograms on steps ``s % N == 0`` that carry
      per-parameter norms (None: never).
    - ``flush_secs``: passed to ``SummaryWriter``.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        all_ranks: bool = False,
        histogram_every: int | None = 100,
        *,
        flush_secs: int = 30,
    ) -> None:
        if histogram_every is not None and not (isinstance(histogram_every, int) and histogram_every >= 1):
            raise ValueError(f"TensorBoardExporter histogram_every={histogram_every!r}; allowed: None or an int >= 1")
        self.log_dir = os.fspath(log_dir)
        self.all_ranks = all_ranks
        self.histogram_every = histogram_every
        self.flush_secs = flush_secs
        self.run_dir: str | None = None
        self._writer: Any = None
        self._names: tuple[str, ...] = ()
        self._skipped = 0
        self._nonfinite = 0
        _summary_writer()  # fail at construction, naming the extra, when tensorboard is missing

    def open(self, info: RunInfo) -> None:
        if info.rank != 0 and not self.all_ranks:
            return  # which rank logs is decided once, here
        self.run_dir = os.path.join(self.log_dir, f"rank{info.rank}") if self.all_ranks else self.log_dir
        self._names = info.param_names
        self._writer = _summary_writer()(log_dir=self.run_dir, flush_secs=self.flush_secs)
        self._writer.add_text("ampguard/run", _run_text(info), 0)

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        w = self._writer
        if w is None:
            return
        s = report.step
        if report.skipped:
            self._skipped += 1
        if report.nonfinite:
            self._nonfinite += 1
        t = report.wall_time or None
        for tag, field in _FINITE_SCALARS:
            value = getattr(report, field)
            if value is not None and math.isfinite(value):  # a loss not given to the guard is None
                w.add_scalar(tag, value, s, walltime=t)
        w.add_scalar("ampguard/skipped", float(report.skipped), s, walltime=t)
        w.add_scalar("ampguard/skipped_steps", self._skipped, s, walltime=t)
        w.add_scalar("ampguard/nonfinite_grads", report.nonfinite_grads, s, walltime=t)
        w.add_scalar("ampguard/nonfinite_steps", self._nonfinite, s, walltime=t)
        if report.grad_zero_fraction is not None:
            self._numerics(report, t)
        for prefix, values in (("ampguard/module_grad_norm/", report.module_grad_norms),
                               ("ampguard/module_update_ratio/", report.module_update_ratios)):
            for module, value in values or ():
                if math.isfinite(value):
                    w.add_scalar(prefix + module, value, s, walltime=t)
        for tag, value in fp8_scalars(report.fp8).items():  # ampguard/fp8/<module>/<role>/amax ..., bounded
            if math.isfinite(value):
                w.add_scalar(tag, value, s, walltime=t)
        every = self.histogram_every
        if every is not None and report.param_norms is not None and s % every == 0:
            self._histograms(report)

    def _numerics(self, report: StepReport, t: float | None) -> None:
        """A step sampled by ``GuardConfig.numerics_every``: ``ampguard/grad_zero_fraction`` (every
        gradient), ``ampguard/grad_zero_fraction/group<i>``, ``ampguard/loss_scale_headroom_log2``
        (fp16; finite values only, as every scalar here)."""
        values = [("ampguard/grad_zero_fraction", report.grad_zero_fraction)]
        groups = report.group_zero_fractions or ()
        values += [(f"ampguard/grad_zero_fraction/group{i}", v) for i, v in enumerate(groups)]
        if report.headroom_log2 is not None:
            values.append(("ampguard/loss_scale_headroom_log2", report.headroom_log2))
        for tag, value in values:
            if value is not None and math.isfinite(value):
                self._writer.add_scalar(tag, value, report.step, walltime=t)

    def _histograms(self, report: StepReport) -> None:
        import numpy as np

        assert report.param_norms is not None
        finite = [(i, n) for i, n in enumerate(report.param_norms) if math.isfinite(n)]
        if not finite:
            return
        self._writer.add_histogram(
            "ampguard/param_grad_norms", np.asarray([n for _, n in finite], dtype=np.float64), report.step
        )
        for i, n in finite:
            name = self._names[i] if i < len(self._names) else f"param{i}"
            self._writer.add_histogram(f"ampguard/grad_norm/{name}", np.asarray([n]), report.step)

    def close(self) -> None:
        w, self._writer = self._writer, None
        if w is not None:
            w.flush()
            w.close()

    def __repr__(self) -> str:
        return f"TensorBoardExporter({self.log_dir!r}, all_ranks={self.all_ranks})"


def _run_text(info: RunInfo) -> str:
    rows = [f"| {k} | {v} |" for k, v in info.to_dict().items() if k != "param_names"]
    return "| field | value |\n|---|---|\n" + "\n".join(rows)
