"""A background thread that sends an exporter's queued items to a remote backend (W&B, MLflow).

The training thread only queues (``put``, a lock and an append); the thread hands the oldest
queued items to the exporter's ``send(items)``, which returns how many of them it handled. A
``send`` that raises leaves the items queued: the thread retries with backoff (1 s doubling to
60 s) and the error is raised once on the training thread by :meth:`Sender.raise_error` (the
exporter's next ``export()``, ``flush()`` or ``close()``, where ``MultiExporter`` reports it in
one line and retries). At most ``backlog`` items wait; beyond that the oldest are dropped and
counted (:attr:`Sender.dropped`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Sender"]


class Sender:
    """Queue on the training thread, send on a thread of its own (see the module docstring)."""

    RETRY_FIRST_S = 1.0
    RETRY_MAX_S = 60.0

    def __init__(self, name: str, send: Callable[[list[Any]], int], *, backlog: int, batch: int) -> None:
        self.name = name
        self.backlog = backlog
        self.batch = batch
        self.dropped = 0
        """Items dropped because more than ``backlog`` were waiting."""
        self._send = send
        self._todo: deque[tuple[int, Any]] = deque()  # (sequence number, item), oldest first
        self._seq = 0
        self._cv = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        with self._cv:
            self._seq += 1
            self._todo.append((self._seq, item))
            if len(self._todo) > self.backlog:
                self._todo.popleft()
                self.dropped += 1
        self._wake.set()

    def raise_error(self) -> None:
        """Raise (once) what the last failed send raised."""
        with self._cv:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def flush(self, timeout: float | None = None) -> None:
        """Return once every queued item is sent; raise a failed send, or ``TimeoutError`` after ``timeout`` s."""
        self._wake.set()
        with self._cv:
            self._cv.wait_for(lambda: not self._todo or self._error is not None, timeout)
            left = len(self._todo)
        self.raise_error()
        if left:
            raise TimeoutError(f"{left} queued item(s) not sent within {timeout:g}s")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (what is still queued is not sent)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            try:
                while not self._stop.is_set() and self._send_some():
                    pass
                backoff = 0.0
            except Exception as exc:  # raised on the training thread; the items stay queued for the retry
                with self._cv:
                    self._error = exc
                    self._cv.notify_all()
                backoff = min(max(2 * backoff, self.RETRY_FIRST_S), self.RETRY_MAX_S)
                if self._stop.wait(backoff):
                    return
                self._wake.set()

    def _send_some(self) -> bool:
        with self._cv:
            items = [item for _, item in list(self._todo)[: self.batch]]
            first = self._todo[0][0] if self._todo else 0
        if not items:
            return False
        done = self._send(items)
        with self._cv:
            while self._todo and self._todo[0][0] < first + done:  # the ones dropped meanwhile are gone already
                self._todo.popleft()
            self._cv.notify_all()
        return True


class QueuedExporter:
    """The part of a run tracker's exporter (W&B, MLflow) that queues on the training thread: its
    backend calls (``_start_run``, ``_log``, ``_end_run``) run on a :class:`Sender`'s thread."""

    BACKLOG = 100_000
    """Steps queued for the thread at most; beyond that the oldest are dropped (and counted)."""
    BATCH = 256
    """Items handed to one ``_log`` call at most."""

    def __init__(self, *, all_ranks: bool, timeout_s: float) -> None:
        self.all_ranks = all_ranks
        self.timeout_s = timeout_s
        self._info: Any = None
        self._owned = False
        self._sender: Sender | None = None

    def _opens(self, info: Any) -> bool:
        """Whether ``open(info)`` has a run to start: rank 0 (or every rank with ``all_ranks``), once
        (opened again after a failure, the thread retries what failed)."""
        return (info.rank == 0 or self.all_ranks) and self._sender is None

    @property
    def dropped(self) -> int:
        """Steps dropped because more than :attr:`BACKLOG` were waiting to be sent."""
        return self._sender.dropped if self._sender is not None else 0

    def _begin(self, name: str, info: Any, run: Any) -> None:
        """Start the thread and queue the run's start (``run``: the caller's run, or None to make one)."""
        self._owned = run is None
        self._info = info
        self._sender = Sender(name, self._send, backlog=self.BACKLOG, batch=self.BATCH)
        self._sender.put(("open", run))

    def _queue(self, payload: Any) -> None:
        """Queue one step (raising, once, what the thread's last failed call raised)."""
        sender = self._sender
        if sender is not None:
            sender.raise_error()
            sender.put(("log", payload))

    def flush(self, timeout: float | None = None) -> None:
        """Return once every queued step is sent (raises a failed call, or ``TimeoutError`` after ``timeout``
        seconds; None: ``timeout_s``)."""
        if self._sender is not None:
            self._sender.flush(self.timeout_s if timeout is None else timeout)

    def close(self) -> None:
        """Send what is queued (at most ``timeout_s``), end a run the exporter started, stop the thread."""
        sender = self._sender
        if sender is None:
            return
        try:
            if self._owned:
                sender.put(("end", None))
            sender.flush(self.timeout_s)
        finally:
            sender.stop()
            self._sender = None

    def _send(self, items: list[tuple[str, Any]]) -> int:
        kind, payload = items[0]
        if kind == "open":
            self._start_run(payload)
            return 1
        if kind == "end":
            self._end_run()
            return 1
        steps = []
        for kind, payload in items:  # the leading steps
            if kind != "log":
                break
            steps.append(payload)
        return self._log(steps)

    def _start_run(self, run: Any) -> None:
        raise NotImplementedError

    def _log(self, steps: list[Any]) -> int:
        """Send the leading ``steps`` (or some of them); return how many were sent."""
        raise NotImplementedError

    def _end_run(self) -> None:
        raise NotImplementedError
