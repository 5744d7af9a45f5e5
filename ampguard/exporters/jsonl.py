"""JsonlExporter: a durable, append-only event log (one JSON object per line).

Records, in the order they happen:

- ``{"event": "run", ...RunInfo, "time": ...}``: first, when the guard opens the log.
- ``{"event": "anomaly", "step", "rank", "kind", "reason", ...Anomaly, "report": {...}}``: one per
  anomaly, written on the calling thread and **fsynced** before ``export()`` returns (after every
  queued healthy step), so a run killed with SIGKILL (or a node that loses power after the call)
  loses none of them.
- ``{"event": "skipped", "step", "rank", "skipped": true, "reason", ...StepReport}``: one per
  skipped step (fsynced with it: a skipped step is an event too).
- ``{"event": "step", ...StepReport}``: one per healthy step (the default, ``every_step=True``; with
  ``every_step=False`` the log holds the anomalies and skipped steps only, and ``ampguard report
  --plot`` can draw no loss, scale or gradient-norm line between them);
  serialised and written by a background writer thread, off the training step (``export()`` only
  queues the report), fsynced every ``fsync_every`` steps; ``flush()``, ``close()`` and the next
  anomaly or skipped step wait until the writer has written every queued one, so the file keeps
  step order. The queue is bounded (:attr:`JsonlExporter.QUEUE`): a disk slower than the steps
  makes ``export()`` wait rather than memory grow. A run killed with SIGKILL can lose the healthy
  steps still queued (at most a few ms' worth), never an anomaly or skipped step.
- ``{"event": "close", "steps": n, "time": ...}``: last, from ``close()``.
- ``{"event": "torn_line", "rank", "bytes", "detail", "time"}``: when the file ended in a partial
  line (a run killed, or the disk full, mid-write): the line is ended first, so the records after
  it start lines of their own, and this record says so. At ``open()``, and when writing works
  again after a failed write (``MultiExporter`` retries a failed exporter with backoff and hands it
  the steps it missed: the records of a disk-full spell are written once there is room).

Non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON).

Per-rank files: ``path`` may hold ``{rank}`` (``"logs/events-{rank}.jsonl"``); a ``path`` that is
an existing directory, or ends with ``/``, gets ``events-rank{R}.jsonl`` inside. Otherwise the
path is used as is on rank 0, and ranks > 0 append ``.rank{R}`` before the suffix
(``events.jsonl`` -> ``events.rank1.jsonl``): two ranks never write one file.

A write that fails on the writer thread (a full disk) is raised by the next ``export()``,
``flush()`` or ``close()`` on the training thread, once, as a failed write there would be
(``MultiExporter`` reports it and retries); the steps it could not write are kept and written
first, in order, once writing works again.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..records import Anomaly, RunInfo, StepReport
from ._fp8 import fp8_log_casts

__all__ = ["JsonlExporter", "rank_path", "torn_record", "torn_tail"]


def rank_path(path: str | os.PathLike[str], rank: int) -> Path:
    """The file rank ``rank`` writes for ``path`` (see the module docstring)."""
    text = os.fspath(path)
    if "{rank}" in text:
        return Path(text.replace("{rank}", str(rank)))
    p = Path(text)
    if p.is_dir() or text.endswith(("/", os.sep)):
        return p / f"events-rank{rank}.jsonl"
    if rank == 0:
        return p
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


def torn_tail(path: str | os.PathLike[str]) -> int:
    """Bytes after the last newline of ``path``: a record torn by a kill or a full disk mid-write
    (0 when the file is missing, empty or ends with a newline)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            if end == 0:
                return 0
            window = min(end, 1 << 20)
            f.seek(end - window)
            tail = f.read(window)
    except OSError:
        return 0
    return len(tail) - (tail.rfind(b"\n") + 1)


def torn_record(rank: int, nbytes: int, when: str) -> dict[str, Any]:
    """The record that says a torn line was ended (``ampguard report`` shows its detail)."""
    return {"event": "torn_line", "rank": rank, "bytes": nbytes, "time": time.time(),
            "detail": f"the log ended in a torn record of {nbytes} byte(s) (a run killed or out of disk "
                      f"mid-write); the line was ended {when}"}


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")


class JsonlExporter:
    """Append the guard's events to a JSON-lines file per rank.

    - ``path``: file, ``{rank}`` pattern, or directory (see module docstring). Parents are created.
    - ``every_step``: True (default): log every step, healthy ones too (one line each; on the step a
      queue put, the serialising and writing are a background thread's); False: only anomalies and
      skipped steps (a smaller file, and no loss/scale/gradient-norm lines in ``ampguard report --plot``).
    - ``fsync_every``: with ``every_step``, fsync healthy-step lines every N steps (anomalies and
      skipped steps are always fsynced when written).

    Healthy-step lines are written by a background thread (see the module docstring); ``flush()``
    waits until every one queued is written.
    """

    QUEUE = 1024
    """Healthy steps queued for the writer at most; ``export()`` waits for room beyond that."""

    def __init__(self, path: str | os.PathLike[str], every_step: bool = True, *, fsync_every: int = 100) -> None:
        if not (isinstance(fsync_every, int) and fsync_every >= 1):
            raise ValueError(f"JsonlExporter fsync_every={fsync_every!r}; allowed: an int >= 1")
        self.path = path
        self.every_step = every_step
        self.fsync_every = fsync_every
        self.file_path: Path | None = None
        self._fd: int | None = None
        self._rank = 0
        self._steps = 0
        self._last_step: int | None = None
        self._unsynced = 0
        self._check_torn = False
        self._queue: queue.Queue[StepReport | None] = queue.Queue(self.QUEUE)
        self._writer: threading.Thread | None = None
        self._backlog: list[StepReport] = []
        """Healthy steps the writer could not write (after a failed write), oldest first."""
        self._error: BaseException | None = None
        """The writer's failed write, until the training thread has raised it."""
        self._at_exit: Callable[[], None] | None = None

    def open(self, info: RunInfo) -> None:
        """Open (again, after a failure: ``MultiExporter`` retries) and write the ``run`` record."""
        self._release()
        self._rank = info.rank
        self.file_path = rank_path(self.path, info.rank)
        self.file_path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered append: every record reaches the OS whole, in one write, as soon as it is made;
        # a failed write leaves nothing behind in a buffer to come out later.
        self._fd = os.open(self.file_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._check_torn = False
        torn = torn_tail(self.file_path)
        if torn:  # end it, so this run's header starts a line of its own
            self._raw(b"\n")
        self._write({"event": "run", **info.to_dict(), "time": time.time()}, sync=not torn)
        if torn:
            self._write(torn_record(self._rank, torn, "before this run"), sync=True)

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        if self._fd is None:
            return
        if self._error is not None or self._backlog:
            self._catch_up()  # raises the writer's failure once, then retries what it could not write
        if report.step != self._last_step:  # a step handed over again after a failure counts once
            self._steps += 1
            self._last_step = report.step
        if not (anomalies or report.skipped):
            if self.every_step:
                self._start_writer()
                self._queue.put(report)  # serialised and written on the writer thread
            return
        self._drain()  # the queued healthy steps first: the file keeps step order
        values = report.to_dict()
        for anomaly in anomalies:
            record: dict[str, Any] = {
                "event": "anomaly",
                "step": anomaly.step,
                "rank": report.rank,
                "reason": report.reason,
                **anomaly.to_dict(),
                "report": values,
            }
            self._write(record, sync=False)
        if report.skipped:
            self._write({"event": "skipped", **values}, sync=False)
        elif self.every_step:
            self._write({"event": "step", **values}, sync=False)
        self._sync()  # before export() returns: on disk, not only in the OS

    def flush(self) -> None:
        """Return once every queued healthy step is written to the OS (raises a failed write)."""
        if self._fd is None:
            return
        self._drain()
        if self._error is not None or self._backlog:
            self._catch_up()

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.flush()
            self._write({"event": "close", "rank": self._rank, "steps": self._steps, "time": time.time()}, sync=True)
        finally:
            self._release()

    # ------------------------------------------------------------------ the writer thread
    def _start_writer(self) -> None:
        if self._writer is not None:
            return
        self._writer = threading.Thread(target=self._run_writer, name="ampguard-jsonl-writer", daemon=True)
        self._writer.start()
        ref = weakref.ref(self)

        # Process-wide: an interpreter-exit hook, while the writer thread runs. The thread is a daemon
        # (a run that never calls close() must still exit), so without the hook its queued steps would
        # be lost at exit. It holds the exporter weakly and is unregistered by close() (_stop_writer).
        def at_exit() -> None:  # a run that never called close(): write what is queued before exiting
            exporter = ref()
            if exporter is not None and exporter._writer is not None:
                exporter._queue.join()

        self._at_exit = at_exit
        atexit.register(at_exit)

    def _run_writer(self) -> None:
        while True:
            report = self._queue.get()
            try:
                if report is None:
                    return
                if self._error is not None:  # writing failed: keep the rest, in order, for the retry
                    self._backlog.append(report)
                    continue
                try:
                    self._write_step(report)
                except BaseException as exc:  # reported on the training thread (export/flush/close)
                    self._backlog.append(report)
                    self._error = exc
            finally:
                self._queue.task_done()

    def _write_step(self, report: StepReport) -> None:
        fp8 = fp8_log_casts(report.fp8)  # a healthy unsampled step: the bounded fold of its fp8 casts
        if fp8 is not report.fp8:
            report = dataclasses.replace(report, fp8=fp8)
        self._write({"event": "step", **report.to_dict()}, sync=False)
        self._unsynced += 1
        if self._unsynced >= self.fsync_every:
            self._sync()

    def _drain(self) -> None:
        """Wait until the writer has handled every queued step (it is idle after this)."""
        if self._writer is not None:
            self._queue.join()

    def _catch_up(self) -> None:
        """After a failed write on the writer: raise it (once), then write the steps it kept."""
        self._drain()
        error, self._error = self._error, None
        if error is not None:
            raise error
        while self._backlog:
            self._write_step(self._backlog[0])
            del self._backlog[0]

    def _stop_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            self._queue.put(None)
            writer.join()
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None

    # ------------------------------------------------------------------ internals
    def _write(self, record: dict[str, Any], *, sync: bool) -> None:
        if self._check_torn:  # the last write failed (ENOSPC, EFBIG, EIO...): it may have left part of a line
            assert self.file_path is not None
            torn = torn_tail(self.file_path)
            if torn:
                self._raw(b"\n")
                self._raw(_line(torn_record(self._rank, torn, "after the write error, when writing worked again")))
            self._check_torn = False
        self._raw(_line(record))
        if sync:
            self._sync()

    def _raw(self, data: bytes) -> None:
        assert self._fd is not None  # internal: only called while open
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except BaseException:
            self._check_torn = True
            raise

    def _sync(self) -> None:
        assert self._fd is not None
        os.fsync(self._fd)
        self._unsynced = 0

    def _release(self) -> None:
        self._stop_writer()  # nothing queued is written after this (its fd is closed)
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __repr__(self) -> str:
        return f"JsonlExporter({os.fspath(self.file_path or self.path)!r}, every_step={self.every_step})"
