"""HTTP endpoint serving /metrics (Prometheus text), /livez and /readyz (and /healthz, an alias of /livez)
from daemon threads: request heads read by one selector thread, answers capped, probes never behind scrapes."""

from __future__ import annotations

import errno
import io
import logging
import socket
import selectors
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from elastic_rt.errors import ConfigError
from elastic_rt.metrics.health_endpoints import LIVENESS, READINESS, HealthChecks, render

log = logging.getLogger(__name__)

# Requests answered at once (each in a thread): Prometheus and an operator's curl need a handful; past the cap a
# request is answered 503 at once, so a scrape storm cannot pile up threads. Probes have slots of their own.
DEFAULT_MAX_CONNECTIONS = 16
PROBE_SLOTS = 4
# A client that connects and sends no whole request head (or dribbles) is closed after this long; it holds a
# file descriptor meanwhile, never a thread or a slot. Past MAX_PENDING such clients the oldest is closed.
DEFAULT_REQUEST_TIMEOUT_S = 10.0
MAX_PENDING = 256
MAX_HEAD_BYTES = 16384
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
        timeout = timeout_s  # socket timeout of the answer

        def setup(self) -> None:  # the request's head was read by _Reader: it comes with the socket
            self.connection, head = self.request
            self.connection.settimeout(self.timeout)
            self.rfile = io.BytesIO(head)
            self.wfile = socketserver._SocketWriter(self.connection)

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


class _Server(socketserver.TCPServer):
    """Accepts in the serving thread and hands each connection to the reader; a request is answered in a thread of
    its own once it has arrived whole: probes (/livez, /readyz, /healthz) within probe slots of their own, so that
    neither idle connections nor slow scrapes ever queue them; anything else within the cap."""

    allow_reuse_address = True  # SO_REUSEADDR: rebind past TIME_WAIT; Linux still refuses a live listener

    def __init__(self, address, handler, *, max_connections: int, request_timeout_s: float) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self._probe_slots = threading.BoundedSemaphore(PROBE_SLOTS)
        self._reader = _Reader(self._dispatch, timeout_s=request_timeout_s)
        super().__init__(address, handler)  # a failed bind calls server_close(): the reader stops with it

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves socket.getfqdn(host): a reverse DNS lookup
        # that can stall start-up for seconds on nodes with a broken resolver.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request(self, request, client_address) -> None:
        self._reader.add(request, client_address)  # no thread until the request has arrived

    def _dispatch(self, request: socket.socket, client_address, head: bytes) -> None:
        slots = self._probe_slots if _is_probe(head) else self._slots
        if not slots.acquire(blocking=False):
            self._refuse(request)
            return

        def answer() -> None:
            try:
                self.finish_request((request, head), client_address)
            except Exception:  # noqa: BLE001 - one bad request must not end the server
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
                slots.release()

        threading.Thread(target=answer, name="elastic-rt-metrics-request", daemon=True).start()

    def _refuse(self, request) -> None:
        try:
            request.settimeout(1.0)
            request.sendall(BUSY)
        except OSError:
            pass
        self.shutdown_request(request)

    def server_close(self) -> None:
        self._reader.close()
        super().server_close()


def _is_probe(head: bytes) -> bool:
    """The request line asks for /livez, /readyz or /healthz (or one of their checks)."""
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""
    return any(path == p or path.startswith(p + b"/") for p in (b"/livez", b"/readyz", b"/healthz"))


class _Reader:
    """One thread that reads every accepted connection's request head (non-blocking, select): an idle or dribbling
    client costs a file descriptor, never a thread or a slot. A head is handed on once whole (its blank line), a
    connection is closed after timeout_s without one, and past MAX_PENDING the oldest waiting one is closed."""

    def __init__(self, dispatch, *, timeout_s: float, clock=time.monotonic) -> None:
        self._dispatch = dispatch
        self._timeout_s = timeout_s
        self._clock = clock
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._new: list[tuple[socket.socket, object]] = []
        self._waiting: dict[socket.socket, tuple[object, bytearray, float]] = {}  # insertion order: oldest first
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="elastic-rt-metrics-reader", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, addr) -> None:
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._new.append((sock, addr))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(5.0)

    def _drop(self, sock: socket.socket) -> None:
        self._waiting.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        try:
            sock.close()
        except OSError:
            pass

    def _run(self) -> None:
        while True:
            with self._lock:
                closed, new, self._new = self._closed, self._new, []
            if closed:
                for sock, _ in new:
                    sock.close()
                for sock in list(self._waiting):
                    self._drop(sock)
                self._selector.close()
                self._wake_r.close()
                self._wake_w.close()
                return
            now = self._clock()
            for sock, addr in new:
                sock.setblocking(False)
                self._waiting[sock] = (addr, bytearray(), now + self._timeout_s)
                self._selector.register(sock, selectors.EVENT_READ)
            while len(self._waiting) > MAX_PENDING:
                self._drop(next(iter(self._waiting)))
            for sock in [s for s, (_, _, deadline) in self._waiting.items() if deadline <= now]:
                self._drop(sock)
            wait = min((d for _, _, d in self._waiting.values()), default=now + 1.0) - now
            for key, _ in self._selector.select(max(0.0, min(wait, 1.0))):
                if key.fileobj is self._wake_r:
                    try:
                        while self._wake_r.recv(256):
                            pass
                    except OSError:
                        pass
                    continue
                self._read(key.fileobj)

    def _read(self, sock: socket.socket) -> None:
        addr, buf, _ = self._waiting[sock]
        try:
            chunk = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk or len(buf) + len(chunk) > MAX_HEAD_BYTES:
            self._drop(sock)
            return
        buf += chunk
        if b"\r\n\r\n" in buf or b"\n\n" in buf:
            self._waiting.pop(sock)
            self._selector.unregister(sock)
            sock.setblocking(True)
            self._dispatch(sock, addr, bytes(buf))


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
            server = server_cls((self._host, self._port), handler, max_connections=self._max_connections,
                                request_timeout_s=self._request_timeout_s)
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
        log.info("serving /metrics, /livez, /readyz on %s:%d (%s; --metrics-host), at most %d requests at once "
                 "and %d probes besides; try %s/readyz?verbose", bound, self.port, describe_bind(self._host),
                 self._max_connections, PROBE_SLOTS, self.url)

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
