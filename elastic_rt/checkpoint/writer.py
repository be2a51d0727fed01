"""DCP storage writer/reader over a checkpoint Storage that records each file's size and checksums."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Generator, Mapping

import torch
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from elastic_rt.checkpoint import tensor_read
from elastic_rt.checkpoint.checked_read import CheckedFile
from elastic_rt.checkpoint.backends import Storage
from elastic_rt.checkpoint.manifest import FileEntry
from elastic_rt.checkpoint.storage import file_problem
from elastic_rt.checkpoint.trust import load_metadata
from elastic_rt.checkpoint.writeback import StartWriteback, start_writeback
from elastic_rt.errors import CheckpointError
from elastic_rt.checkpoint import checksum

log = logging.getLogger(__name__)

# Buffers at least this large get their crc32 computed in a helper thread while the
# write proceeds (checksum.crc32 releases the GIL), so checksumming overlaps with I/O.
OVERLAP_CRC_MIN_BYTES = 1 << 20
# ... and are written in chunks of this size, each handed to the disk (start_writeback) as
# soon as it is in the page cache, so the disk works while the next chunk is copied.
WRITE_CHUNK_BYTES = 16 << 20
METADATA_NAME = ".metadata"


_zip_crc_lock = threading.Lock()
_zip_crc_users = 0
_zip_crc_saved = True


@contextmanager
def zip_crc32_disabled() -> Generator[None, None, None]:
    """torch.save's per-record zip crc32 is redundant with the manifest's whole-file crc32 and
    costs as much CPU again, so it is off while checkpoint shards are written. The setting is
    process-wide: a torch.save elsewhere in the process meanwhile also skips it, which
    torch.load accepts (only external unzip tools would complain)."""
    global _zip_crc_users, _zip_crc_saved
    with _zip_crc_lock:
        if _zip_crc_users == 0:
            _zip_crc_saved = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _zip_crc_users += 1
    try:
        yield
    finally:
        with _zip_crc_lock:
            _zip_crc_users -= 1
            if _zip_crc_users == 0:
                torch.serialization.set_crc32_options(_zip_crc_saved)


class _ChecksumStream(io.RawIOBase):
    """Write-through wrapper that counts bytes and computes a running crc32 (and sha256 when the job
    has a secret); with `writeback`, starts the disk on each large chunk as soon as it is written."""

    def __init__(self, raw: Any, pool: ThreadPoolExecutor, writeback: StartWriteback | None = None,
                 *, sha: bool = False) -> None:
        super().__init__()
        self.raw = raw
        self.pool = pool
        self.crc = 0
        self.size = 0
        self.hasher = hashlib.sha256() if sha else None
        self._writeback = writeback
        self._fd: int | None = None
        if writeback is not None:
            try:
                self._fd = raw.fileno()
            except (OSError, AttributeError, ValueError):  # not a local file: nothing to start
                self._writeback = None

    def writable(self) -> bool:
        return True

    def _digest(self, view: memoryview, crc: int) -> int:
        if self.hasher is not None:
            self.hasher.update(view)
        return checksum.crc32(view, crc)

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if view.nbytes < OVERLAP_CRC_MIN_BYTES:
            self._write_all(view)
            self.crc = self._digest(view, self.crc)
            return view.nbytes
        for start in range(0, view.nbytes, WRITE_CHUNK_BYTES):
            chunk = view[start:start + WRITE_CHUNK_BYTES]
            pending = self.pool.submit(self._digest, chunk, self.crc)
            try:
                offset = self.size
                self._write_all(chunk)
                if self._writeback is not None:
                    self.raw.flush()  # nothing of this chunk may sit in a user-space buffer
                    self._writeback(self._fd, offset, chunk.nbytes)
            finally:
                # Also on a failed write: the caller may free the memory behind `view` (torch.save
                # passes views of tensor storage) once this returns, so the crc must be done with it.
                self.crc = pending.result()
        return view.nbytes

    def _write_all(self, view: memoryview) -> None:
        written = self.raw.write(view)
        if written is not None and written != view.nbytes:
            raise OSError(f"short write: {written} of {view.nbytes} bytes")
        self.size += view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        self.raw.flush()  # whoever fsyncs this descriptor gets the buffered bytes too
        return self.raw.fileno()


class ChecksumFileSystem(FileSystemBase):
    """torch's FileSystemBase over a Storage; records what every write produced. With `sync`, every file
    is flushed and fsynced when it is closed and every rename's directory fsynced (local disks)."""

    def __init__(self, storage: Storage, *, sync: bool = False, early_writeback: bool = False,
                 sha: bool = False) -> None:
        self.storage = storage
        self.sync = sync and storage.local
        self._sha = sha
        self._writeback = start_writeback() if early_writeback and self.sync else None
        self.written: dict[str, tuple[int, int, str | None]] = {}  # path -> (size, crc32, sha256)
        self._lock = threading.Lock()
        self._crc_pool: ThreadPoolExecutor | None = None

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._crc_pool is None:
                self._crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-rt-crc")
            return self._crc_pool

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = os.fspath(path)
        if "r" in mode:
            with self.storage.open_read(path) as stream:
                yield stream
            return
        with self.storage.open_write(path) as raw:
            stream = _ChecksumStream(raw, self._pool(), self._writeback, sha=self._sha)
            try:
                yield stream  # type: ignore[misc]
                if self.sync:
                    self.storage.sync_file(raw)
            except BaseException:
                try:
                    self.storage.remove(path)
                except (OSError, CheckpointError) as exc:  # the save fails anyway; nothing is committed
                    log.debug("checkpoint writer: could not remove the partial file %s (%s)", path, exc)
                raise
        with self._lock:
            self.written[path] = (stream.size, stream.crc, stream.hasher.hexdigest() if stream.hasher else None)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.storage.rename(os.fspath(path), os.fspath(new_path), sync=self.sync)
        with self._lock:
            if os.fspath(path) in self.written:
                self.written[os.fspath(new_path)] = self.written.pop(os.fspath(path))

    def init_path(self, path: str | os.PathLike) -> str:
        return os.fspath(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        self.storage.makedir(os.fspath(path), sync=self.sync)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        try:
            self.storage.size(os.fspath(path))
        except FileNotFoundError:
            return False
        return True

    def rm_file(self, path: str | os.PathLike) -> None:
        self.storage.remove(os.fspath(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        return [posixpath.join(os.fspath(path), n) for n in self.storage.listdir(os.fspath(path))]

    def close(self) -> None:
        with self._lock:
            pool, self._crc_pool = self._crc_pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class ChecksumWriter(FileSystemWriter):
    """DCP FileSystemWriter on a Storage that reports (name, size, crc32, sha256) of each file it wrote."""

    def __init__(
        self,
        storage: Storage,
        path: str,
        *,
        rank: int,
        step: int,
        sync_files: bool,
        thread_count: int = 1,
        sha: bool = False,
    ) -> None:
        # DCP's own fsync (of a descriptor, before its buffer is flushed) is off: ChecksumFileSystem
        # flushes and fsyncs every file it closes, .metadata included, and the directory of a rename.
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=thread_count, overwrite=True)
        # Only when the files are fsynced anyway: the early start changes when the disk works, not
        # whether (without fsync, pages may stay in memory, and early writeback would cost time).
        self.fs = ChecksumFileSystem(storage, sync=sync_files, early_writeback=sync_files, sha=sha)
        self.path = path
        self.rank = rank
        self.step = step

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with zip_crc32_disabled():
            return super().write_data(plan, planner)

    def close(self) -> None:
        self.fs.close()

    def file_entries(self) -> list[FileEntry]:
        """Files this rank wrote (the coordinator also wrote .metadata)."""
        return [
            FileEntry(path=posixpath.basename(path), size=size, crc32=crc, rank=self.rank, sha256=sha)
            for path, (size, crc, sha) in sorted(self.fs.written.items())
        ]


class _ReadFileSystem(ChecksumFileSystem):
    """The read side of FileSystemBase over a function that opens a checkpoint file (storage, or host memory)."""

    def __init__(self, open_read: Callable[[str], Any]) -> None:
        self._open_read = open_read

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "r" not in mode:
            raise ValueError("a checkpoint reader does not write")
        with self._open_read(os.fspath(path)) as stream:
            yield stream

    def close(self) -> None:
        return None


class CheckpointReader(FileSystemReader):
    """DCP FileSystemReader over `open_read(path)`; tensors it can are read straight into the
    state's tensors (checkpoint/tensor_read.py), the rest as DCP reads them. With `expected` (the
    manifest's entries), each data file's checksums are checked by this read (checkpoint/checked_read.py):
    a file that does not match is reported in `problems` (nothing of it reaches DCP's unpickling
    path), and the caller must not use the state. `.metadata` is read once, checked against
    `metadata_entry` when given, and unpickled with an allow-list (checkpoint/trust.py)."""

    def __init__(self, open_read: Callable[[str], Any], path: str, *,
                 expected: Mapping[str, FileEntry] | None = None, metadata_entry: FileEntry | None = None) -> None:
        super().__init__(path)
        self.fs = _ReadFileSystem(open_read)
        self.path = path
        self.zero_copy_items = 0
        self.expected = expected
        self.metadata_entry = metadata_entry
        self.problems: list[str] = []
        self.files_read: set[str] = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = posixpath.join(self.path, METADATA_NAME)
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        entry = self.metadata_entry
        if entry is not None:
            sha = hashlib.sha256(data).hexdigest() if entry.sha256 is not None else None
            problem = "size" if len(data) != entry.size else file_problem(entry, (checksum.crc32(data), sha))
            if problem is not None:
                raise CheckpointError(f"{path} does not match its manifest ({problem}); not unpickled")
        metadata = load_metadata(data, path)
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} is not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        rest: list[ReadItem] = []
        pool = None if self.expected is None else ThreadPoolExecutor(1, thread_name_prefix="elastic-rt-crc")
        try:
            for relative_path, items in per_file.items():
                self.files_read.add(relative_path)
                problem = self._read_file(relative_path, items, planner, rest, pool)
                if problem is not None:
                    self.problems.append(problem)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
        if rest and not self.problems:  # DCP's path unpickles: only from files that verified
            return super().read_data(replace(plan, items=rest), planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(
        self, name: str, items: list[ReadItem], planner: LoadPlanner, rest: list[ReadItem],
        pool: ThreadPoolExecutor | None,
    ) -> str | None:
        checked: CheckedFile | None = None
        try:
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                if pool is not None and not getattr(stream, "checksum_verified", False):
                    entry = self.expected.get(name)  # type: ignore[union-attr]
                    checked = CheckedFile(stream, pool, sha=entry is not None and entry.sha256 is not None)
                try:
                    for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                        if not self._read_direct(stream, item, planner, checked):
                            rest.append(item)
                    return None if checked is None else checked.finish(self.expected.get(name), name)  # type: ignore[union-attr]
                finally:
                    if checked is not None:
                        checked.close()
        except FileNotFoundError:
            if pool is None:
                raise
            return f"{name}: missing"
        except (OSError, EOFError) as exc:
            if pool is None:
                raise
            return f"{name}: unreadable ({exc})"

    def _read_direct(self, stream: Any, item: ReadItem, planner: LoadPlanner, checked: CheckedFile | None) -> bool:
        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.TENSOR or getattr(info, "transform_descriptors", None):
            return False
        record = tensor_read.locate(stream, info.offset, info.length)
        if record is None or any(item.storage_offsets) or tuple(item.lengths) != record.size:
            return False
        target = planner.resolve_tensor(item).detach()
        if not tensor_read.fits(record, target):
            return False
        if checked is None:
            tensor_read.read_into(stream, record, target)
        elif record.offset < checked.pos:
            return False
        elif record.nbytes:
            checked.read_into(record.offset, tensor_read.byte_view(target))
        planner.commit_tensor(item, target)
        self.zero_copy_items += 1
        return True
