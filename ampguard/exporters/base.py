"""The Exporter protocol, and the Null and Multi exporters.

An exporter sees plain-Python records only (:class:`~ampguard.report.RunInfo`,
:class:`~ampguard.report.StepReport`, :class:`~ampguard.report.Anomaly`): never a tensor,
an optimizer or a CUDA call. The guard talks to exactly one exporter, a :class:`MultiExporter`
that fans out and contains failures: an exporter that raises is reported once (a warning
and a log record naming it) and then skipped, so exporting can never break training.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from ..report import Anomaly, RunInfo, StepReport

__all__ = ["Exporter", "MultiExporter", "NullExporter"]

log = logging.getLogger("ampguard.exporters")


@runtime_checkable
class Exporter(Protocol):
    """Receives what the guard saw. Three methods; all may be no-ops."""

    def open(self, info: RunInfo) -> None:
        """Called once by ``wrap()``, before the first step, with facts about the run."""

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        """Called once per step, in step order, with that step's report and the anomalies
        recorded on it (often none). Runs on the training thread: keep it cheap."""

    def close(self) -> None:
        """Flush and release resources. Called by ``GuardedOptimizer.close()``."""


class NullExporter:
    """Does nothing. The default when no exporter is given."""

    def open(self, info: RunInfo) -> None:
        pass

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        pass

    def close(self) -> None:
        pass


def _is_exporter(obj: object) -> bool:
    return all(callable(getattr(obj, m, None)) for m in ("open", "export", "close"))


class MultiExporter:
    """Fans each call out to several exporters; a failing exporter is reported once and disabled."""

    def __init__(self, exporters: Iterable[Exporter] | Exporter) -> None:
        """``exporters``: exporters, or one exporter."""
        if _is_exporter(exporters):
            exporters = [exporters]  # type: ignore[list-item]
        elif isinstance(exporters, (str, bytes)) or not isinstance(exporters, Iterable):
            raise TypeError(f"exporters={exporters!r:.80}: pass an exporter or a list of them, e.g. "
                            "exporters=[ampguard.JsonlExporter('events.jsonl')]")
        self.exporters: list[Exporter] = list(exporters)  # type: ignore[arg-type]
        for e in self.exporters:
            if not _is_exporter(e):
                raise TypeError(
                    f"{e!r} is not an exporter: it needs open(info), export(report, anomalies) and "
                    "close() methods (see ampguard.exporters.Exporter)"
                )
        self._failed: set[int] = set()

    def _call(self, method: str, *args: object) -> None:
        for i, e in enumerate(self.exporters):
            if i in self._failed:
                continue
            try:
                getattr(e, method)(*args)
            except Exception as exc:  # an exporter must never break training
                self._failed.add(i)
                msg = (
                    f"ampguard: exporter {type(e).__name__}.{method}() failed and is disabled for the "
                    f"rest of the run: {type(exc).__name__}: {exc}"
                )
                log.error(msg, exc_info=exc)
                warnings.warn(msg, RuntimeWarning, stacklevel=3)

    @property
    def failed(self) -> list[Exporter]:
        """Exporters disabled after a failure."""
        return [self.exporters[i] for i in sorted(self._failed)]

    def open(self, info: RunInfo) -> None:
        self._call("open", info)

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        self._call("export", report, anomalies)

    def close(self) -> None:
        self._call("close")
