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
