"""A small threaded TCP proxy that tests and drills put between a client and one target, to cut, delay or heal.

Modes of `cut()`:
- "reset": every open connection is closed with a TCP RST (both sides) and every
  new one is accepted and reset at once: the client sees "connection reset", fast.
- "blackhole": a partition where packets vanish. Open connections stay open but
  nothing is forwarded in either direction (the proxy stops reading, so the
  kernel buffers fill and the sender stalls, as TCP does while retransmitting);
  new connections are accepted but not connected to the target. The client sees
  nothing at all and only its own deadlines or keepalives end the wait. `heal()`
  resumes forwarding on those connections, like a partition that healed before
  TCP gave up.

`delay(seconds)` adds that latency to every chunk in each direction (a round
trip gains about twice of it). The proxy only ever connects to the one target it
was given.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

from elastic_rt.errors import ConfigError

log = logging.getLogger(__name__)

MODES = ("reset", "blackhole")
_CHUNK = 64 * 1024


def format_hostport(host: str, port: int) -> str:
    """'127.0.0.1:80', '[::1]:80'."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a RST, not a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Connection:
    """One client connection and its upstream socket, pumped by two threads."""

    def __init__(self, proxy: "TcpProxy", client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.closed = False
        self._open_directions = 2
        self._sockets_closed = False
        self._lock = threading.Lock()

    def run(self) -> None:
        if not self.proxy._wait_forwarding(self):
            return
        try:
            self.upstream = socket.create_connection(self.proxy.target, timeout=10.0)
            self.upstream.settimeout(None)
        except OSError as exc:
            log.debug("proxy: cannot reach %s: %s", self.proxy.target, exc)
            self.proxy._drop(self, reset=True)
            return
        if self.closed:  # cut while connecting
            _reset(self.upstream)
            return
        t = threading.Thread(target=self._pump, args=(self.upstream, self.client), daemon=True,
                             name="proxy-down")
        t.start()
        self._pump(self.client, self.upstream)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self.closed:
                data = src.recv(_CHUNK)
                if not data:
                    break
                if not self.proxy._wait_forwarding(self):
                    return
                delay = self.proxy.delay_s if dst is self.client or not self.proxy.delay_answers_only else 0.0
                if delay > 0:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            self.proxy._drop(self, reset=False)
            return
        # EOF from src: pass the half-close on; the connection ends when both directions did
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with self._lock:
            self._open_directions -= 1
            done = self._open_directions == 0
        if done:
            self.proxy._drop(self, reset=False)

    def close(self, *, reset: bool) -> None:
        with self._lock:
            if self._sockets_closed:
                return
            self._sockets_closed = True
        self.closed = True
        for sock in (self.client, self.upstream):
            if sock is None:
                continue
            if reset:
                _reset(sock)
            else:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


class TcpProxy:
    """Listen on listen_host:listen_port (0 = a free port) and forward every connection to the target."""

    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1",
                 listen_port: int = 0) -> None:
        if not 0 < int(target_port) < 65536:
            raise ConfigError(f"proxy target port {target_port}: must be a TCP port")
        self.target = (target_host, int(target_port))
        self.listen_host = listen_host
        self._listen_port = int(listen_port)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._conns: set[_Connection] = set()
        self._mode: str | None = None  # None = forwarding
        self._stopped = False
        self.delay_s = 0.0
        self.delay_answers_only = False
        self.accepted = 0

    # ---- lifecycle ----------------------------------------------------------
    def start(self) -> "TcpProxy":
        infos = socket.getaddrinfo(self.listen_host, self._listen_port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"proxy cannot listen on {format_hostport(self.listen_host, self._listen_port)}: "
                              f"{exc.strerror or exc}") from exc
        sock.listen(64)
        self._listener = sock
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="proxy-accept")
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("TcpProxy.port read before start()")
        return self._listener.getsockname()[1]

    @property
    def endpoint(self) -> str:
        """host:port clients connect to ('[::1]:port' for IPv6)."""
        return format_hostport(self.listen_host, self.port)

    @property
    def mode(self) -> str | None:
        """None while forwarding, else the mode of the current cut."""
        return self._mode

    def open_connections(self) -> int:
        with self._cond:
            return len(self._conns)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            conns = list(self._conns)
            self._conns.clear()
            self._cond.notify_all()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for c in conns:
            c.close(reset=True)
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def __enter__(self) -> "TcpProxy":
        return self.start() if self._listener is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- faults -------------------------------------------------------------
    def cut(self, mode: str = "reset") -> None:
        """Stop forwarding: "reset" resets every connection, "blackhole" silently stalls them."""
        if mode not in MODES:
            raise ConfigError(f"proxy cut mode {mode!r}: choose one of {', '.join(MODES)}")
        with self._cond:
            self._mode = mode
            conns = list(self._conns) if mode == "reset" else []
            for c in conns:
                self._conns.discard(c)
                c.closed = True  # wakes any that wait in a black hole
            self._cond.notify_all()
        for c in conns:
            c.close(reset=True)
        log.info("proxy %s -> %s: cut (%s)", self.endpoint, format_hostport(*self.target), mode)

    def heal(self) -> None:
        """Forward again; black-holed connections resume where they stalled."""
        with self._cond:
            self._mode = None
            self._cond.notify_all()
        log.info("proxy %s -> %s: healed", self.endpoint, format_hostport(*self.target))

    def delay(self, seconds: float, *, answers_only: bool = False) -> None:
        """Add `seconds` of latency to every chunk in each direction (0 = none); with answers_only, only to what
        the target sends (a busy server: requests arrive on time, answers come late)."""
        if seconds < 0:
            raise ConfigError(f"proxy delay {seconds:g} s: must be >= 0")
        self.delay_answers_only = answers_only
        self.delay_s = float(seconds)

    # ---- internals ----------------------------------------------------------
    def _accept_loop(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            with self._cond:
                if self._stopped:
                    _reset(client)
                    return
                if self._mode == "reset":
                    _reset(client)
                    continue
                conn = _Connection(self, client)
                self._conns.add(conn)
                self.accepted += 1
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=conn.run, daemon=True, name="proxy-up").start()

    def _wait_forwarding(self, conn: _Connection) -> bool:
        """Block while black-holed; False when the connection was closed or the proxy stopped."""
        with self._cond:
            while self._mode == "blackhole" and not conn.closed and not self._stopped:
                self._cond.wait()
            return not conn.closed and not self._stopped

    def _drop(self, conn: _Connection, *, reset: bool) -> None:
        with self._cond:
            self._conns.discard(conn)
        conn.close(reset=reset)
