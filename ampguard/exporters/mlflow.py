"""MlflowExporter: the guard's per-step numbers as metrics of an MLflow run.

mlflow is optional (``pip install 'ampguard[mlflow]'``: the ``mlflow-skinny`` client); it is imported
when the exporter is made, never by ``import ampguard``.

Metrics: ``ampguard/<field>`` for each number of the step's :class:`~ampguard.records.StepReport`
(the values its JSONL ``step``/``skipped`` record holds: ``ampguard/loss``, ``ampguard/loss_scale``,
``ampguard/grad_norm``, ``ampguard/skipped`` as 0/1, ...; NaN and inf as they are) and
``ampguard/anomalies``, each at ``step=`` the guard's step and ``timestamp=`` the report's wall time.
Params: the run's facts (``ampguard.run_id``, ``ampguard.precision``, ``ampguard.torch_version``, ...).

Every call to the tracking server (creating the run, logging its params, sending metrics, ending
it) is made by a background thread (:class:`~ampguard.exporters._sender.Sender`), never on the
training step: ``open()`` and ``export()`` only queue, so a tracking server that is slow or down
(MLflow's HTTP client retries for about four minutes before it gives up) never holds training. The
thread sends the queued steps in batches (up to 1000 metrics a call). A failed call is kept and
retried by the thread (1 s doubling to 60 s), and raised once on the training thread by the next
``export()``, ``flush()`` or ``close()`` (``MultiExporter`` reports it in one line and retries); the
steps not yet sent stay queued (the last :attr:`MlflowExporter.BACKLOG`; older ones are dropped and
counted) and are sent, in order, once the server answers. ``flush()`` waits for every queued step
(at most ``timeout_s``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..records import Anomaly, RunInfo, StepReport
from ._scalars import STEP_KEY, optional_module, run_params, step_scalars
from ._sender import QueuedExporter

__all__ = ["MlflowExporter"]


def _mlflow() -> Any:
    return optional_module("MlflowExporter", "mlflow", "mlflow", "mlflow.entities", "mlflow.tracking")


class MlflowExporter(QueuedExporter):
    """Log the guard's reports to an MLflow run.

    - ``tracking_uri``: where runs are kept (``"http://host:5000"``, ``"sqlite:///mlflow.db"``,
      ``"file:./mlruns"``, ...). None: MLflow's own default (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``).
    - ``run_id``: a run to log into (it is left running at ``close()``: it is yours). None: the
      active run (``mlflow.active_run()``, e.g. the transformers Trainer's) when there is one, else
      the exporter creates a run in ``experiment`` and ends it in ``close()``.
    - ``experiment``: the experiment's name for a run the exporter creates (made if missing;
      None: MLflow's default experiment).
    - ``all_ranks``: False (default) logs from rank 0 only (every rank holds the same global
      decision); True creates one run per rank, named ``<run id>-rank<R>`` and tagged ``ampguard.rank``.
    - ``timeout_s``: how long ``flush()`` and ``close()`` wait at most for the queued steps.

    Cost per step: building a dict of about 15 numbers and a queue append (the sending is the thread's).
    """

    METRICS_PER_CALL = 1000
    """Metrics per ``log_batch`` call at most (MLflow's own limit for one request)."""

    def __init__(self, tracking_uri: str | None = None, *, run_id: str | None = None, experiment: str | None = None,
                 all_ranks: bool = False, timeout_s: float = 30.0) -> None:
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.experiment = experiment
        super().__init__(all_ranks=all_ranks, timeout_s=timeout_s)
        self.active_run_id: str | None = None
        """The run the exporter logs into, once the thread has it (None before, and on ranks that do not log)."""
        self._client: Any = None
        _mlflow()  # fail at construction, naming the extra, when mlflow is missing

    # ------------------------------------------------------------------ the training thread
    def open(self, info: RunInfo) -> None:
        """Queue the run's creation (or find the run to log into) and its params; returns at once."""
        if not self._opens(info):  # which rank logs is decided once, here
            return
        mlflow = _mlflow()
        run_id = self.run_id
        if run_id is None and self.tracking_uri is None:
            active = mlflow.active_run()  # the caller's thread's run: read here, not on the sender thread
            run_id = active.info.run_id if active is not None else None
        self._begin("ampguard-mlflow", info, run_id)

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        if self._sender is not None:
            ms = int(1000 * (report.wall_time or time.time()))
            values = {k: v for k, v in step_scalars(report, anomalies).items() if k != STEP_KEY}
            self._queue((report.step, ms, values))

    # ------------------------------------------------------------------ the sender thread
    def _log(self, steps: list[Any]) -> int:
        """One ``log_batch`` of the leading steps, up to :attr:`METRICS_PER_CALL` metrics."""
        metric = _mlflow().entities.Metric
        metrics: list[Any] = []
        done = 0
        for step, ms, values in steps:
            if metrics and len(metrics) + len(values) > self.METRICS_PER_CALL:
                break
            metrics += [metric(k, v, ms, step) for k, v in values.items()]
            done += 1
        self._client.log_batch(self.active_run_id, metrics=metrics)
        return done

    def _end_run(self) -> None:
        self._client.set_terminated(self.active_run_id)

    def _start_run(self, run_id: str | None) -> None:
        mlflow = _mlflow()
        info = self._info
        assert info is not None  # internal: queued by open()
        client = self._client = self._client or mlflow.tracking.MlflowClient(self.tracking_uri)
        if run_id is not None:
            self.active_run_id = run_id
        elif self.active_run_id is None:  # a retry after the run was made reuses it
            experiment_id = "0"
            if self.experiment is not None:
                found = client.get_experiment_by_name(self.experiment)
                experiment_id = found.experiment_id if found else client.create_experiment(self.experiment)
            name = f"{info.run_id}-rank{info.rank}" if self.all_ranks else info.run_id
            tags = {"ampguard.run_id": info.run_id, "ampguard.rank": str(info.rank)}
            self.active_run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        client.log_batch(self.active_run_id, params=[mlflow.entities.Param(k, v) for k, v in run_params(info).items()])

    def __repr__(self) -> str:
        return f"MlflowExporter({self.tracking_uri!r}, all_ranks={self.all_ranks})"
