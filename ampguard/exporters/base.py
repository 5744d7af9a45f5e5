"""The Exporter protocol, and the Null and Multi exporters.

An exporter sees plain-Python records only (:class:`~ampguard.records.RunInfo`,
:class:`~ampguard.records.StepReport`, :class:`~ampguard.records.Anomaly`): never a tensor,
an optimizer or a CUDA call. The guard talks to exactly one exporter, a :class:`MultiExporter`
that fans out and contains failures: an exporter that raises is reported (a warning and a log
record naming it), set aside and retried with backoff while training goes on; the steps it
missed meanwhile are held (the last :attr:`MultiExporter.BACKLOG`) and handed to it, in order,
once a retry works. Exporting can never break training. Each exporter's health
(:class:`ExporterHealth`) is visible to the exporters that report it (the Prometheus exporter
serves it: :data:`ampguard.metrics.PER_EXPORTER`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from ..errors import AmpGuardError
from ..records import Anomaly, RunInfo, StepReport

__all__ = ["Exporter", "ExporterHealth", "MultiExporter", "NullExporter"]

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


@dataclasses.dataclass(slots=True)
class ExporterHealth:
    """One exporter's state as :class:`MultiExporter` sees it (plain values; read, never act)."""

    name: str
    """The exporter's class name (``JsonlExporter``; ``JsonlExporter#2`` for a second one)."""
    up: bool = True
    """False from a failed call until a retry works."""
    errors: int = 0
    """Failed calls so far (retries included)."""
    last_error: str = ""
    """The last failure, as ``Type: message``."""


@dataclasses.dataclass(slots=True)
class _Outage:
    """What a set-aside exporter needs to come back."""

    reopen: bool
    """Its open() failed: a retry opens it first."""
    backoff_s: float
    retry_at: float
    held: deque[tuple[StepReport, Sequence[Anomaly]]]
    dropped: int = 0


class MultiExporter:
    """Fans each call out to several exporters. One that raises is reported, set aside and retried
    with backoff (:attr:`RETRY_FIRST_S` doubling up to :attr:`RETRY_MAX_S`, timed by ``clock``);
    the steps it missed are held (the last :attr:`BACKLOG`) and handed to it once a retry works.
    ``close()`` retries a set-aside exporter once more, whatever the backoff, then closes it."""

    RETRY_FIRST_S = 1.0
    RETRY_MAX_S = 300.0
    BACKLOG = 1024

    def __init__(self, exporters: Iterable[Exporter] | Exporter, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
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
        self.clock = clock
        seen: dict[str, int] = {}
        self._health: list[ExporterHealth] = []
        for e in self.exporters:
            name = type(e).__name__
            seen[name] = seen.get(name, 0) + 1
            self._health.append(ExporterHealth(name if seen[name] == 1 else f"{name}#{seen[name]}"))
        self.health: Mapping[str, ExporterHealth] = MappingProxyType({h.name: h for h in self._health})
        """Every exporter's :class:`ExporterHealth`, by name (a live, read-only view)."""
        self._outages: dict[int, _Outage] = {}
        self._info: RunInfo | None = None

    @property
    def failed(self) -> list[Exporter]:
        """Exporters set aside after a failure (until a retry works)."""
        return [self.exporters[i] for i in sorted(self._outages)]

    def open(self, info: RunInfo) -> None:
        self._info = info
        for e in self.exporters:  # before any opens: an exporter that reports health binds its series in open()
            watch = getattr(e, "watch_exporters", None)
            if callable(watch):
                watch(self.health)
        for i in range(len(self.exporters)):
            self._run(i, "open", info)

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        for i in range(len(self.exporters)):
            outage = self._outages.get(i)
            if outage is None:
                self._run(i, "export", report, anomalies)
                continue
            self._hold(outage, (report, anomalies))
            if self.clock() >= outage.retry_at:
                self._retry(i)

    def flush(self) -> None:
        """Have every exporter with a ``flush()`` method (optional; :class:`~ampguard.exporters.JsonlExporter`
        has one: its healthy-step lines are written by a background thread) finish its writes.
        Failures are contained as in :meth:`export`."""
        for i, e in enumerate(self.exporters):
            if i not in self._outages and callable(getattr(e, "flush", None)):
                self._run(i, "flush")

    def close(self) -> None:
        for i, e in enumerate(self.exporters):
            if i in self._outages:
                self._retry(i)  # a last chance for what it holds
            try:
                e.close()
            except Exception as exc:  # an exporter must never break training (nor its end)
                self._fail(i, "close", exc)

    # ------------------------------------------------------------------ internals
    def _run(self, i: int, method: str, *args: object) -> bool:
        try:
            getattr(self.exporters[i], method)(*args)
            return True
        except Exception as exc:  # an exporter must never break training
            outage = self._fail(i, method, exc)
            if method == "export":
                self._hold(outage, args)  # type: ignore[arg-type]  # handed over again on recovery
            return False

    def _hold(self, outage: _Outage, item: tuple[StepReport, Sequence[Anomaly]]) -> None:
        if len(outage.held) == outage.held.maxlen:
            outage.dropped += 1
        outage.held.append(item)

    def _fail(self, i: int, method: str, exc: Exception) -> _Outage:
        health = self._health[i]
        health.errors += 1
        health.last_error = f"{type(exc).__name__}: {exc}"
        outage = self._outages.get(i)
        if outage is None:
            health.up = False
            outage = self._outages[i] = _Outage(
                reopen=method == "open", backoff_s=self.RETRY_FIRST_S, retry_at=self.clock() + self.RETRY_FIRST_S,
                held=deque(maxlen=self.BACKLOG))
            log.error(_failure_line(health.name, method, exc, self.RETRY_FIRST_S, self.RETRY_MAX_S, self.BACKLOG))
            log.debug("ampguard: exporter %s.%s() traceback", health.name, method, exc_info=exc)
        else:
            outage.reopen |= method == "open"
            outage.backoff_s = min(max(outage.backoff_s * 2, self.RETRY_FIRST_S), self.RETRY_MAX_S)
            outage.retry_at = self.clock() + outage.backoff_s
            log.debug("ampguard: exporter %s.%s() failed again (%s); next retry in %gs", health.name, method,
                      health.last_error, outage.backoff_s)
        return outage

    def _retry(self, i: int) -> None:
        """Open again if its open() failed, then hand over what it missed, in order."""
        e, outage, health = self.exporters[i], self._outages[i], self._health[i]
        if outage.reopen:
            assert self._info is not None  # internal: an open() failed, so open() ran
            if not self._run(i, "open", self._info):
                return
            outage.reopen = False
        while outage.held:
            report, anomalies = outage.held[0]
            try:
                e.export(report, anomalies)
            except Exception as exc:
                self._fail(i, "export", exc)
                return
            outage.held.popleft()
        del self._outages[i]
        health.up = True
        lost = f"; the {outage.dropped} oldest steps were dropped" if outage.dropped else ""
        log.warning("ampguard: exporter %s works again after %d failed call(s); the steps it missed were handed "
                    "over%s", health.name, health.errors, lost)


def _failure_line(name: str, method: str, exc: BaseException, first_s: float, max_s: float, backlog: int) -> str:
    """The one line a failed exporter gets: which one, the error, what happens and what to do."""
    error = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, whatever the message holds
    hint = "" if isinstance(exc, AmpGuardError) else f" ({_hint(exc)})"  # ampguard's own errors name the fix
    return (f"ampguard: exporter {name}.{method}() failed: {error}. Training goes on; fix the cause{hint} "
            f"and the exporter catches up: it is retried "
            f"in {first_s:g}s, then up to every {max_s:g}s, the last {backlog} steps held for it. "
            "Traceback: logging.getLogger('ampguard').setLevel(logging.DEBUG)")


def _hint(exc: BaseException) -> str:
    for cls in type(exc).__mro__:  # the most specific hint first (PortInUseError before OSError)
        hint = _HINTS.get(cls.__name__)
        if hint is not None:
            return hint
    return "see the error"


#: What to do, by the type of the error an exporter raised (its class name, so no backend is imported).
_HINTS = {
    "OSError": "a full disk, a missing directory or a permission: free space or fix the path",
    "PermissionError": "the file or directory is not writable: fix its permissions or the path",
    "FileNotFoundError": "the directory is gone: recreate it or fix the path",
    "ConnectionError": "the backend cannot be reached: check its address and that it is up",
    "ConnectionRefusedError": "nothing listens at the backend's address: start it or fix the address",
    "TimeoutError": "the backend did not answer in time: check that it is up and reachable",
}
