"""Checkpoint storage behind one small Protocol: a POSIX file system, or an object store through fsspec.

Every call either succeeds, raises FileNotFoundError (the path does not exist), FileExistsError
(a create-only write found the name taken), or raises StorageError: any other failure, never
read as "not there". `create()` is the commit primitive: it writes a whole object under a name
only if no object has that name, atomically:
- POSIX: the bytes go to a temporary file (fsynced), which is hard-linked to the final name
  (link(2) fails with EEXIST, whoever wins), then the directory is fsynced. Where the file
  system has no hard links, O_CREAT|O_EXCL on the final name (a crash mid-write then leaves a
  torn manifest, which reads as damaged, never as committed).
- S3 (s3fs): one PUT with `If-None-Match: *` (412 -> FileExistsError).
- memory:// (one process): under a lock.
- any other fsspec store: check, then PUT; a concurrent writer of the same name can overwrite
  it. A warning says so once per store.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import stat
import threading
import uuid
from typing import Any, BinaryIO, Mapping, Protocol

from fsspec.core import url_to_fs

from elastic_rt.errors import CheckpointError

log = logging.getLogger(__name__)

DEFAULT_FILE_MODE = 0o600
DEFAULT_DIR_MODE = 0o700


class StorageError(CheckpointError):
    """Storage answered with an error other than "not found", or did not answer."""


class Storage(Protocol):
    """What checkpoints need from a place to keep files (paths are absolute within `fs`)."""

    url: str
    root: str
    fs: Any
    local: bool  # POSIX: fsync and file modes apply

    def listdir(self, path: str) -> dict[str, int | None]: ...  # name -> size (None: a folder)
    def read(self, path: str) -> bytes: ...
    def size(self, path: str) -> int: ...
    def open_read(self, path: str) -> BinaryIO: ...
    def open_write(self, path: str) -> BinaryIO: ...
    def write(self, path: str, data: bytes, *, sync: bool) -> None: ...
    def create(self, path: str, data: bytes) -> None: ...
    def makedir(self, path: str, *, sync: bool) -> None: ...
    def rename(self, src: str, dst: str, *, sync: bool) -> None: ...
    def remove(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...
    def rmdir(self, path: str) -> None: ...  # only an empty folder (nothing where there are no folders)
    def sync_file(self, stream: BinaryIO) -> None: ...
    def sync_dir(self, path: str) -> None: ...


def _translate(url: str, what: str, path: str, exc: BaseException) -> BaseException:
    if isinstance(exc, (FileNotFoundError, FileExistsError)):
        return exc
    return StorageError(f"{what} {path} on {url} failed ({type(exc).__name__}: {exc}); "
                        "check that the storage is reachable and writable")


class PosixStorage:
    """A local or network (NFS, Lustre) file system, through os calls: modes, fsync, hard links."""

    local = True

    def __init__(self, url: str, fs: Any, root: str, *, file_mode: int = DEFAULT_FILE_MODE,
                 dir_mode: int = DEFAULT_DIR_MODE) -> None:
        self.url, self.fs, self.root = url, fs, root
        self.file_mode, self.dir_mode = file_mode, dir_mode

    def _do(self, what: str, path: str, fn, *args):
        try:
            return fn(*args)
        except OSError as exc:
            raise _translate(self.url, what, path, exc) from exc

    def listdir(self, path: str) -> dict[str, int | None]:
        def scan() -> dict[str, int | None]:
            with os.scandir(path) as it:
                return {e.name: (None if e.is_dir() else e.stat().st_size) for e in it}
        return self._do("listing", path, scan)

    def read(self, path: str) -> bytes:
        def read() -> bytes:
            with open(path, "rb") as f:
                return f.read()
        return self._do("reading", path, read)

    def size(self, path: str) -> int:
        return self._do("reading the size of", path, lambda: os.stat(path).st_size)

    def open_read(self, path: str) -> BinaryIO:
        return self._do("opening", path, open, path, "rb")

    def open_write(self, path: str) -> BinaryIO:
        def opener() -> BinaryIO:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, self.file_mode)
            os.fchmod(fd, self.file_mode)  # exactly the mode asked for, whatever the umask
            return os.fdopen(fd, "wb")
        return self._do("creating", path, opener)

    def write(self, path: str, data: bytes, *, sync: bool) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self._write_file(tmp, data, sync=sync)
            self._do("renaming", tmp, os.replace, tmp, path)
        finally:
            _unlink_quietly(tmp)
        if sync:
            self.sync_dir(posixpath.dirname(path))

    def _write_file(self, path: str, data: bytes, *, sync: bool) -> None:
        with self.open_write(path) as f:
            self._do("writing", path, f.write, data)
            if sync:
                self.sync_file(f)

    def create(self, path: str, data: bytes) -> None:
        tmp = f"{posixpath.dirname(path)}/.{posixpath.basename(path)}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self._write_file(tmp, data, sync=True)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise _translate(self.url, "committing", path, exc) from exc
                self._create_exclusive(path, data)
        finally:
            _unlink_quietly(tmp)
        self.sync_dir(posixpath.dirname(path))

    def _create_exclusive(self, path: str, data: bytes) -> None:
        """No hard links here: O_EXCL decides who creates the name."""
        def create() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.file_mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                self.sync_file(f)
        self._do("committing", path, create)

    def makedir(self, path: str, *, sync: bool) -> None:
        parent = posixpath.dirname(path.rstrip("/"))
        if parent and parent != path and not os.path.isdir(parent):
            self.makedir(parent, sync=sync)
        try:
            os.mkdir(path, self.dir_mode)
        except FileExistsError:
            st = self._do("reading", path, os.stat, path)  # a symlink loop, a dangling link: the real error
            if not stat.S_ISDIR(st.st_mode):
                raise StorageError(f"{path} on {self.url} exists and is not a directory") from None
            return
        except OSError as exc:
            raise _translate(self.url, "creating the directory", path, exc) from exc
        self._do("setting the mode of", path, os.chmod, path, self.dir_mode)
        if sync:
            self.sync_dir(parent or "/")

    def rename(self, src: str, dst: str, *, sync: bool) -> None:
        self._do("renaming", src, os.replace, src, dst)
        if sync:
            self.sync_dir(posixpath.dirname(dst))

    def remove(self, path: str) -> None:
        self._do("deleting", path, os.unlink, path)

    def remove_tree(self, path: str) -> None:
        for name, size in self.listdir(path).items():
            child = posixpath.join(path, name)
            self.remove_tree(child) if size is None else self.remove(child)
        self._do("deleting", path, os.rmdir, path)

    def rmdir(self, path: str) -> None:
        self._do("deleting", path, os.rmdir, path)

    def sync_file(self, stream: BinaryIO) -> None:
        stream.flush()  # the last buffered bytes first: fsync only sees what reached the kernel
        os.fsync(stream.fileno())

    def sync_dir(self, path: str) -> None:
        def sync() -> None:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._do("syncing the directory", path, sync)


class ObjectStorage:
    """An object store (s3://, gs://, memory://, ...) through fsspec. A PUT is durable when it returns;
    there are no directories (makedir does nothing where the store has none)."""

    local = False
    _warned: set[str] = set()

    def __init__(self, url: str, fs: Any, root: str) -> None:
        self.url, self.fs, self.root = url, fs, root
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        self._s3 = bool(protocols & {"s3", "s3a"})
        self._memory = "memory" in protocols
        self._lock = threading.Lock()

    def _do(self, what: str, path: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # clients raise their own types (botocore, aiohttp): all are storage errors
            raise _translate(self.url, what, path, exc) from exc

    def listdir(self, path: str) -> dict[str, int | None]:
        self.fs.invalidate_cache(path)
        entries = self._do("listing", path, self.fs.ls, path, detail=True)
        if not entries and not self._memory and not self._do("listing", path, self.fs.exists, path):
            raise FileNotFoundError(path)
        out: dict[str, int | None] = {}
        for e in entries:
            name = posixpath.basename(e["name"].rstrip("/"))
            if name and e["name"].rstrip("/") != path.rstrip("/"):
                out[name] = None if e.get("type") == "directory" else int(e.get("size") or 0)
        return out

    def read(self, path: str) -> bytes:
        return self._do("reading", path, self.fs.cat_file, path)

    def size(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        return int(self._do("reading the size of", path, self.fs.size, path))

    def open_read(self, path: str) -> BinaryIO:
        return self._do("opening", path, self.fs.open, path, "rb")

    def open_write(self, path: str) -> BinaryIO:
        return self._do("creating", path, self.fs.open, path, "wb")

    def write(self, path: str, data: bytes, *, sync: bool) -> None:
        self._do("writing", path, self.fs.pipe_file, path, data)

    def create(self, path: str, data: bytes) -> None:
        if self._s3:
            self._do("committing", path, self.fs.pipe_file, path, data, IfNoneMatch="*")
            return
        with self._lock:
            if self._do("committing", path, self.fs.exists, path):
                raise FileExistsError(path)
            if not self._memory and self.url not in self._warned:
                self._warned.add(self.url)
                log.warning("checkpoint storage %s (%s) has no create-only write here: a commit checks, then "
                            "writes, and a concurrent writer of the same manifest could replace it", self.url,
                            type(self.fs).__name__)
            self._do("committing", path, self.fs.pipe_file, path, data)

    def makedir(self, path: str, *, sync: bool) -> None:
        if self._memory:
            self._do("creating the directory", path, self.fs.makedirs, path, exist_ok=True)

    def rename(self, src: str, dst: str, *, sync: bool) -> None:
        self._do("renaming", src, self.fs.mv, src, dst)

    def remove(self, path: str) -> None:
        self._do("deleting", path, self.fs.rm, path)

    def remove_tree(self, path: str) -> None:
        self._do("deleting", path, self.fs.rm, path, recursive=True)
        self.fs.invalidate_cache(path)

    def rmdir(self, path: str) -> None:
        if self._memory:
            self._do("deleting", path, self.fs.rmdir, path)

    def sync_file(self, stream: BinaryIO) -> None:
        stream.flush()

    def sync_dir(self, path: str) -> None:
        return None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.debug("could not remove the temporary file %s (%s)", path, exc)


def open_storage(url: str, storage_options: Mapping[str, Any] | None = None, *,
                 file_mode: int = DEFAULT_FILE_MODE, dir_mode: int = DEFAULT_DIR_MODE) -> Storage:
    """The Storage for a path or fsspec URL; CheckpointError for a URL fsspec cannot open."""
    try:
        fs, root = url_to_fs(url, **dict(storage_options or {}))
    except (ValueError, ImportError, TypeError) as exc:
        raise CheckpointError(
            f"cannot open checkpoint URL {url!r} ({exc}); use a path or an fsspec URL "
            "such as file:///checkpoints/run1, memory://run1 or s3://bucket/run1"
        ) from exc
    root = root.rstrip("/") or "/"
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & {"file", "local"}:
        return PosixStorage(url, fs, root, file_mode=file_mode, dir_mode=dir_mode)
    return ObjectStorage(url, fs, root)
