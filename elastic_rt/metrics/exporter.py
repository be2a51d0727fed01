"""HTTP endpoint serving /metrics (Prometheus text) and /healthz from a daemon thread."""

from __future__ import annotations

import errno
import logging
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Tuple, Union

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from elastic_rt.errors import ConfigError

log = logging.getLogger(__name__)

HealthResult = Union[bool, Tuple[bool, str]]  # (ok, reason) or a bare bool


def _health(healthy: Callable[[], HealthResult]) -> tuple[bool, str]:
    try:
        result = healthy()
    except Exception as exc:  # the health callable must never take the endpoint down
        return False, f"health check raised {type(exc).__name__}: {exc}"
    if isinstance(result, tuple):
        ok, reason = result
        return bool(ok), str(reason)
    return bool(result), "" if result else "unhealthy"


def _make_handler(registry: CollectorRegistry, healthy: Callable[[], HealthResult]):
    class Handler(BaseHTTPRequestHandler):
        server_version = "elastic-rt"

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept"))
                try:
                    body = encoder(registry)
                except Exception as exc:
                    log.warning("metrics scrape failed: %s", exc)
                    self._send(500, f"scrape failed: {exc}\n".encode(), "text/plain; charset=utf-8")
                    return
                self._send(200, body, content_type)
            elif path == "/healthz":
                ok, reason = _health(healthy)
                text = "ok\n" if ok else f"unhealthy: {reason}\n"
                self._send(200 if ok else 503, text.encode(), "text/plain; charset=utf-8")
            else:
                self._send(404, b"not found; try /metrics or /healthz\n", "text/plain; charset=utf-8")

        do_HEAD = do_GET

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # SO_REUSEADDR: rebind past TIME_WAIT; Linux still refuses a live listener

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves socket.getfqdn(host): a reverse DNS lookup
        # that can stall start-up for seconds on nodes with a broken resolver.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsExporter:
    """Serves the registry at http://host:port/metrics and health at /healthz.

    start() binds synchronously, so a port conflict surfaces as a ConfigError at
    start-up, and returns once the server accepts connections.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        healthy: Callable[[], HealthResult] = lambda: True,
        host: str = "0.0.0.0",
        port: int,
    ) -> None:
        if not 0 <= port < 65536:
            raise ConfigError(f"metrics port {port} is out of range 0-65535; see --metrics-port")
        self._registry = registry
        self._healthy = healthy
        self._host = host
        self._port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self._port != 0

    @property
    def port(self) -> int:
        """The bound port (after start), else the configured one."""
        return self._server.server_address[1] if self._server else self._port

    @property
    def url(self) -> str:
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self._host, self._host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Bind and serve; a no-op when port is 0 or already started."""
        if not self.enabled or self._server is not None:
            return
        handler = _make_handler(self._registry, self._healthy)
        server_cls = _Server6 if ":" in self._host else _Server
        try:
            server = server_cls((self._host, self._port), handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"metrics port {self._port} on {self._host or '*'} is already in use; "
                    "pick another with --metrics-port (0 turns the exporter off)"
                ) from exc
            raise ConfigError(
                f"cannot serve metrics on {self._host}:{self._port}: {exc.strerror or exc}; "
                "check the listen address and --metrics-port (0 turns the exporter off)"
            ) from exc
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="elastic-rt-metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics at %s/metrics, health at %s/healthz", self.url, self.url)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and release the port."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout_s)

    def __enter__(self) -> "MetricsExporter":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

