"""JsonlExporter: a durable, append-only event log (one JSON object per line).

Records, in the order they happen:

- ``{"event": "run", ...RunInfo, "time": ...}``: first, when the guard opens the log.
- ``{"event": "anomaly", "step", "rank", "kind", "reason", ...Anomaly, "report": {...}}``: one per
  anomaly, flushed **and fsynced** before ``export()`` returns, so a run killed with SIGKILL
  (or a node that loses power after the call) loses none of them.
- ``{"event": "skipped", "step", "rank", "skipped": true, "reason", ...StepReport}``: one per
  skipped step (fsynced with it: a skipped step is an event too).
- ``{"event": "step", ...StepReport}``: one per healthy step, only with ``every_step=True``;
  flushed to the OS at once, fsynced every ``fsync_every`` steps (the log stays cheap).
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
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..report import Anomaly, RunInfo, StepReport

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
    - ``every_step``: also log healthy steps (one line each).
    - ``fsync_every``: with ``every_step``, fsync healthy-step lines every N steps (anomalies and
      skipped steps are always fsynced when written).
    """

    def __init__(self, path: str | os.PathLike[str], every_step: bool = False, *, fsync_every: int = 100) -> None:
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
        if report.step != self._last_step:  # a step handed over again after a failure counts once
            self._steps += 1
            self._last_step = report.step
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
            self._unsynced += 1
        if anomalies or report.skipped or self._unsynced >= self.fsync_every:
            self._sync()

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self._write({"event": "close", "rank": self._rank, "steps": self._steps, "time": time.time()}, sync=True)
        finally:
            self._release()

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
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __repr__(self) -> str:
        return f"JsonlExporter({os.fspath(self.file_path or self.path)!r}, every_step={self.every_step})"
