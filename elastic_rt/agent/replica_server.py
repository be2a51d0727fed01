"""The agent's replica server: serves the node's memory tier to peers, holds their replicas within a budget.

The tier's directory (in /dev/shm, under the agent's host-memory directory) has two parts:
`own/` (what this node's workers snapshot, written by them directly) and `replicas/` (what the
ring predecessor's workers pushed here). Peers see one namespace: a LIST merges both, a GET reads
`own/` first. A PUT streams into a temporary file one chunk at a time and is kept only when its
bytes match the crc32 it announced, and only while the replicas stay within `max_replica_bytes`
(the sizing is in docs/checkpoint.md); otherwise it is refused and the pusher logs a warning.
Every request is authenticated with the job secret (checkpoint/replica_channel.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import socketserver
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from elastic_rt.checkpoint import replica_channel as ch
from elastic_rt.checkpoint import checksum

log = logging.getLogger(__name__)

OWN, REPLICAS = "own", "replicas"


def tree_bytes(root: str) -> int:
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


@dataclass(frozen=True, kw_only=True)
class ReplicaServerConfig:
    directory: str  # the tier's directory: own/ and replicas/ below it
    secret: bytes
    node: str
    max_replica_bytes: int
    bind_host: str = "0.0.0.0"
    advertise_host: str = "127.0.0.1"


class ReplicaServer:
    """A threaded TCP server on a free port; `address` is what workers hand to their peers."""

    def __init__(self, config: ReplicaServerConfig, *, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.own = os.path.join(config.directory, OWN)
        self.replicas = os.path.join(config.directory, REPLICAS)
        os.makedirs(self.own, mode=0o700, exist_ok=True)
        os.makedirs(self.replicas, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()  # admission against the budget
        self._incoming = 0
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((config.bind_host, 0), Handler)
        self.address = f"{config.advertise_host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), name="elastic-rt-replicas",
                                        daemon=True)
        self.refused = Counter("elastic_rt_memory_tier_replicas_refused", "Replica files refused (bad crc32, over "
                               "the budget, unauthenticated).", ["node", "reason"], registry=registry)
        if registry is not None:
            footprint = Gauge("elastic_rt_memory_tier_bytes", "Bytes this node's memory tier holds in host memory: "
                              "its own snapshots and the replicas of its ring predecessor's.", ["node", "kind"],
                              registry=registry)
            footprint.labels(config.node, OWN).set_function(lambda: tree_bytes(self.own))
            footprint.labels(config.node, REPLICAS).set_function(lambda: tree_bytes(self.replicas))
            Gauge("elastic_rt_memory_tier_replica_budget_bytes", "The most bytes of replicas this node holds.",
                  ["node"], registry=registry).labels(config.node).set(config.max_replica_bytes)

    def start(self) -> "ReplicaServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- one request -------------------------------------------------------------------------------
    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(ch.IO_TIMEOUT_S)
        nonce = secrets.token_bytes(ch.NONCE_BYTES)
        secret = self.config.secret
        try:
            sock.sendall(nonce)
            header = ch.recv_header(sock, secret, nonce)
            if header is None:
                self.refused.labels(self.config.node, "unauthenticated").inc()
                log.warning("[%s] replica request from %s refused: not signed with the job secret",
                            self.config.node, sock.getpeername()[0])
                return  # no answer: whoever sent it learns nothing
            rel = ch.safe_relpath(header.get("path", ""))
            if rel is None:
                ch.send_header(sock, secret, nonce, {"error": f"bad path {header.get('path')!r}"}, reply=True)
                return
            op = header.get("op")
            if op == "list":
                ch.send_header(sock, secret, nonce, self._list(rel), reply=True)
            elif op == "get":
                self._get(sock, nonce, rel)
            elif op == "put":
                self._put(sock, nonce, rel, int(header["size"]), int(header["crc32"]))
            else:
                ch.send_header(sock, secret, nonce, {"error": f"unknown op {op!r}"}, reply=True)
        except (OSError, ValueError, KeyError) as exc:
            log.info("[%s] replica request failed: %s", self.config.node, exc)

    def _list(self, rel: str) -> dict:
        entries: dict[str, int | None] = {}
        found = False
        for base in (self.replicas, self.own):  # own/ wins a name both hold
            try:
                with os.scandir(os.path.join(base, rel)) as it:
                    for e in it:
                        if ".tmp" not in e.name:
                            entries[e.name] = None if e.is_dir() else e.stat().st_size
                found = True
            except (FileNotFoundError, NotADirectoryError):
                continue
        return {"entries": entries} if found else {"error": "not found", "missing": True}

    def _get(self, sock: socket.socket, nonce: bytes, rel: str) -> None:
        for base in (self.own, self.replicas):
            path = os.path.join(base, rel)
            try:
                f = open(path, "rb")
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                continue
            with f:  # two passes, one chunk at a time: the crc32 goes in the header, ahead of the bytes
                size, crc = os.fstat(f.fileno()).st_size, 0
                for chunk in ch.file_chunks(f):
                    crc = checksum.crc32(chunk, crc)
                f.seek(0)
                ch.send_header(sock, self.config.secret, nonce, {"size": size, "crc32": crc}, reply=True)
                ch.send_file(sock, f)
            return
        ch.send_header(sock, self.config.secret, nonce, {"error": "not found", "missing": True}, reply=True)

    def _put(self, sock: socket.socket, nonce: bytes, rel: str, size: int, crc32: int) -> None:
        secret = self.config.secret
        with self._lock:
            held = tree_bytes(self.replicas) + self._incoming
            admitted = held + size <= self.config.max_replica_bytes
            if admitted:
                self._incoming += size
        final = os.path.join(self.replicas, rel)
        tmp = f"{final}.tmp{threading.get_ident()}"
        error = None
        try:
            if not admitted:
                self.refused.labels(self.config.node, "budget").inc()
                error = (f"node {self.config.node} holds {held >> 20} MiB of replicas; {rel} ({size >> 20} MiB) "
                         f"would pass its budget of {self.config.max_replica_bytes >> 20} MiB "
                         "(--memory-tier-replica-gib)")
                for _chunk in ch.recv_chunks(sock, size):  # drained, not kept: the pusher reads the reason
                    pass
            else:
                os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
                crc = 0
                with open(tmp, "wb") as f:
                    for chunk in ch.recv_chunks(sock, size):
                        crc = checksum.crc32(chunk, crc)
                        f.write(chunk)
                if crc != crc32:
                    self.refused.labels(self.config.node, "crc32").inc()
                    error = f"{rel} arrived with crc32 {crc:08x}, announced {crc32:08x}: not kept"
                else:
                    os.replace(tmp, final)
        finally:
            if admitted:
                with self._lock:
                    self._incoming -= size
            if os.path.exists(tmp):
                os.unlink(tmp)
        ch.send_header(sock, secret, nonce, {"error": error} if error else {"ok": True}, reply=True)


def replica_budget_bytes(shm_root: str = "/dev/shm", fraction: float = 0.25) -> int:
    """The default budget for replicas: a quarter of the shared-memory file system (the node's own two
    snapshots and its ring predecessor's two fit in half of it when the nodes hold alike)."""
    st = os.statvfs(shm_root)
    return int(st.f_frsize * st.f_blocks * fraction)


def start_memory_tier(*, host_cache: str, node: str, secret_file: str | None, advertise_host: str,
                      max_replica_bytes: int, registry: CollectorRegistry | None,
                      environ=os.environ) -> ReplicaServer | None:
    """The node's memory tier below its host-memory directory, handed to the workers through their
    environment; its replica server when the job has a secret (without one, the tier is this node's
    alone: nothing is replicated, nothing is served)."""
    from elastic_rt.checkpoint.memory_tier import ENV_MEMORY_TIER_ADDR, ENV_MEMORY_TIER_DIR, ENV_MEMORY_TIER_SECRET

    from elastic_rt.checkpoint.secret import read_secret_file

    secret = read_secret_file(secret_file, setting="--rdzv-conf secret_file", hint="e.g. openssl rand -hex 32") if secret_file else None
    directory = os.path.join(host_cache, "tier")
    os.makedirs(os.path.join(directory, OWN), mode=0o700, exist_ok=True)
    server = None
    address = f"{node}:node-local"
    if secret is not None:
        server = ReplicaServer(ReplicaServerConfig(directory=directory, secret=secret, node=node,
                                                   max_replica_bytes=max_replica_bytes,
                                                   advertise_host=advertise_host), registry=registry).start()
        address = server.address
        log.info("[%s] memory tier in %s, replicas served at %s (budget %d MiB)", node, directory, address,
                 max_replica_bytes >> 20)
    else:
        log.info("[%s] memory tier in %s without replicas: no job secret (--rdzv-conf secret_file)", node, directory)
    environ[ENV_MEMORY_TIER_DIR], environ[ENV_MEMORY_TIER_ADDR] = directory, address
    if secret_file:
        environ[ENV_MEMORY_TIER_SECRET] = secret_file
    return server
