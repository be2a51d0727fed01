"""The memory tier seen from a worker: snapshots in node memory, one namespace over all nodes, ring replicas.

A snapshot is an ordinary checkpoint (DCP shards, per-rank files, a create-only manifest carrying
the writer's fencing token, signed under the job secret) written to a `Storage` whose writes go to
this node's tier directory (`own/` in /dev/shm, owned by the agent) and whose reads find a file in
`own/`, then in `replicas/` (what the ring predecessor pushed here), then at the live peers'
replica servers (checkpoint/replica_channel.py). Saving, verifying and resharding loads are the
storage tier's code, unchanged: a snapshot loads at any world size as a checkpoint does.

After each snapshot's commit, every rank pushes the files it wrote (rank 0 also the manifest) to
the next node of the ring (nodes in the order of their lowest rank); the receiver keeps a file only
when its crc32 matches the manifest's. Each node's lowest rank then keeps the two newest snapshot
steps in its tier and removes the rest. With one node there is no replica.
"""

from __future__ import annotations

import io
import logging
import os
import posixpath
import shutil
from dataclasses import dataclass, field
from typing import BinaryIO, Mapping

from elastic_rt.checkpoint import collectives as coll
from elastic_rt.checkpoint.backends import PosixStorage, StorageError
from elastic_rt.checkpoint.manifest import manifest_name
from elastic_rt.checkpoint.replica_channel import ChannelError, ReplicaClient
from elastic_rt.checkpoint.storage import STEP_DIR_RE, CheckpointStore, step_dirname
from elastic_rt.checkpoint import checksum
from elastic_rt.checkpoint.secret import read_secret_file

log = logging.getLogger(__name__)

ENV_MEMORY_TIER_DIR = "ELASTIC_RT_MEMORY_TIER_DIR"  # the node's tier: own/ and replicas/ below it
ENV_MEMORY_TIER_ADDR = "ELASTIC_RT_MEMORY_TIER_ADDR"  # host:port of the node's replica server
ENV_MEMORY_TIER_SECRET = "ELASTIC_RT_MEMORY_TIER_SECRET_FILE"  # the job secret's file, when the agent has one
KEEP_SNAPSHOTS = 2
VIRTUAL_ROOT = "/memory-tier"


@dataclass
class ReadCounts:
    """Where a tier's file reads were served from (what the tests and the restore log count)."""

    own: int = 0
    replicas: int = 0
    peers: dict[str, int] = field(default_factory=dict)


class TierStorage:
    """The Storage of snapshots. Paths are under the same virtual root on every node (the loader hands
    rank 0's paths to every rank); writes go to this node's `own/`, reads come from `own/`, `replicas/`,
    then the peers' servers."""

    local = True
    fs = None
    root = VIRTUAL_ROOT

    def __init__(self, directory: str, *, node: str, peers: list[ReplicaClient]) -> None:
        self.url = f"memory-tier://{node}"
        self.own = os.path.join(directory, "own")
        self.replicas = os.path.join(directory, "replicas")
        self._disk = PosixStorage(self.url, None, self.own)
        self.peers = peers
        self.counts = ReadCounts()

    def _rel(self, path: str) -> str:
        rel = posixpath.relpath(path, VIRTUAL_ROOT)
        if rel == ".." or rel.startswith("../"):
            raise StorageError(f"{path} is outside the memory tier")
        return rel

    def _own(self, path: str) -> str:
        return os.path.join(self.own, self._rel(path))

    def _replica(self, path: str) -> str:
        return os.path.join(self.replicas, self._rel(path))

    def _from_peers(self, path: str) -> bytes:
        for peer in self.peers:
            try:
                data = peer.get(self._rel(path))
            except FileNotFoundError:
                continue
            except ChannelError as exc:
                log.warning("memory tier: reading %s: %s", self._rel(path), exc)
                continue
            self.counts.peers[peer.address] = self.counts.peers.get(peer.address, 0) + 1
            return data
        raise FileNotFoundError(path)

    def listdir(self, path: str) -> dict[str, int | None]:
        merged: dict[str, int | None] = {}
        found = False
        for peer in self.peers:
            try:
                merged.update(peer.listdir(self._rel(path)))
                found = True
            except FileNotFoundError:
                pass
            except ChannelError as exc:
                log.warning("memory tier: listing %s: %s", self._rel(path), exc)
        for local in (self._replica(path), self._own(path)):  # this node's own files win
            try:
                merged.update(self._disk.listdir(local))
                found = True
            except FileNotFoundError:
                pass
        if not found:
            raise FileNotFoundError(path)
        return {k: v for k, v in merged.items() if ".tmp" not in k}

    def read(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    def size(self, path: str) -> int:
        for local in (self._own(path), self._replica(path)):
            try:
                return os.stat(local).st_size
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StorageError(f"memory tier: {local}: {exc}") from exc
        size = self.listdir(posixpath.dirname(path)).get(posixpath.basename(path))
        if size is None:
            raise FileNotFoundError(path)
        return size

    def open_read(self, path: str) -> BinaryIO:
        try:
            stream = self._disk.open_read(self._own(path))
            self.counts.own += 1
            return stream
        except FileNotFoundError:
            pass
        try:
            stream = self._disk.open_read(self._replica(path))
            self.counts.replicas += 1
            return stream
        except FileNotFoundError:
            pass
        return io.BytesIO(self._from_peers(path))

    def _with_parent(self, path: str) -> str:
        local = self._own(path)
        os.makedirs(os.path.dirname(local), mode=0o700, exist_ok=True)  # a rank on another node than rank 0's
        return local

    def open_write(self, path: str) -> BinaryIO:
        return self._disk.open_write(self._with_parent(path))

    def write(self, path: str, data: bytes, *, sync: bool) -> None:
        self._disk.write(self._with_parent(path), data, sync=sync)

    def create(self, path: str, data: bytes) -> None:
        self._disk.create(self._with_parent(path), data)

    def makedir(self, path: str, *, sync: bool) -> None:
        self._disk.makedir(self._own(path), sync=sync)

    def rename(self, src: str, dst: str, *, sync: bool) -> None:
        self._disk.rename(self._own(src), self._own(dst), sync=sync)

    def remove(self, path: str) -> None:
        self._disk.remove(self._own(path))

    def remove_tree(self, path: str) -> None:
        self._disk.remove_tree(self._own(path))

    def rmdir(self, path: str) -> None:
        self._disk.rmdir(self._own(path))

    def sync_file(self, stream: BinaryIO) -> None:
        self._disk.sync_file(stream)

    def sync_dir(self, path: str) -> None:
        self._disk.sync_dir(self._own(path))


class MemoryTier:
    """One rank's memory tier: its storage, its node's peers, the ring successor, the pushes."""

    def __init__(self, *, directory: str, address: str, secret: bytes | None, rank: int,
                 groups: coll.CheckpointGroups) -> None:
        self.rank = rank
        everyone: list[str] = coll.all_gather(address, groups.ctl)  # rank -> its node's server
        nodes = list(dict.fromkeys(everyone))  # in the order of their lowest rank
        self.node_count = len(nodes)
        self.leader = everyone.index(address) == rank  # the node's lowest rank prunes its tier
        mine = nodes.index(address)
        self.successor = None
        peers: list[ReplicaClient] = []
        if secret is not None and len(nodes) > 1:
            ring = nodes[mine + 1:] + nodes[:mine]  # the successor first
            peers = [ReplicaClient(address=a, secret=secret) for a in ring]
            self.successor = peers[0]
        elif len(nodes) > 1 and rank == 0:
            log.warning("memory tier: no job secret, so snapshots are not replicated to another node and a "
                        "node's snapshots are not read from the others (--rdzv-conf secret_file)")
        self.storage = TierStorage(directory, node=address, peers=peers)
        self.store = CheckpointStore(self.storage.url, storage=self.storage, secret=secret)
        self._directory = directory
        self._push_warned: set[int] = set()

    @classmethod
    def from_env(cls, *, rank: int, groups: coll.CheckpointGroups, secret: bytes | None,
                 environ: Mapping[str, str] = os.environ) -> "MemoryTier | None":
        directory, address = environ.get(ENV_MEMORY_TIER_DIR, ""), environ.get(ENV_MEMORY_TIER_ADDR, "")
        if secret is None and environ.get(ENV_MEMORY_TIER_SECRET):
            secret = read_secret_file(environ[ENV_MEMORY_TIER_SECRET], setting="--rdzv-conf secret_file",
                                      hint="e.g. openssl rand -hex 32")
        present = bool(directory and address and os.path.isdir(directory))
        if not all(coll.all_gather(present, groups.ctl)):
            if rank == 0:
                log.warning("memory tier off: not every rank runs under an elastic-rt agent with a memory tier "
                            "(elastic-rt launch, --host-cache on); snapshots go nowhere, persisted saves as usual")
            return None
        return cls(directory=directory, address=address, secret=secret, rank=rank, groups=groups)

    # ---- after a snapshot's commit (every rank, on the writer thread) --------------------------------
    def after_commit(self, step: int, groups: coll.CheckpointGroups, keep_from: int | None) -> bool:
        """Push this rank's files of the committed snapshot `step` to the ring successor and prune. True on every
        rank when every rank's push succeeded (or there is no peer to push to): the step survives the loss of any
        one node; False on every rank otherwise (it is in its nodes' own memory only)."""
        files = None
        if self.rank == 0:
            entry = self.store.entry(step)
            m = entry.manifest
            if m is not None:
                data = posixpath.relpath(entry.data_dir(m), VIRTUAL_ROOT)
                files = ([(posixpath.join(data, f.path), f.crc32, f.rank) for f in m.files]
                         + [(posixpath.join(step_dirname(step), manifest_name(m.generation)), None, 0)])
        files = coll.broadcast(files, groups.io)
        pushed = True
        if files and self.successor is not None:
            pushed = self._push([(p, crc) for p, crc, r in files if r == self.rank], step)
        replicated = not coll.any_true(not pushed, groups.io)
        if self.leader:
            self.prune(keep={s for s in (step, keep_from) if s is not None}, above=None)
        return replicated

    def _push(self, files: list[tuple[str, int | None]], step: int) -> bool:
        for rel, crc in files:
            local = os.path.join(self.storage.own, rel)
            try:
                if crc is None:  # the manifest: checked by its own checksum and signature; crc32 for the wire
                    with open(local, "rb") as f:
                        crc = checksum.crc32(f.read())
                self.successor.put_file(rel, local, crc32=crc)  # type: ignore[union-attr]
            except (OSError, ChannelError) as exc:
                if step not in self._push_warned:
                    self._push_warned.add(step)
                    log.warning("rank %d: snapshot step %d not replicated to %s (%s); a loss of this node "
                                "falls back to storage for it", self.rank, step,
                                self.successor.address, exc)  # type: ignore[union-attr]
                return False
        return True

    def prune(self, *, keep: set[int], above: int | None) -> None:
        """Remove this node's snapshot steps (own and replicas) outside `keep` (and, with `above`, every step
        newer than it: a timeline abandoned by a restore of an older step)."""
        newest_kept = sorted(keep)[-KEEP_SNAPSHOTS:]
        for base in (self.storage.own, self.storage.replicas):
            try:
                names = os.listdir(base)
            except FileNotFoundError:
                continue
            for name in names:
                m = STEP_DIR_RE.match(name)
                if not m:
                    continue
                step = int(m.group(1))
                if (above is not None and step > above) or (above is None and step not in newest_kept):
                    shutil.rmtree(os.path.join(base, name), ignore_errors=True)
