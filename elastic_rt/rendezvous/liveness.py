"""Process liveness over TCP: a listener per agent, and a watcher of the ring neighbours' listeners.

An etcd lease only expires a TTL after its holder stopped refreshing it. When an agent
process dies (SIGKILL, OOM kill, crash) the kernel closes its sockets at once: peers
connected to its listener read EOF, and new connections are refused. A host that
vanished (power, partition) says nothing; there the lease TTL decides.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)


class LivenessListener:
    """Accepts connections and keeps them open for as long as this process lives."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.listen(128)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ)
        self._closed = threading.Event()
        threading.Thread(target=self._serve, name="elastic-rt-liveness", daemon=True).start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                events = self._sel.select(timeout=0.5)
            except (OSError, ValueError):
                return
            for key, _ in events:
                try:
                    if key.fileobj is self._sock:
                        conn, _ = self._sock.accept()
                        conn.setblocking(False)
                        self._sel.register(conn, selectors.EVENT_READ)
                    elif not key.fileobj.recv(64):  # the peer hung up: forget it
                        self._sel.unregister(key.fileobj)
                        key.fileobj.close()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    try:
                        self._sel.unregister(key.fileobj)
                        key.fileobj.close()
                    except (KeyError, ValueError, OSError):
                        pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass


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


def process_is_gone(peer: Peer, timeout_s: float = 0.3) -> bool:
    """True only when the peer's liveness port refuses connections: its agent process is dead."""
    try:
        with socket.create_connection((peer.addr, peer.port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # unreachable or slow: inconclusive, the lease TTL decides


def ring_neighbours(nodes: tuple[str, ...], me: str) -> list[str]:
    """The nodes after and before `me` in round order: each node is watched by two others."""
    if me not in nodes or len(nodes) < 2:
        return []
    i, n = nodes.index(me), len(nodes)
    return sorted({nodes[(i + 1) % n], nodes[(i - 1) % n]} - {me})


class PeerWatch:
    """Holds a connection to each watched peer's listener; calls on_dead(peer) when its process dies."""

    def __init__(self, on_dead: Callable[[Peer], None]) -> None:
        self._on_dead = on_dead
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-rt-peer-watch", daemon=True)
        self._thread.start()

    def watch(self, peers: list[Peer]) -> None:
        """Replace the watched set (after every rendezvous)."""
        with self._lock:
            for key in list(self._sel.get_map().values()):
                self._sel.unregister(key.fileobj)
                key.fileobj.close()
            for peer in peers:
                try:
                    conn = socket.create_connection((peer.addr, peer.port), timeout=1.0)
                except ConnectionRefusedError:
                    self._report(peer)
                    continue
                except OSError:
                    continue  # unreachable now: the lease decides
                conn.setblocking(False)
                self._sel.register(conn, selectors.EVENT_READ, peer)

    def _report(self, peer: Peer) -> None:
        try:
            self._on_dead(peer)
        except Exception as exc:  # noqa: BLE001 - e.g. etcd unreachable: the lease still expires
            log.warning("could not evict node %s: %s", peer.node, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                has = bool(self._sel.get_map())
            if not has:
                self._stop.wait(0.2)
                continue
            try:
                events = self._sel.select(timeout=0.2)
            except (OSError, ValueError):
                continue
            for key, _ in events:
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
                if process_is_gone(key.data):
                    self._report(key.data)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for key in list(self._sel.get_map().values()):
                self._sel.unregister(key.fileobj)
                key.fileobj.close()
