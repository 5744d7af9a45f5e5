"""PrometheusExporter: one read-only metrics endpoint per rank.

Every series comes from :mod:`ampguard.metrics`. ``export()`` updates plain Python values
held by prometheus_client's metric objects; a scrape only reads those (never a tensor, never
a CUDA call), on the server's own thread, so a scrape cannot slow or break a step.

What a user sees when the port is taken: :meth:`PrometheusExporter.open` raises
:class:`PortInUseError` naming the port. Inside ``ampguard.wrap(exporters=[...])`` that
error is contained like every exporter failure (training goes on; a ``RuntimeWarning`` and
an ``ampguard.exporters`` log record carry the message). To fail hard instead, call
:meth:`PrometheusExporter.start` yourself before ``wrap()``: it binds at once and raises;
``open()`` then reuses the bound server.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

from .. import metrics as M
from ..errors import AmpGuardError
from ..report import Anomaly, RunInfo, StepReport

__all__ = ["PortInUseError", "PrometheusExporter"]

#: Paths the endpoint answers; anything else is a 404.
_PATHS = ("/", "/metrics")


class PortInUseError(AmpGuardError, OSError):
    """The exporter's port is already bound by another process (or another rank)."""


class _QuietHandler(WSGIRequestHandler):
    # A client that connects and sends nothing (or trickles bytes) is dropped after this many
    # seconds instead of holding a server thread forever.
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingWSGIServer):
    allow_reuse_address = True  # a port in TIME_WAIT is free; one with a listener is not
    daemon_threads = True
    request_queue_size = 64

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A malformed or aborted request must not print a traceback per request on the
        # training process's stderr; the connection is simply dropped.
        pass


def _read_only(app: Callable[..., Any]) -> Callable[..., Any]:
    """Serve GET/HEAD on ``/`` and ``/metrics`` only; never read a request body."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "")
        path = environ.get("PATH_INFO", "")
        if path not in _PATHS:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"ampguard serves metrics at /metrics only\n"]
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Type", "text/plain")])
            return [b"read-only endpoint: use GET\n"]
        environ = dict(environ, REQUEST_METHOD="GET")
        body = app(environ, start_response)
        return [] if method == "HEAD" else body

    return guarded


class PrometheusExporter:
    """Serve the guard's metrics for Prometheus to scrape.

    - ``port``: base port; rank ``r`` of a host serves at ``port + local_rank`` (so 8 GPUs of
      a host use ``port .. port+7``).
    - ``addr``: interface to bind ("0.0.0.0": all IPv4; "127.0.0.1": loopback only; "::": IPv6).
    - ``registry``: a ``prometheus_client.CollectorRegistry`` to register into (e.g. the global
      ``REGISTRY`` to share an existing endpoint). None: a private one.
    - ``serve``: False registers the metrics but starts no server (use your own endpoint for
      ``registry``).

    Cost per step: a few dict look-ups and float stores on the training thread.
    """

    def __init__(
        self,
        port: int = 9400,
        addr: str = "0.0.0.0",
        registry: CollectorRegistry | None = None,
        *,
        serve: bool = True,
    ) -> None:
        if not (isinstance(port, int) and not isinstance(port, bool) and 0 <= port <= 65535):
            raise ValueError(f"PrometheusExporter port={port!r}; allowed: an int in 0..65535 (0: any free port)")
        self.port = port
        self.addr = addr
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.serve = serve
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._labels: dict[str, str] | None = None
        self._m: dict[str, Any] = {}

    # ------------------------------------------------------------------ server
    @property
    def bound_port(self) -> int | None:
        """The port actually served (after :meth:`start`/``open()``), else None."""
        return None if self._server is None else int(self._server.server_address[1])

    @property
    def url(self) -> str | None:
        """``http://host:port/metrics`` of the running endpoint, else None."""
        if self._server is None:
            return None
        host = self.addr if self.addr not in ("0.0.0.0", "::", "") else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.bound_port}/metrics"

    def start(self, local_rank: int | None = None) -> int:
        """Bind and start serving now; return the port. ``local_rank`` defaults to the
        ``LOCAL_RANK`` environment variable (torchrun sets it), else 0.

        Raises :class:`PortInUseError` naming the port when it is taken. Idempotent."""
        with self._lock:
            if self._server is not None:
                return int(self._server.server_address[1])
            if local_rank is None:
                local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
            port = 0 if self.port == 0 else self.port + local_rank
            family, host = _family(self.addr, port)

            class Server(_Server):
                address_family = family

            app = _read_only(make_wsgi_app(self.registry))
            try:
                server = make_server(host, port, app, Server, handler_class=_QuietHandler)
            except OSError as exc:
                if exc.errno in (98, 48, 10048):  # EADDRINUSE on Linux, macOS, Windows
                    raise PortInUseError(
                        f"ampguard PrometheusExporter: port {port} on {self.addr} is already in use "
                        f"(base port {self.port} + local_rank {local_rank}); pick another base port with "
                        f"PrometheusExporter(port=...) or stop the process holding {port}"
                    ) from exc
                raise
            thread = threading.Thread(target=server.serve_forever, name=f"ampguard-metrics:{port}", daemon=True)
            thread.start()
            self._server, self._thread = server, thread
            return int(server.server_address[1])

    # ------------------------------------------------------------------ Exporter protocol
    def open(self, info: RunInfo) -> None:
        """Create every series at 0 and start serving at ``port + info.local_rank``."""
        labels = {"rank": str(info.rank), "local_rank": str(info.local_rank)}
        self._labels = labels
        if not self._m:
            self._m = _register(self.registry)
        m = self._m
        for metric in M.CATALOGUE:
            family = m[metric.name]
            if metric.type == "info":
                versions = dict(info.versions)
                family.labels(**labels).info(
                    {
                        "run_id": info.run_id,
                        "precision": info.precision,
                        "backend": info.backend,
                        "world_size": str(info.world_size),
                        "device": info.device,
                        "ampguard_version": versions.get("ampguard", ""),
                        "torch_version": versions.get("torch", ""),
                        "python_version": versions.get("python", ""),
                    }
                )
            elif metric.labels:
                for combo in _combinations(metric.label_values):
                    family.labels(**dict(zip(metric.labels, combo)), **labels)
            else:
                family.labels(**labels)
        m[M.LOSS.name].labels(**labels).set(float("nan"))
        m[M.GRAD_NORM.name].labels(**labels).set(float("nan"))
        m[M.LOSS_SCALE.name].labels(**labels).set(float("nan"))
        for kind in M.MEMORY_KINDS:  # NaN until a CUDA step reports it (off CUDA: stays NaN)
            m[M.DEVICE_MEMORY_PEAK.name].labels(kind=kind, **labels).set(float("nan"))
        if self.serve:
            self.start(info.local_rank)

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        labels = self._labels
        if labels is None:
            return
        m = self._m
        m[M.STEPS.name].labels(**labels).inc()
        if report.skipped:
            reason = report.reason if report.reason in M.SKIPPED_STEPS.label_values[0] else "nonfinite_grad"
            # The exemplar is shown where OpenMetrics is negotiated (Prometheus scrapes it).
            m[M.SKIPPED_STEPS.name].labels(reason=reason, **labels).inc(1, exemplar={"step": str(report.step)})
        if report.nonfinite_loss:
            m[M.NONFINITE_STEPS.name].labels(kind="loss", **labels).inc()
        elif report.nonfinite_grads > 0:
            m[M.NONFINITE_STEPS.name].labels(kind="grad", **labels).inc()
        if report.nonfinite and (report.world_size == 1 or report.rank in report.nonfinite_ranks):
            m[M.NONFINITE_ORIGIN.name].labels(**labels).inc()
        m[M.LOSS_SCALE.name].labels(**labels).set(report.next_loss_scale)
        m[M.GRAD_NORM.name].labels(**labels).set(report.grad_norm)
        if report.grad_norm == report.grad_norm and abs(report.grad_norm) != float("inf"):
            m[M.GRAD_NORM_HISTOGRAM.name].labels(**labels).observe(report.grad_norm)
        m[M.LOSS.name].labels(**labels).set(report.loss)
        m[M.LAST_STEP_TIMESTAMP.name].labels(**labels).set(report.wall_time)
        if report.next_loss_scale < report.loss_scale:
            m[M.SCALE_BACKOFFS.name].labels(**labels).inc()
        elif report.next_loss_scale > report.loss_scale:
            m[M.SCALE_GROWTHS.name].labels(**labels).inc()
        known = M.ANOMALIES.label_values[0]
        for anomaly in anomalies:
            if anomaly.kind in known:
                m[M.ANOMALIES.name].labels(kind=anomaly.kind, **labels).inc()
            if anomaly.kind == "rank_divergence":
                m[M.RANK_DIVERGENCE.name].labels(**labels).inc()
            if anomaly.cause == "transient" and (not anomaly.ranks or report.rank in anomaly.ranks):
                m[M.TRANSIENT_FAULTS.name].labels(**labels).inc()
        if report.memory_allocated_peak is not None:
            m[M.DEVICE_MEMORY_PEAK.name].labels(kind="allocated", **labels).set(report.memory_allocated_peak)
        if report.memory_reserved_peak is not None:
            m[M.DEVICE_MEMORY_PEAK.name].labels(kind="reserved", **labels).set(report.memory_reserved_peak)

    def close(self) -> None:
        """Stop serving and free the port. The registered metrics stay in ``registry``."""
        with self._lock:
            server, self._server = self._server, None
            thread, self._thread = self._thread, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __repr__(self) -> str:
        where = self.url or f"{self.addr}:{self.port}+local_rank (not started)"
        return f"PrometheusExporter({where})"


def _family(addr: str, port: int) -> tuple[socket.AddressFamily, str]:
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    return family, str(sockaddr[0])


def _combinations(values: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [()]
    for choices in values:
        out = [(*prefix, v) for prefix in out for v in choices]
    return out


def _register(registry: CollectorRegistry) -> dict[str, Any]:
    """One prometheus_client metric object per catalogue entry, registered in ``registry``."""
    out: dict[str, Any] = {}
    for metric in M.CATALOGUE:
        kw: dict[str, Any] = {"labelnames": metric.all_labels, "registry": registry}
        if metric.type == "counter":
            out[metric.name] = Counter(metric.client_name, metric.help, **kw)
        elif metric.type == "gauge":
            out[metric.name] = Gauge(metric.client_name, metric.help, **kw)
        elif metric.type == "histogram":
            out[metric.name] = Histogram(metric.client_name, metric.help, buckets=M.GRAD_NORM_BUCKETS, **kw)
        elif metric.type == "info":
            out[metric.name] = Info(metric.client_name, metric.help, **kw)
        else:  # pragma: no cover - the catalogue is checked by tests
            raise ValueError(f"unknown metric type {metric.type!r} for {metric.name}")
    return out
