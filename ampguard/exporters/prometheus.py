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

import math
import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

from .. import metrics as M
from ..errors import AmpGuardError
from ..records import Anomaly, RunInfo, StepReport
from ..vocab import AnomalyKind, Cause, SkipReason
from ._fp8 import fp8_series
from .base import ExporterHealth
from .memory import MemoryPeaks

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
    - ``addr``: interface to bind. The default, ``"0.0.0.0"``, is every IPv4 interface of the
      host: what a Prometheus on another machine needs, and prometheus_client's own convention.
      It also means that anyone who can reach the host on that port can read the endpoint (no
      authentication, no TLS): the run id, the device name, the ampguard/torch/python versions,
      the world size and precision (the run-info metric), and the training numbers (loss, loss
      scale, gradient norm, skipped and non-finite steps, device memory). Nothing can be written
      through it (GET/HEAD on ``/metrics`` only). Where the scraper runs on the same host, or
      behind a local agent or SSH tunnel, bind ``addr="127.0.0.1"`` (loopback only); ``"::"`` binds
      every IPv6 interface; a firewall or network policy limits who reaches ``0.0.0.0``.
    - ``registry``: a ``prometheus_client.CollectorRegistry`` to register into (e.g. the global
      ``REGISTRY`` to share an existing endpoint). None: a private one.
    - ``serve``: False registers the metrics but starts no server (use your own endpoint for
      ``registry``).

    Cost per step: a few float stores and additions on the training thread (the label children
    are bound once, in ``open()``).
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
        self._m: dict[str, Any] = {}
        self._bound: _Bound | None = None
        self._memory: MemoryPeaks | None = None
        self._health: Mapping[str, ExporterHealth] = {type(self).__name__: ExporterHealth(type(self).__name__)}
        self._health_bound: list[tuple[ExporterHealth, Any, Any, list[int]]] = []
        self._rank: tuple[str, str] = ("0", "0")
        self._fp8_known: list[str] = []  # modules with an fp8 series of their own (metrics.FP8_MODULES at most)
        self._fp8_children: dict[tuple[str, str, str], Any] = {}

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
        """Create every series at 0, bind this rank's label children, and start serving at
        ``port + info.local_rank``."""
        if not self._m:
            self._m = _register(self.registry)
        rank = self._rank = (str(info.rank), str(info.local_rank))
        children = {
            metric.name: {
                combo: self._m[metric.name].labels(*combo, *rank) for combo in M.label_combinations(metric)
            }
            for metric in M.CATALOGUE
        }
        children[M.RUN_INFO.name][()].info(M.run_info_values(info))
        # The group label's values are known now: "all", then one per param group of the optimizer.
        children[M.GRAD_ZERO_FRACTION.name] = {
            (group,): self._m[M.GRAD_ZERO_FRACTION.name].labels(group, *rank)
            for group in ("all", *map(str, range(info.param_groups)))
        }
        for metric in M.PER_MODULE:  # one series per top-level module, NaN until sampled
            children[metric.name] = {(m,): self._m[metric.name].labels(m, *rank) for m in info.modules}
        self._bound = _Bound(children)
        self._memory = MemoryPeaks(info.device)
        floor = info.loss_scale_floor
        children[M.LOSS_SCALE_FLOOR.name][()].set(math.nan if floor is None else floor)  # fixed for the run
        self._health_bound = [
            (h, self._m[M.EXPORTER_UP.name].labels(name, *rank), self._m[M.EXPORTER_ERRORS.name].labels(name, *rank),
             [0]) for name, h in self._health.items()
        ]
        self._report_health()
        if self.serve:
            self.start(info.local_rank)

    def watch_exporters(self, health: Mapping[str, ExporterHealth]) -> None:
        """Called by :class:`~ampguard.exporters.MultiExporter` before ``open()``: every exporter's
        health (a live view), served per exporter (:data:`ampguard.metrics.PER_EXPORTER`). Without
        it (an exporter used on its own) the series are about this exporter alone."""
        self._health = health

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        b = self._bound
        if b is None:
            return
        b.steps.inc()
        if report.skipped:
            # The exemplar is shown where OpenMetrics is negotiated (Prometheus scrapes it).
            b.skipped.get(report.reason, b.skipped_other).inc(1, exemplar={"step": str(report.step)})
        if report.nonfinite_loss:
            b.nonfinite_loss.inc()
        elif report.nonfinite_grads > 0:
            b.nonfinite_grad.inc()
        if report.nonfinite and (report.world_size == 1 or report.rank in report.nonfinite_ranks):
            b.nonfinite_origin.inc()
        b.loss_scale.set(report.loss_scale)
        b.grad_norm.set(report.grad_norm)
        if math.isfinite(report.grad_norm):
            b.grad_norm_finite.observe(report.grad_norm)
        if report.loss is not None:  # None: no loss was given for this step (the gauge keeps the last one)
            b.loss.set(report.loss)
        b.last_step_timestamp.set(report.wall_time)
        if report.scale_backoff:
            b.scale_backoffs.inc()
        if report.scale_growth:
            b.scale_growths.inc()
        for anomaly in anomalies:
            child = b.anomalies.get(anomaly.kind)
            if child is not None:
                child.inc()
            if anomaly.kind == AnomalyKind.RANK_DIVERGENCE:
                b.rank_divergence.inc()
            if anomaly.cause == Cause.TRANSIENT and (not anomaly.ranks or report.rank in anomaly.ranks):
                b.transient_faults.inc()
        if report.grad_zero_fraction is not None:  # a step sampled by GuardConfig.numerics_every
            b.zero_fraction[0].set(report.grad_zero_fraction)
            for child, value in zip(b.zero_fraction[1:], report.group_zero_fractions or ()):
                child.set(value)
        if report.headroom_log2 is not None:
            b.headroom.set(report.headroom_log2)
        peaks = self._memory.read() if self._memory is not None else None  # the exporter's own reading
        if peaks is not None:
            b.memory_allocated_peak.set(peaks[0])
            b.memory_reserved_peak.set(peaks[1])
        for values, gauges in ((report.module_grad_norms, b.module_grad_norm),
                               (report.module_update_ratios, b.module_update_ratio)):
            for module, value in values or ():
                gauge = gauges.get(module)
                if gauge is not None:
                    gauge.set(value)
        if report.fp8:
            self._export_fp8(report)
        self._report_health()

    def _export_fp8(self, report: StepReport) -> None:
        """The fp8 casts' series: bounded (:mod:`ampguard.exporters._fp8`), label children bound on first use."""
        for s in fp8_series(report.fp8, self._fp8_known):
            for metric, value in s.values():
                key = (metric.name, s.module, s.role)
                child = self._fp8_children.get(key)
                if child is None:
                    child = self._fp8_children[key] = self._m[metric.name].labels(s.module, s.role, *self._rank)
                if metric.type == "counter":
                    child.inc(value)
                else:
                    child.set(value)

    def _report_health(self) -> None:
        for health, up, errors, seen in self._health_bound:
            up.set(1.0 if health.up else 0.0)
            if health.errors > seen[0]:
                errors.inc(health.errors - seen[0])
                seen[0] = health.errors

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


class _Bound:
    """One rank's label children, bound once by ``open()``: ``export()`` only adds and stores
    (no per-step ``labels()`` look-up, which validates and locks)."""

    __slots__ = (
        "anomalies",
        "grad_norm",
        "grad_norm_finite",
        "headroom",
        "last_step_timestamp",
        "loss",
        "loss_scale",
        "memory_allocated_peak",
        "memory_reserved_peak",
        "module_grad_norm",
        "module_update_ratio",
        "nonfinite_grad",
        "nonfinite_loss",
        "nonfinite_origin",
        "rank_divergence",
        "scale_backoffs",
        "scale_growths",
        "skipped",
        "skipped_other",
        "steps",
        "transient_faults",
        "zero_fraction",
    )

    def __init__(self, children: dict[str, dict[tuple[str, ...], Any]]) -> None:
        def one(metric: M.Metric) -> Any:
            return children[metric.name][()]

        def by_value(metric: M.Metric) -> dict[str | None, Any]:  # metrics with one label beyond the rank's
            return {combo[0]: child for combo, child in children[metric.name].items()}

        self.steps = one(M.STEPS)
        self.skipped = by_value(M.SKIPPED_STEPS)
        self.skipped_other = self.skipped[SkipReason.NONFINITE_GRAD]  # a reason the catalogue does not know
        nonfinite = by_value(M.NONFINITE_STEPS)
        self.nonfinite_loss, self.nonfinite_grad = nonfinite["loss"], nonfinite["grad"]
        self.nonfinite_origin = one(M.NONFINITE_ORIGIN)
        self.loss_scale = one(M.LOSS_SCALE)
        self.grad_norm = one(M.GRAD_NORM)
        self.grad_norm_finite = one(M.GRAD_NORM_HISTOGRAM)
        self.loss = one(M.LOSS)
        self.last_step_timestamp = one(M.LAST_STEP_TIMESTAMP)
        self.scale_backoffs = one(M.SCALE_BACKOFFS)
        self.scale_growths = one(M.SCALE_GROWTHS)
        self.rank_divergence = one(M.RANK_DIVERGENCE)
        self.anomalies = by_value(M.ANOMALIES)
        self.transient_faults = one(M.TRANSIENT_FAULTS)
        memory = by_value(M.DEVICE_MEMORY_PEAK)
        self.memory_allocated_peak, self.memory_reserved_peak = memory["allocated"], memory["reserved"]
        self.zero_fraction = list(by_value(M.GRAD_ZERO_FRACTION).values())  # "all", "0", "1", ...
        self.headroom = one(M.LOSS_SCALE_HEADROOM)
        self.module_grad_norm = by_value(M.MODULE_GRAD_NORM)
        self.module_update_ratio = by_value(M.MODULE_UPDATE_RATIO)
        # NaN until a step reports them (memory: until a CUDA step does; off CUDA it stays NaN; the
        # numerics and module gauges: until a sampled step does; the headroom: fp16 only).
        for gauge in (self.loss, self.grad_norm, self.loss_scale, *memory.values(), *self.zero_fraction,
                      self.headroom, *self.module_grad_norm.values(), *self.module_update_ratio.values()):
            gauge.set(math.nan)


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
