"""WandbExporter: the guard's per-step numbers in a Weights & Biases run.

wandb is optional (``pip install 'ampguard[wandb]'``); it is imported when the exporter is made,
never by ``import ampguard``.

Keys: ``ampguard/<field>`` for each number of the step's :class:`~ampguard.records.StepReport` (the
values its JSONL ``step``/``skipped`` record holds: ``ampguard/loss``, ``ampguard/loss_scale``,
``ampguard/grad_norm``, ``ampguard/skipped`` as 0/1, ...; NaN and inf as they are) and
``ampguard/anomalies`` (anomalies recorded on the step). Every ``ampguard/*`` key is plotted against
``ampguard/step``, the guard's step (``define_metric``), so the run's own ``wandb.log`` calls and
their step counter are left alone. The run's facts (:class:`~ampguard.records.RunInfo`) go to the run's
config under ``ampguard``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..records import Anomaly, RunInfo, StepReport
from ._scalars import KEY_PREFIX, STEP_KEY, optional_module, run_params, step_scalars
from ._sender import QueuedExporter

__all__ = ["WandbExporter"]


def _wandb() -> Any:
    return optional_module("WandbExporter", "wandb", "wandb")


class WandbExporter(QueuedExporter):
    """Log the guard's reports to a W&B run.

    - ``run``: a run to log into (it stays open at ``close()``: it is yours). None: the active run
      (``wandb.run``, e.g. the transformers Trainer's) when there is one, else the exporter starts one
      with ``wandb.init(**init_kwargs)`` and finishes it in ``close()``.
    - ``all_ranks``: False (default) logs from rank 0 only (every rank holds the same global decision;
      the per-rank view is the Prometheus/OpenTelemetry exporters'); True starts one run per rank,
      grouped by the guard's run id (``group=``, ``name=<run id>-rank<R>``).
    - ``timeout_s``: how long ``flush()`` and ``close()`` wait at most for the queued steps.
    - ``init_kwargs``: passed to ``wandb.init`` (``project=``, ``dir=``, ``mode="offline"``, ``settings=``...).

    ``wandb.init``, ``run.log`` and ``run.finish`` are called by a background thread
    (:class:`~ampguard.exporters._sender.Sender`), never on the training step: ``wandb.init`` waits up
    to its ``init_timeout`` (90 s) for a server that does not answer, and the training goes on meanwhile;
    the steps wait in a queue (the last :attr:`BACKLOG`) and are logged, in order, once the run is up.
    A failure is raised once by the next ``export()``, ``flush()`` or ``close()`` (``MultiExporter``
    reports it in one line and retries) and retried by the thread with backoff.

    Cost per step: building a dict of about 15 numbers and a queue append.
    """

    def __init__(self, run: Any = None, *, all_ranks: bool = False, timeout_s: float = 30.0,
                 **init_kwargs: Any) -> None:
        self.run = run
        self.init_kwargs = init_kwargs
        super().__init__(all_ranks=all_ranks, timeout_s=timeout_s)
        self.active_run: Any = None
        """The run the exporter logs into, once the thread has it."""
        _wandb()  # fail at construction, naming the extra, when wandb is missing

    def open(self, info: RunInfo) -> None:
        """Queue the run's start (or find the run to log into); returns at once."""
        if self._opens(info):  # which rank logs is decided once, here
            self._begin("ampguard-wandb", info, self.run if self.run is not None else _wandb().run)

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        self._queue(step_scalars(report, anomalies))

    # ------------------------------------------------------------------ the sender thread
    def _log(self, steps: list[Any]) -> int:
        for values in steps:
            self.active_run.log(values)
        return len(steps)

    def _end_run(self) -> None:
        self.active_run.finish()

    def _start_run(self, run: Any) -> None:
        info = self._info
        assert info is not None  # internal: queued by open()
        if run is None:
            run = self.active_run
        if run is None:
            kw: dict[str, Any] = {"config": {"ampguard": run_params(info)}}
            if self.all_ranks:
                kw.update(group=info.run_id, name=f"{info.run_id}-rank{info.rank}")
            kw.update(self.init_kwargs)
            run = _wandb().init(**kw)
        else:
            run.config.update({"ampguard": run_params(info)}, allow_val_change=True)
        run.define_metric(STEP_KEY)
        run.define_metric(KEY_PREFIX + "*", step_metric=STEP_KEY)
        self.active_run = run

    def __repr__(self) -> str:
        return f"WandbExporter(all_ranks={self.all_ranks})"
