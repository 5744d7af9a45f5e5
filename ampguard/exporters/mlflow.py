"""MlflowExporter: the guard's per-step numbers as metrics of an MLflow run.

mlflow is optional (``pip install 'ampguard[mlflow]'``: the ``mlflow-skinny`` client); it is imported
when the exporter is made, never by ``import ampguard``.

Metrics: ``ampguard/<field>`` for each number of the step's :class:`~ampguard.report.StepReport`
(the values its JSONL ``step``/``skipped`` record holds: ``ampguard/loss``, ``ampguard/loss_scale``,
``ampguard/grad_norm``, ``ampguard/skipped`` as 0/1, ...; NaN and inf as they are) and
``ampguard/anomalies``, each at ``step=`` the guard's step and ``timestamp=`` the report's wall time.
Params: the run's facts (``ampguard.run_id``, ``ampguard.precision``, ``ampguard.torch_version``, ...).

The metrics of a step are handed to MLflow's asynchronous logging (``log_batch(synchronous=False)``):
its own thread batches and sends them, so a slow or unreachable tracking server does not hold the
training step; ``flush()`` and ``close()`` wait for them. A failed send is raised on the training
thread by a later ``export()``, ``flush()`` or ``close()`` (``MultiExporter`` reports it and retries);
the steps of a failed send are not sent again (the JSONL log keeps them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import BackendUnavailableError
from ..report import Anomaly, RunInfo, StepReport
from ._scalars import STEP_KEY, run_params, step_scalars

__all__ = ["MlflowExporter"]


def _mlflow() -> Any:
    try:
        import mlflow
        import mlflow.entities
        import mlflow.tracking
    except ImportError as exc:
        raise BackendUnavailableError(
            "MlflowExporter needs the mlflow package: pip install 'ampguard[mlflow]'") from exc
    return mlflow


class MlflowExporter:
    """Log the guard's reports to an MLflow run.

    - ``tracking_uri``: where runs are kept (``"file:./mlruns"``, ``"http://host:5000"``, ...).
      None: MLflow's own default (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``).
    - ``run_id``: a run to log into (it is left running at ``close()``: it is yours). None: the
      active run (``mlflow.active_run()``, e.g. the transformers Trainer's) when there is one, else
      the exporter creates a run in ``experiment`` in ``open()`` and ends it in ``close()``.
    - ``experiment``: the experiment's name for a run the exporter creates (made if missing;
      None: MLflow's default experiment).
    - ``all_ranks``: False (default) logs from rank 0 only (every rank holds the same global
      decision); True creates one run per rank, named ``<run id>-rank<R>`` and tagged ``ampguard.rank``.

    Cost per step: building about 15 ``Metric`` entries and a queue put (MLflow's logging thread sends them).
    """

    def __init__(self, tracking_uri: str | None = None, *, run_id: str | None = None, experiment: str | None = None,
                 all_ranks: bool = False) -> None:
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.experiment = experiment
        self.all_ranks = all_ranks
        self.active_run_id: str | None = None
        """The run the exporter logs into (None before ``open()`` and on ranks that do not log)."""
        self._client: Any = None
        self._owned = False
        self._pending: list[Any] = []
        _mlflow()  # fail at construction, naming the extra, when mlflow is missing

    def open(self, info: RunInfo) -> None:
        if info.rank != 0 and not self.all_ranks:
            return  # which rank logs is decided once, here
        mlflow = _mlflow()
        self._end()  # opened again after a failure
        client = mlflow.tracking.MlflowClient(self.tracking_uri)
        run_id = self.run_id
        active = mlflow.active_run() if self.tracking_uri is None else None
        owned = run_id is None and active is None
        if run_id is None and active is not None:
            run_id = active.info.run_id
        if run_id is None:
            experiment_id = None
            if self.experiment is not None:
                found = client.get_experiment_by_name(self.experiment)
                experiment_id = found.experiment_id if found else client.create_experiment(self.experiment)
            name = f"{info.run_id}-rank{info.rank}" if self.all_ranks else info.run_id
            tags = {"ampguard.run_id": info.run_id, "ampguard.rank": str(info.rank)}
            run_id = client.create_run(experiment_id or "0", run_name=name, tags=tags).info.run_id
        params = [mlflow.entities.Param(k, v) for k, v in run_params(info).items()]
        client.log_batch(run_id, params=params)
        self._client, self.active_run_id, self._owned = client, run_id, owned

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        if self._client is None:
            return
        metric = _mlflow().entities.Metric
        ms = int(1000 * (report.wall_time or time.time()))
        step = report.step
        metrics = [metric(k, v, ms, step) for k, v in step_scalars(report, anomalies).items() if k != STEP_KEY]
        self._pending.append(self._client.log_batch(self.active_run_id, metrics=metrics, synchronous=False))
        if len(self._pending) >= 64:
            self._reap()

    def _reap(self) -> None:
        """Drop the sends that are done (the handles stay bounded); raise the first that failed."""
        keep, error = [], None
        for operations in self._pending:
            if all(f.done() for f in getattr(operations, "_operation_futures", ())):
                try:
                    operations.wait()
                except Exception as exc:
                    error = error or exc
            else:
                keep.append(operations)
        self._pending = keep
        if error is not None:
            raise error

    def flush(self) -> None:
        """Return once MLflow has sent every step handed to it (raises a failed send)."""
        pending, self._pending = self._pending, []
        for operations in pending:
            operations.wait()

    def close(self) -> None:
        if self._client is None:
            return
        try:
            self.flush()
        finally:
            self._end()

    def _end(self) -> None:
        client, run_id, owned = self._client, self.active_run_id, self._owned
        self._client, self.active_run_id, self._owned, self._pending = None, None, False, []
        if client is not None and owned and run_id is not None:
            client.set_terminated(run_id)

    def __repr__(self) -> str:
        return f"MlflowExporter({self.tracking_uri!r}, all_ranks={self.all_ranks})"
