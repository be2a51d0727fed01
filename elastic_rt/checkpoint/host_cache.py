"""Checkpoint files kept in host shared memory so a worker restarted on the same node loads without storage.

The agent owns one directory per node (`/dev/shm/elastic-rt-<run>-<node>/`, handed to
workers as ELASTIC_RT_HOST_CACHE_DIR, removed when the agent exits). After a save is
committed, each rank copies the files it wrote there in the background, under names
that carry the manifest's size and crc32: `step_<N>/<file>@<crc32>-<size>`; only the
newest step is kept. Storage stays the truth: the step is the one the loader agrees on
from storage, and a memory copy is used only when its name matches that step's manifest
entry and its bytes match the crc32. A copy that does not (corrupt, or stale: another
timeline's bytes for the same step) is skipped with one warning, and the file is read
from storage, its crc32 checked as it is read.

The crc32 of a copy is checked when it is made (against the manifest, as it is copied) and a
stamp beside it records the file's inode change time then. At load, a copy whose stamp still
holds was not written since (any write, truncation or replacement moves ctime, which no process
can set back) and is used without reading it twice; any other copy has its crc32 computed again.
"""

from __future__ import annotations

import io
import logging
import mmap
import os
import posixpath
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Mapping

from elastic_rt.checkpoint import collectives as coll
from elastic_rt.checkpoint.manifest import FileEntry, Manifest
from elastic_rt.checkpoint.storage import STEP_DIR_RE, CheckpointStore, step_dirname
from elastic_rt.errors import CheckpointError
from elastic_rt.worker_env import ENV_HOST_CACHE_DIR, ENV_HOST_CACHE_RESERVE
from elastic_rt.checkpoint import checksum

log = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 16 << 20
# What a node leaves free in its shared memory for everything else that needs it there (NCCL's intra-node
# buffers, DataLoader workers' batches, torch's shared tensors): a quarter of it, at least 256 MiB, unless
# ELASTIC_RT_HOST_CACHE_RESERVE_BYTES says how much. A step is kept in host memory only when the node's whole
# share of it fits above the reserve.
RESERVE_FRACTION = 0.25
RESERVE_MIN_BYTES = 256 << 20
_DECISION = ".decision-"  # + step: the node's one decision for a step, "keep" or "skip <why>"


def reserve_bytes(directory: str, environ: Mapping[str, str] = os.environ) -> int:
    """The shared memory a node leaves free (RESERVE_FRACTION of the file system, at least RESERVE_MIN_BYTES, or
    $ELASTIC_RT_HOST_CACHE_RESERVE_BYTES)."""
    text = environ.get(ENV_HOST_CACHE_RESERVE, "").strip()
    if text.isdigit():
        return int(text)
    return max(RESERVE_MIN_BYTES, int(shutil.disk_usage(directory).total * RESERVE_FRACTION))


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def node_ranks(environ: Mapping[str, str] = os.environ) -> frozenset[int] | None:
    """The global ranks of this node's workers (torch numbers a node's workers contiguously), from RANK,
    LOCAL_RANK and LOCAL_WORLD_SIZE; None when they are not set."""
    try:
        rank, local, count = (int(environ[k]) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    except (KeyError, ValueError):
        return None
    return frozenset(range(rank - local, rank - local + count))
_TMP_RE = re.compile(r"(\.tmp\d+|\.ok)$")
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in at once


def _identity(st: os.stat_result) -> str:
    return f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_ctime_ns}"


def _write_stamp(path: str) -> None:
    """Record the copy's inode change time right after its crc32 was checked: any later write to it
    (or truncation, or replacement) changes the inode's ctime, which no process can set back."""
    with open(path + ".ok", "w") as f:
        f.write(_identity(os.stat(path)))


def _stamp_holds(path: str, st: os.stat_result) -> bool:
    """True when the copy is unchanged since its crc32 was checked; else its crc32 is computed again."""
    try:
        with open(path + ".ok") as f:
            return f.read() == _identity(st)
    except OSError:
        return False


def cached_name(entry: FileEntry) -> str:
    return f"{entry.path}@{entry.crc32:08x}-{entry.size}"


class HostCache:
    """One worker's view of its node's cache directory."""

    def __init__(self, directory: str, *, rank: int, node_ranks: frozenset[int] | None = None,
                 reserve_bytes: int = RESERVE_MIN_BYTES) -> None:
        self.directory, self.rank = directory, rank
        self.node_ranks = node_ranks if node_ranks is not None else frozenset({rank})
        self.reserve_bytes = reserve_bytes
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._full_logged = False

    @classmethod
    def from_env(cls, *, rank: int, environ: Mapping[str, str] = os.environ) -> "HostCache | None":
        directory = environ.get(ENV_HOST_CACHE_DIR, "")
        if not directory or not os.path.isdir(directory):
            return None
        return cls(directory, rank=rank, node_ranks=node_ranks(environ), reserve_bytes=reserve_bytes(directory, environ))

    def path(self, step: int, entry: FileEntry) -> str:
        return os.path.join(self.directory, step_dirname(step), cached_name(entry))

    # ---- after a commit: copy this rank's files ---------------------------------------------------
    def keep(self, store: CheckpointStore, step: int) -> None:
        """Copy the files this rank wrote for committed `step` into the cache, in the background.
        Local storage only: the copy reads the files back (from the page cache, just written); from
        an object store that would download them again after every save."""
        if not store.storage.local:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-rt-host-cache")
        self._pending = self._executor.submit(self._keep, store, step)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _keep(self, store: CheckpointStore, step: int) -> None:
        try:
            entry = store.entry(step)
            manifest = entry.manifest
            if manifest is None:
                raise CheckpointError(f"step {step} is not committed ({entry.problem})")
            data_dir = entry.data_dir(manifest)
            mine = [f for f in manifest.files if f.rank == self.rank]
            verdict = self._decide(step, sum(f.size for f in manifest.files if f.rank in self.node_ranks))
            if verdict != "keep":
                if not self._full_logged:
                    log.warning("rank %d: step %d not kept in host memory: %s", self.rank, step, verdict)
                    self._full_logged = True
                return
            os.makedirs(os.path.join(self.directory, step_dirname(step)), exist_ok=True)
            for file in mine:
                self._copy(store, step, data_dir, file)
            self._drop_other_steps(step)
        except (OSError, CheckpointError) as exc:  # the cache is an optimisation: storage has it all
            log.warning("rank %d: checkpoint step %d not kept in host memory (%s)", self.rank, step, exc)

    def _decide(self, step: int, node_bytes: int) -> str:
        """The node's one decision for `step`, made by the first of its ranks to ask: "keep" when the node's
        whole share (`node_bytes`) fits in the free space above the reserve, else "skip <why>". Every rank of
        the node reads the same one (an atomic link: the first one wins)."""
        path = os.path.join(self.directory, f"{_DECISION}{step}")
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            pass
        free = shutil.disk_usage(self.directory).free
        if node_bytes + self.reserve_bytes <= free:
            verdict = "keep"
        else:
            verdict = (f"the node's {mib(node_bytes)} of it and the {mib(self.reserve_bytes)} reserve do not fit "
                       f"in the {mib(free)} free in {self.directory}")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(verdict)
        try:
            os.link(tmp, path)
        except FileExistsError:  # another rank of the node decided first: its decision holds
            with open(path) as f:
                verdict = f.read()
        finally:
            os.unlink(tmp)
        return verdict

    def _copy(self, store: CheckpointStore, step: int, data_dir: str, entry: FileEntry) -> None:
        final = self.path(step, entry)
        if os.path.exists(final):
            return
        tmp = f"{final}.tmp{os.getpid()}"
        crc = 0
        try:
            with store.open_read(posixpath.join(data_dir, entry.path)) as src, open(tmp, "wb") as dst:
                while chunk := src.read(COPY_CHUNK_BYTES):
                    crc = checksum.crc32(chunk, crc)
                    dst.write(chunk)
            if crc != entry.crc32:
                raise CheckpointError(f"{entry.path} on storage does not match its manifest")
            os.replace(tmp, final)
            _write_stamp(final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _drop_other_steps(self, keep: int) -> None:
        for name in os.listdir(self.directory):
            m = STEP_DIR_RE.match(name)
            if m and int(m.group(1)) != keep:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            elif name.startswith(_DECISION) and name[len(_DECISION):].isdigit() and int(name[len(_DECISION):]) < keep:
                try:
                    os.unlink(os.path.join(self.directory, name))
                except OSError:
                    pass

    # ---- loading ------------------------------------------------------------------------------------
    def source(self, store: CheckpointStore, groups: coll.CheckpointGroups, *, verify: bool) -> "CachedSource":
        return CachedSource(store, self, groups, verify=verify)

    def lookup(self, step: int, entry: FileEntry) -> tuple[str | None, str]:
        """(path of the memory copy, "") or (None, "" if there is none | why it is stale)."""
        path = self.path(step, entry)
        if os.path.exists(path):
            return path, ""
        step_dir = os.path.join(self.directory, step_dirname(step))
        try:
            others = [n for n in os.listdir(step_dir) if n.startswith(entry.path + "@") and not _TMP_RE.search(n)]
        except OSError:
            return None, ""
        return None, (f"{entry.path}: host memory holds another save of step {step}" if others else "")


class _ViewStream(io.RawIOBase):
    """A seekable read-only stream over a buffer, without copying it."""

    def __init__(self, buffer: Any, closer=None, *, checksum_verified: bool = False) -> None:
        self.checksum_verified = checksum_verified  # its bytes matched the manifest's crc32
        self._view = memoryview(buffer).cast("B")
        self._pos = 0
        self._closer = closer

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def buffer_view(self) -> memoryview:
        """The whole buffer, for reads that copy straight out of it (checkpoint/tensor_read.py)."""
        return self._view

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        data = bytes(self._view[self._pos:end])
        self._pos = max(self._pos, end)
        return data

    def readinto(self, b) -> int:
        n = min(len(b), len(self._view) - self._pos)
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if not self.closed:
            self._view.release()
            if self._closer is not None:
                self._closer()
        super().close()


class CachedSource:
    """The loader's ReadSource: a step's files from host memory where a good copy is there, else from the
    CheckpointStore (each method says which of its calls it passes on)."""

    def __init__(self, store: CheckpointStore, cache: HostCache, groups: coll.CheckpointGroups, *,
                 verify: bool) -> None:
        self._store, self._cache, self._groups, self._verify = store, cache, groups, verify
        self.url = store.url
        self._commits: dict[str, tuple[int, dict[str, FileEntry]]] = {}  # data folder -> (step, entries)
        self._unverified: dict[str, set[str]] = {}  # data folder -> storage files nobody verified
        self._warned: set[str] = set()
        self.from_memory: list[str] = []
        self.from_storage: list[str] = []

    def prepare(self, step: int, data_dir: str, manifest: Manifest) -> None:
        self._commits[data_dir] = (step, {f.path: f for f in manifest.files})

    def check_sizes(self, data_dir: str, files: Iterable[FileEntry]) -> list[str]:
        return self._store.check_sizes(data_dir, files)

    def verify_files(self, data_dir: str, files: Iterable[FileEntry]) -> list[str]:
        """Collective (every rank calls it once per candidate, as the loader does): storage files are
        verified as before; files with a memory copy on this node are checked by whoever reads them."""
        step = self._commits[data_dir][0]
        files = list(files)
        deferred = [f.path for f in files if self._cache.lookup(step, f)[0] is not None]
        problems = self._store.verify_files(data_dir, [f for f in files if f.path not in deferred])
        everyone = coll.all_gather(deferred, self._groups.ctl)
        self._unverified[data_dir] = {p for per_rank in everyone for p in per_rank}
        return problems

    def read_file(self, data_dir: str, name: str) -> bytes:
        with self.open_read(posixpath.join(data_dir, name)) as f:
            return f.read()

    def open_read(self, path: str) -> Any:
        """A verified stream for `path` (memory copy, or storage checked as read), or storage's own stream."""
        data_dir, name = posixpath.split(path)
        commit = self._commits.get(data_dir)
        entry = commit[1].get(name) if commit is not None else None
        if commit is None or entry is None:
            return self._store.open_read(path)
        copy, stale = self._cache.lookup(commit[0], entry)
        if copy is not None:
            stream = self._open_copy(copy, entry)
            if stream is not None:
                self.from_memory.append(name)
                return stream
            stale = f"{name}: the host memory copy does not match the manifest's crc32"
        if stale:
            self._warn(stale)
        self.from_storage.append(name)
        if not self._verify or (name not in self._unverified.get(data_dir, ()) and not stale):
            return self._store.open_read(path)
        data = self._store.read_file(data_dir, name)
        if len(data) != entry.size or checksum.crc32(data) != entry.crc32:
            raise CheckpointError(f"{path} does not match its manifest (size or crc32); the checkpoint "
                                  "on storage is damaged: move the step directory aside to load the previous one")
        return _ViewStream(data, checksum_verified=entry.sha256 is None)

    def _open_copy(self, path: str, entry: FileEntry) -> io.RawIOBase | None:
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_size != entry.size:
                    return None
                mapped = mmap.mmap(f.fileno(), 0, flags=_MAP_FLAGS, prot=mmap.PROT_READ) if stat.st_size else None
        except OSError:
            return None
        if mapped is None:
            return _ViewStream(b"", checksum_verified=True) if entry.crc32 == 0 else None
        if self._verify and not _stamp_holds(path, stat) and checksum.crc32(mapped) != entry.crc32:
            mapped.close()
            return None
        return _ViewStream(mapped, closer=mapped.close, checksum_verified=self._verify and entry.sha256 is None)

    def report(self, step: int | None) -> int | None:
        """Log where the loaded step's files came from; returns `step`."""
        if step is not None and self.from_memory:
            log.info("rank %d: checkpoint step %d loaded: %d file(s) from host memory, %d from storage",
                     self._cache.rank, step, len(self.from_memory), len(self.from_storage))
        return step

    def _warn(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("rank %d: %s; reading it from storage", self._cache.rank, what)
