"""Process liveness over TCP: a listener per agent, and a watcher of the ring neighbours' listeners.

An etcd lease only expires a TTL after its holder stopped refreshing it. When an agent
process dies (SIGKILL, OOM kill, crash) the kernel closes its sockets at once: peers
holding a connection to its listener read EOF, and reconnecting is refused. That pair,
"held connection closed, then refused", is the liveness evidence of a dead agent; so is
"refused" from a port that answered before. A refusal from a port that never answered
(a firewall's REJECT, an IPv4-only listener behind an IPv6 address) is no evidence at all,
and a host that vanished (power, partition) says nothing: there the lease TTL decides.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from elastic_rt.rendezvous.daemon import Daemon

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64  # each agent is held by its two ring neighbours; the rest is slack


def _format(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Waker:
    """An eventfd (a socketpair where there is none) in a selector: wake() interrupts a blocking select() from
    another thread (a stop, a new peer to connect), so the loops below block without a timeout instead of
    waking every fraction of a second to look (an idle agent, or a thousand simulated ones, costs nothing).
    An eventfd is one descriptor and one system call to make; a socketpair was the largest single cost of a
    node's first round (two sockets, created as every node of a job forms its first round at once)."""

    def __init__(self, sel: selectors.BaseSelector) -> None:
        self._fd: int | None = None
        self._lock = threading.Lock()  # a wake() never writes to a descriptor close() gave back (and reused)
        if hasattr(os, "eventfd"):
            self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            sel.register(self._fd, selectors.EVENT_READ, self)
            return
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        sel.register(self._r, selectors.EVENT_READ, self)

    def wake(self) -> None:
        try:
            if self._fd is not None:
                with self._lock:
                    if self._fd >= 0:
                        os.eventfd_write(self._fd, 1)
            else:
                self._w.send(b"x")
        except (BlockingIOError, OSError):  # full (a wake-up is already pending) or closed
            pass

    def drain(self) -> None:
        try:
            if self._fd is not None:
                os.eventfd_read(self._fd)
                return
            while self._r.recv(512):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        if self._fd is not None:
            with self._lock:
                fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)
            return
        self._r.close()
        self._w.close()


def bind_listener(local_addr: str) -> tuple[socket.socket, str]:
    """A listening socket on --local-addr's address family and interface (port chosen by the kernel).

    A name that resolves to no address of this host (NAT, a DNS name of a load balancer)
    falls back to the wildcard address of the same family; the returned text says which.
    """
    try:
        infos = socket.getaddrinfo(local_addr, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        infos = []
    family, addr = (infos[0][0], infos[0][4][0]) if infos else (socket.AF_INET, "0.0.0.0")
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    note = ""
    try:
        sock.bind((addr, 0))
    except OSError as exc:
        wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
        note = f" (--local-addr {local_addr} -> {addr} is not an address of this host: {exc.strerror})"
        sock.bind((wildcard, 0))
    sock.listen(128)
    sock.setblocking(False)
    host, port = sock.getsockname()[:2]
    return sock, f"{_format(host, port)}{note}"


def free_port() -> int:
    """A TCP port that is free on every interface of this host now (the kernel's choice, bound and let go), for
    rank 0's store. torch's get_free_port() does the same behind a name lookup of "localhost" (a getaddrinfo:
    more CPU than the bind, in every round)."""
    for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((wildcard, 0))
                return sock.getsockname()[1]
        except OSError as exc:
            error = exc
    raise error


class LivenessListener:
    """Accepts connections and keeps them open for as long as this process lives.

    It has no thread of its own: the thread that hosts it waits in serve() (the node's lease thread, between its
    beats: lease.py). Until then, connections wait in the kernel's backlog, and a prober's connect succeeds all the
    same (the kernel completes it); when the process dies they are reset with its other sockets. At most
    `max_connections` are held; beyond that it stops accepting (new connections wait in the kernel's backlog, which a
    prober reads as "no answer", never as "dead").
    """

    def __init__(self, local_addr: str = "0.0.0.0", *, max_connections: int = MAX_CONNECTIONS) -> None:
        self._sock, self.address = bind_listener(local_addr)
        self.port = self._sock.getsockname()[1]
        self._max = max_connections
        self._held = 0
        self._accepting = True
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ)
        self._waker = _Waker(self._sel)
        self._closed = threading.Event()
        self._serving = threading.Lock()  # held by the thread in serve(): close() waits for it
        self._released = False
        log.info("liveness listener on %s", self.address)

    def serve(self, timeout_s: float | None) -> bool:
        """Wait up to timeout_s (None: until close()) for connections and hang-ups, and handle what came; False once
        the listener is closed."""
        with self._serving:
            if self._closed.is_set():  # set before close() releases anything
                return False
            try:
                events = self._sel.select(timeout_s)
            except (OSError, ValueError):
                return False
            for key, _ in events:
                if key.data is self._waker:
                    self._waker.drain()
                    continue
                try:
                    if key.fileobj is self._sock:
                        conn, _ = self._sock.accept()
                        conn.setblocking(False)
                        self._sel.register(conn, selectors.EVENT_READ)
                        self._held += 1
                    elif not key.fileobj.recv(64):  # the peer hung up: forget it
                        self._forget(key.fileobj)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    if key.fileobj is not self._sock:
                        self._forget(key.fileobj)
            self._throttle()
            return not self._closed.is_set()

    def _forget(self, conn) -> None:
        try:
            self._sel.unregister(conn)
            conn.close()
            self._held -= 1
        except (KeyError, ValueError, OSError):
            pass

    def _throttle(self) -> None:
        if self._accepting and self._held >= self._max:
            self._sel.unregister(self._sock)
            self._accepting = False
            log.warning("liveness listener %s holds %d connections (the cap); not accepting more",
                        self.address, self._held)
        elif not self._accepting and self._held < self._max:
            self._sel.register(self._sock, selectors.EVENT_READ)
            self._accepting = True

    def close(self) -> None:
        """Stop listening (the port refuses from now on) and drop every held connection (peers read EOF), as the
        process exiting would: once a serve() in progress returned (it is woken)."""
        self._closed.set()
        self._waker.wake()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._serving:
            if self._released:
                return
            self._released = True
            for key in list(self._sel.get_map().values()):
                if key.fileobj is not self._sock and key.data is not self._waker:
                    self._forget(key.fileobj)
            self._sel.close()
            self._waker.close()


@dataclass(frozen=True)
class Peer:
    node: str
    addr: str
    port: int
    lease: int


def parse_peer(node: str, info: bytes, lease: int) -> Peer | None:
    try:
        data = json.loads(info.decode())
        return Peer(node, str(data["addr"]), int(data["liveness_port"]), lease)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def probe(peer: Peer, timeout_s: float = 0.5) -> tuple[str, socket.socket | None]:
    """("open", the connection) | ("refused", None) | ("unreachable", None)."""
    try:
        return "open", socket.create_connection((peer.addr, peer.port), timeout=timeout_s)
    except ConnectionRefusedError:
        return "refused", None
    except OSError:
        return "unreachable", None


def ring_neighbours(nodes: tuple[str, ...], me: str) -> list[str]:
    """The nodes after and before `me` in round order: each node is watched by two others."""
    if me not in nodes or len(nodes) < 2:
        return []
    i, n = nodes.index(me), len(nodes)
    return sorted({nodes[(i + 1) % n], nodes[(i - 1) % n]} - {me})


class PeerWatch:
    """Holds a connection to each watched peer's listener and collects evidence of death.

    `on_dead(peer)` is called once when a peer's agent is known gone (its held connection
    closed and it refuses, or a port that answered before refuses); `dead(node)` says so later.
    Unreachable peers are retried every `retry_s`; otherwise the thread sleeps in select() until a
    held connection or the waker (watch(), stop()) says something.
    """

    def __init__(self, on_dead: Callable[[Peer], None], *, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._on_dead = on_dead
        self._retry_s = retry_s
        self._clock = clock
        self._sel = selectors.DefaultSelector()
        self._waker = _Waker(self._sel)
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._answered: set[Peer] = set()  # peers whose port accepted a connection at least once
        self._pending: dict[str, float] = {}  # node -> when to try connecting again
        self._dead: set[Peer] = set()
        self._stop = threading.Event()
        self._thread = Daemon(self._run, "elastic-rt-peer-watch")
        self._thread.start()

    def watch(self, peers: list[Peer]) -> None:
        """Replace the watched set (after every rendezvous); connections to peers kept are kept."""
        with self._lock:
            wanted = {p.node: p for p in peers}
            for key in self._held():
                if wanted.get(key.data.node) != key.data:
                    self._sel.unregister(key.fileobj)
                    key.fileobj.close()
            held = {key.data.node for key in self._held()}
            self._peers = wanted
            self._pending = {node: 0.0 for node in wanted if node not in held}
        self._connect_pending()
        self._waker.wake()  # the thread's next retry time may have changed

    def _held(self) -> list[selectors.SelectorKey]:
        """The held connections' keys (the caller holds the lock)."""
        keys = self._sel.get_map()  # None once the thread closed the selector (after stop())
        return [key for key in keys.values() if key.data is not self._waker] if keys is not None else []

    def dead(self, node: str) -> bool:
        with self._lock:
            peer = self._peers.get(node)
            return peer is not None and peer in self._dead

    def _connect_pending(self) -> None:
        now = self._clock()
        with self._lock:
            due = [self._peers[n] for n, t in self._pending.items() if t <= now and n in self._peers]
        for peer in due:
            self._try(peer, after_close=False)

    def _try(self, peer: Peer, *, after_close: bool) -> None:
        state, conn = probe(peer)
        report = False
        with self._lock:
            if self._peers.get(peer.node) != peer:  # no longer watched
                if conn is not None:
                    conn.close()
                return
            if state == "open" and any(k.data == peer for k in self._held()):
                conn.close()  # another thread got there first
            elif state == "open":
                conn.setblocking(False)
                self._sel.register(conn, selectors.EVENT_READ, peer)
                self._answered.add(peer)
                self._pending.pop(peer.node, None)
            elif state == "refused" and (after_close or peer in self._answered):
                report = peer not in self._dead
                self._dead.add(peer)
                self._pending.pop(peer.node, None)
            else:
                if state == "refused" and peer.node in self._pending and self._pending[peer.node] == 0.0:
                    log.info("node %s's liveness port %s refused the first connection; its lease alone "
                             "tells whether it lives", peer.node, _format(peer.addr, peer.port))
                self._pending[peer.node] = self._clock() + self._retry_s
        if report:
            try:
                self._on_dead(peer)
            except Exception as exc:  # noqa: BLE001 - e.g. etcd unreachable: the lease still expires
                log.warning("could not evict node %s: %s", peer.node, exc)

    def _run(self) -> None:
        try:
            self._watch_until_stopped()
        finally:
            with self._lock:
                for key in self._held():
                    key.fileobj.close()
                self._peers, self._pending = {}, {}  # a late watch() or retry finds nothing to do
                self._sel.close()
                self._waker.close()

    def _watch_until_stopped(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                due = min(self._pending.values(), default=None)
            timeout = None if due is None else max(0.0, due - self._clock())
            try:
                events = self._sel.select(timeout=timeout)
            except (OSError, ValueError):
                if self._stop.wait(0.2):
                    break
                continue
            for key, _ in events:
                if key.data is self._waker:
                    self._waker.drain()
                    continue
                try:
                    data = key.fileobj.recv(64)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:
                    continue
                with self._lock:
                    try:
                        self._sel.unregister(key.fileobj)
                    except (KeyError, ValueError):
                        continue
                    key.fileobj.close()
                self._try(key.data, after_close=True)
            self._connect_pending()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for key in self._held():
                self._sel.unregister(key.fileobj)
                key.fileobj.close()
            self._peers = {}
            self._pending = {}
        self._waker.wake()
