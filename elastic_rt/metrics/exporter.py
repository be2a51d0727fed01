"""HTTP endpoint serving /metrics (Prometheus text), /livez and /readyz (and /healthz, an alias of /livez)
from a daemon thread, with a cap on concurrent connections."""

from __future__ import annotations

import errno
import logging
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from elastic_rt.errors import ConfigError
from elastic_rt.metrics.health import LIVENESS, READINESS, HealthChecks, render

log = logging.getLogger(__name__)

# Prometheus, the kubelet's probes and an operator's curl need a handful at a time; past the
# cap a connection is answered 503 at once, so a scrape storm cannot pile up threads.
DEFAULT_MAX_CONNECTIONS = 16
# A client that connects and sends nothing (or dribbles) holds a slot at most this long.
DEFAULT_REQUEST_TIMEOUT_S = 10.0
TEXT = "text/plain; charset=utf-8"
_BUSY_BODY = b"busy: too many concurrent connections; try again soon\n"
BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nRetry-After: 1\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))
HELP = b"not found; try /metrics, /livez, /readyz (add ?verbose for every check; /healthz = /livez)\n"


def describe_bind(host: str) -> str:
    """What a bind address means, for the start-up log line."""
    return {"0.0.0.0": "every IPv4 interface", "": "every IPv4 interface",
            "::": "every interface, IPv6 and IPv4"}.get(host, "this address only")


def _make_handler(registry: CollectorRegistry, checks: dict[str, HealthChecks], timeout_s: float):
    class Handler(BaseHTTPRequestHandler):
        server_version = "elastic-rt"
        timeout = timeout_s  # socket timeout: a silent client frees its slot

        def _send(self, code: int, body: bytes, content_type: str = TEXT) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            path, _, query = self.path.partition("?")
            path = path.rstrip("/") or "/"
            if path == "/metrics":
                self._metrics()
                return
            if path == "/healthz" or path.startswith("/healthz/"):
                path = "/livez" + path[len("/healthz"):]  # the alias, kept for existing probes
            endpoint, _, only = path[1:].partition("/")
            health = checks.get(endpoint)
            if health is None or (only and only not in health.names()):
                self._send(404, HELP)
                return
            params = parse_qs(query, keep_blank_values=True)
            results = health.run(only=only or None, exclude=params.get("exclude", ()))
            code, text = render(endpoint, results, verbose="verbose" in params)
            self._send(code, text.encode())

        def _metrics(self) -> None:
            encoder, content_type = choose_encoder(self.headers.get("Accept"))
            try:
                body = encoder(registry)
            except Exception as exc:  # noqa: BLE001 - a broken collector must not take the endpoint down
                log.warning("metrics scrape failed: %s", exc)
                self._send(500, f"scrape failed: {exc}\n".encode())
                return
            self._send(200, body, content_type)

        do_HEAD = do_GET

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # SO_REUSEADDR: rebind past TIME_WAIT; Linux still refuses a live listener

    def __init__(self, address, handler, *, max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves socket.getfqdn(host): a reverse DNS lookup
        # that can stall start-up for seconds on nodes with a broken resolver.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # a thread per connection, up to the cap
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request) -> None:
        try:
            request.settimeout(1.0)
            request.sendall(BUSY)
        except OSError:
            pass
        self.shutdown_request(request)


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsExporter:
    """Serves the registry at http://host:port/metrics and the health checks at /livez and /readyz.

    start() binds synchronously, so a port conflict surfaces as a ConfigError at
    start-up, and returns once the server accepts connections.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        liveness: HealthChecks | None = None,
        readiness: HealthChecks | None = None,
        host: str,
        port: int,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        if not 0 <= port < 65536:
            raise ConfigError(f"metrics port {port} is out of range 0-65535; see --metrics-port")
        if max_connections < 1:
            raise ConfigError(f"the metrics server needs at least 1 connection, got {max_connections}")
        self._registry = registry
        self._checks = {"livez": liveness or HealthChecks(LIVENESS), "readyz": readiness or HealthChecks(READINESS)}
        self._host = host
        self._port = port
        self._max_connections = max_connections
        self._request_timeout_s = request_timeout_s
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
        handler = _make_handler(self._registry, self._checks, self._request_timeout_s)
        server_cls = _Server6 if ":" in self._host else _Server
        try:
            server = server_cls((self._host, self._port), handler, max_connections=self._max_connections)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"metrics port {self._port} on {self._host or '*'} is already in use; "
                    "pick another with --metrics-port (0 turns the exporter off)"
                ) from exc
            raise ConfigError(
                f"cannot serve metrics on {self._host}:{self._port}: {exc.strerror or exc}; "
                "check --metrics-host and --metrics-port (0 turns the exporter off)"
            ) from exc
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="elastic-rt-metrics", daemon=True
        )
        self._thread.start()
        bound = f"[{self._host}]" if ":" in self._host else self._host
        log.info("serving /metrics, /livez, /readyz on %s:%d (%s; --metrics-host), at most %d connections; "
                 "try %s/readyz?verbose", bound, self.port, describe_bind(self._host), self._max_connections,
                 self.url)

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
