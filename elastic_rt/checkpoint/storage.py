"""Checkpoints on fsspec storage: step directories, atomic manifests, verification, retention."""

from __future__ import annotations

import logging
import os
import posixpath
import re
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from fsspec.core import url_to_fs

from elastic_rt.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest, ManifestError
from elastic_rt.errors import CheckpointError

log = logging.getLogger(__name__)

STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")
READ_CHUNK_BYTES = 8 << 20


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def rank_filename(rank: int) -> str:
    """The file holding one rank's per-rank state (RNG states)."""
    return f"rank_{rank:05d}.pt"


@dataclass(frozen=True, kw_only=True)
class CheckpointEntry:
    """A step directory found on storage; committed when its manifest parses."""

    step: int
    path: str
    manifest: Manifest | None
    problem: str | None = None

    @property
    def committed(self) -> bool:
        return self.manifest is not None


class CheckpointStore:
    """One checkpoint root (an fsspec URL) and the operations on the step directories under it."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        try:
            self.fs, self.root = url_to_fs(url, **dict(storage_options or {}))
        except (ValueError, ImportError, TypeError) as exc:
            raise CheckpointError(
                f"cannot open checkpoint URL {url!r} ({exc}); use a path or an fsspec URL "
                "such as file:///checkpoints/run1, memory://run1 or s3://bucket/run1"
            ) from exc
        self.root = self.root.rstrip("/") or "/"
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        self.is_local = "file" in protocols or "local" in protocols

    def step_dir(self, step: int) -> str:
        return posixpath.join(self.root, step_dirname(step))

    def list(self) -> list[CheckpointEntry]:
        """Every step directory under the root, oldest first; no root means no checkpoints."""
        try:
            names = self.fs.ls(self.root, detail=False) if self.fs.isdir(self.root) else []
        except FileNotFoundError:
            names = []
        except OSError as exc:
            raise CheckpointError(f"cannot list checkpoints under {self.url} ({exc})") from exc
        entries = []
        for name in names:
            match = STEP_DIR_RE.match(posixpath.basename(name.rstrip("/")))
            if match is None:
                continue
            path = posixpath.join(self.root, match.group(0))
            manifest, problem = None, None
            try:
                manifest = self.read_manifest(path)
            except CheckpointError as exc:
                problem = str(exc)
            entries.append(
                CheckpointEntry(step=int(match.group(1)), path=path, manifest=manifest, problem=problem)
            )
        return sorted(entries, key=lambda e: e.step)

    def read_manifest(self, step_path: str) -> Manifest:
        path = posixpath.join(step_path, MANIFEST_NAME)
        try:
            with self.fs.open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError as exc:
            raise ManifestError("no manifest (save never committed)") from exc
        except OSError as exc:
            raise ManifestError(f"manifest unreadable ({exc})") from exc
        manifest = Manifest.from_json(data)
        if step_dirname(manifest.step) != posixpath.basename(step_path):
            raise ManifestError(f"manifest says step {manifest.step}, directory is {step_path}")
        return manifest

    def write_manifest(self, step_path: str, manifest: Manifest) -> None:
        """The commit point: atomic rename on local disks, a single PUT on object stores."""
        data = manifest.to_json()
        final = posixpath.join(step_path, MANIFEST_NAME)
        if not self.is_local:
            self.fs.pipe_file(final, data)
            return
        tmp = final + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        self.fsync_dir(step_path)

    def write_file(self, step_path: str, name: str, data: bytes, *, sync: bool) -> tuple[int, int]:
        """Write a small file in one piece; returns (size, crc32)."""
        path = posixpath.join(step_path, name)
        with self.fs.open(path, "wb") as f:
            f.write(data)
            if sync and self.is_local:
                f.flush()
                os.fsync(f.fileno())
        return len(data), zlib.crc32(data)

    def read_file(self, step_path: str, name: str) -> bytes:
        with self.fs.open(posixpath.join(step_path, name), "rb") as f:
            return f.read()

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def make_step_dir(self, step_path: str, *, sync: bool) -> None:
        """Create a step directory under the root; with `sync` (local disks), fsync the
        directories that gained an entry (the root, and the root's parent for a new root),
        so the step directory's name survives a power loss along with its files."""
        new_root = self.is_local and not os.path.isdir(self.root)
        self.fs.makedirs(step_path, exist_ok=True)
        if sync and self.is_local:
            self.fsync_dir(posixpath.dirname(step_path.rstrip("/")))
            if new_root:
                self.fsync_dir(posixpath.dirname(self.root) or "/")

    def fsync_dir(self, path: str) -> None:
        """Make new directory entries durable (local file systems only)."""
        if not self.is_local:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def verify_files(self, step_path: str, files: Iterable[FileEntry]) -> list[str]:
        """Check each file's size and crc32; returns one line per problem (empty: all good)."""
        problems = []
        for entry in files:
            path = posixpath.join(step_path, entry.path)
            problem = self._size_problem(path, entry)
            if problem is None:
                try:
                    crc = self.file_crc32(path)
                except OSError as exc:
                    problem = f"{entry.path}: unreadable ({exc})"
                else:
                    if crc != entry.crc32:
                        problem = f"{entry.path}: crc32 {crc:08x}, manifest says {entry.crc32:08x}"
            if problem is not None:
                problems.append(problem)
        return problems

    def check_sizes(self, step_path: str, files: Iterable[FileEntry]) -> list[str]:
        """Check each file's size only (its crc32 is checked as the load reads it)."""
        found = (self._size_problem(posixpath.join(step_path, e.path), e) for e in files)
        return [p for p in found if p is not None]

    def _size_problem(self, path: str, entry: FileEntry) -> str | None:
        try:
            size = self.fs.size(path)
        except FileNotFoundError:
            return f"{entry.path}: missing"
        except OSError as exc:
            return f"{entry.path}: unreadable ({exc})"
        if size != entry.size:
            return f"{entry.path}: size {size} bytes, manifest says {entry.size}"
        return None

    def file_crc32(self, path: str) -> int:
        crc = 0
        with self.fs.open(path, "rb", block_size=READ_CHUNK_BYTES) as f:
            while chunk := f.read(READ_CHUNK_BYTES):
                crc = zlib.crc32(chunk, crc)
        return crc

    def delete(self, step_path: str) -> None:
        """Uncommit first (manifest), then remove the rest: never a half-deleted 'committed' one."""
        manifest = posixpath.join(step_path, MANIFEST_NAME)
        if self.fs.exists(manifest):
            self.fs.rm(manifest)
        if self.fs.exists(step_path):
            self.fs.rm(step_path, recursive=True)

    def apply_retention(self, keep_last: int, newest_step: int) -> list[int]:
        """After step newest_step committed: delete all but the keep_last newest committed
        checkpoints, and leftovers of saves that never committed. Returns deleted steps."""
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        entries = self.list()
        committed = [e for e in entries if e.committed]
        if not any(e.step == newest_step for e in committed):
            log.warning(
                "checkpoint retention skipped: step %d is not committed under %s", newest_step, self.url
            )
            return []
        keep = {e.step for e in committed[-keep_last:]} | {newest_step}
        deleted = []
        for entry in entries:
            if entry.step in keep:
                continue
            try:
                self.delete(entry.path)
                deleted.append(entry.step)
            except OSError as exc:
                log.warning("checkpoint retention: could not delete %s (%s)", entry.path, exc)
        return deleted
