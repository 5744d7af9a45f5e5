"""WandbExporter: the guard's per-step numbers in a Weights & Biases run.

wandb is optional (``pip install 'ampguard[wandb]'``); it is imported when the exporter is made,
never by ``import ampguard``.

Keys: ``ampguard/<field>`` for each number of the step's :class:`~ampguard.report.StepReport` (the
values its JSONL ``step``/``skipped`` record holds: ``ampguard/loss``, ``ampguard/loss_scale``,
``ampguard/grad_norm``, ``ampguard/skipped`` as 0/1, ...; NaN and inf as they are) and
``ampguard/anomalies`` (anomalies recorded on the step). Every ``ampguard/*`` key is plotted against
``ampguard/step``, the guard's step (``define_metric``), so the run's own ``wandb.log`` calls and
their step counter are left alone. The run's facts (:class:`~ampguard.report.RunInfo`) go to the run's
config under ``ampguard``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import BackendUnavailableError
from ..report import Anomaly, RunInfo, StepReport
from ._scalars import KEY_PREFIX, STEP_KEY, run_params, step_scalars

__all__ = ["WandbExporter"]


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise BackendUnavailableError("WandbExporter needs the wandb package: pip install 'ampguard[wandb]'") from exc
    return wandb


class WandbExporter:
    """Log the guard's reports to a W&B run.

    - ``run``: a run to log into (it stays open at ``close()``: it is yours). None: the active run
      (``wandb.run``, e.g. the transformers Trainer's) when there is one, else the exporter starts one
      with ``wandb.init(**init_kwargs)`` in ``open()`` and finishes it in ``close()``.
    - ``all_ranks``: False (default) logs from rank 0 only (every rank holds the same global decision;
      the per-rank view is the Prometheus/OpenTelemetry exporters'); True starts one run per rank,
      grouped by the guard's run id (``group=``, ``name=<run id>-rank<R>``).
    - ``init_kwargs``: passed to ``wandb.init`` (``project=``, ``dir=``, ``mode="offline"``, ``settings=``...).

    Cost per step: one ``run.log`` of about 15 numbers (wandb hands it to its own service process).
    ``wandb.init`` in online mode waits for the server (``settings=wandb.Settings(init_timeout=...)``).
    """

    def __init__(self, run: Any = None, *, all_ranks: bool = False, **init_kwargs: Any) -> None:
        self.run = run
        self.all_ranks = all_ranks
        self.init_kwargs = init_kwargs
        self._run: Any = None
        self._owned = False
        _wandb()  # fail at construction, naming the extra, when wandb is missing

    def open(self, info: RunInfo) -> None:
        if info.rank != 0 and not self.all_ranks:
            return  # which rank logs is decided once, here
        self._finish()  # opened again after a failure: a run of our own is started afresh
        wandb = _wandb()
        run = self.run if self.run is not None else wandb.run
        if run is None:
            kw: dict[str, Any] = {"config": {"ampguard": run_params(info)}}
            if self.all_ranks:
                kw.update(group=info.run_id, name=f"{info.run_id}-rank{info.rank}")
            kw.update(self.init_kwargs)
            run = wandb.init(**kw)
            self._owned = True
        else:
            run.config.update({"ampguard": run_params(info)}, allow_val_change=True)
        run.define_metric(STEP_KEY)
        run.define_metric(KEY_PREFIX + "*", step_metric=STEP_KEY)
        self._run = run

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        if self._run is not None:
            self._run.log(step_scalars(report, anomalies))

    def close(self) -> None:
        self._finish()

    def _finish(self) -> None:
        run, owned, self._run, self._owned = self._run, self._owned, None, False
        if run is not None and owned:
            run.finish()

    def __repr__(self) -> str:
        return f"WandbExporter(all_ranks={self.all_ranks})"
