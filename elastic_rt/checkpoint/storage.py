"""The checkpoint root's layout on a Storage: step folders, their commits (generations) and save folders,
each step absent, committed or damaged; verification of files against a manifest.

    <root>/step_00000100/                 one step
        MANIFEST.json, MANIFEST.2.json    its commits, created only if absent; the highest generation
                                          is the step's checkpoint (a later save of a step replaces it)
        save-00000012-1a2b3c4d/           one save's files; the number is the writer's lease epoch
    <root>/writer-lease/                  the writer lease (checkpoint/writer_lease.py)

Format 1 checkpoints (files in the step folder itself, one MANIFEST.json) are read as before.
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from elastic_rt.checkpoint.backends import Storage, StorageError, open_storage
from elastic_rt.checkpoint.manifest import Damage, FileEntry, Manifest, ManifestError, manifest_name
from elastic_rt.errors import CheckpointError
from elastic_rt.checkpoint import checksum

log = logging.getLogger(__name__)

STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")
MANIFEST_RE = re.compile(r"^MANIFEST(?:\.(\d+))?\.json$")
SAVE_DIR_RE = re.compile(r"^save-(\d{8})-([0-9a-f]{8})$")
READ_CHUNK_BYTES = 8 << 20


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def save_dirname(epoch: int, nonce: str) -> str:
    return f"save-{epoch:08d}-{nonce}"


def save_dir_epoch(name: str) -> int | None:
    match = SAVE_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def rank_filename(rank: int) -> str:
    """The file holding one rank's per-rank state (RNG states)."""
    return f"rank_{rank:05d}.pt"


@dataclass(frozen=True, kw_only=True)
class Commit:
    """One manifest of a step: parsed (manifest) or damaged (damage + problem)."""

    generation: int
    name: str
    manifest: Manifest | None = None
    damage: Damage | None = None
    problem: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointEntry:
    """A step folder found on storage: absent (no manifest), committed (its newest manifest parses)
    or damaged (its newest manifest exists but cannot be read, parsed, trusted or understood)."""

    step: int
    path: str
    commits: tuple[Commit, ...] = ()  # oldest generation first
    save_dirs: Mapping[str, int | None] = field(default_factory=dict)  # save folder -> epoch
    loose_files: bool = False  # files in the step folder itself (format 1, or a crashed format-1 save)

    @property
    def newest(self) -> Commit | None:
        return self.commits[-1] if self.commits else None

    @property
    def manifest(self) -> Manifest | None:
        newest = self.newest
        return newest.manifest if newest is not None else None

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def damaged(self) -> bool:
        return self.newest is not None and self.newest.manifest is None

    @property
    def problem(self) -> str | None:
        if not self.commits:
            return "no manifest (save never committed)"
        return self.newest.problem  # type: ignore[union-attr]

    def data_dir(self, manifest: Manifest) -> str:
        return posixpath.join(self.path, manifest.data_dir) if manifest.data_dir else self.path


class CheckpointStore:
    """One checkpoint root and the operations on the step folders under it."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *,
                 storage: Storage | None = None, secret: bytes | None = None) -> None:
        self.url = url
        self.storage = storage if storage is not None else open_storage(url, storage_options)
        self.root = self.storage.root
        self.fs = self.storage.fs
        self.secret = secret

    @property
    def is_local(self) -> bool:
        return self.storage.local

    def step_dir(self, step: int) -> str:
        return posixpath.join(self.root, step_dirname(step))

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    # ---- reading ----------------------------------------------------------------------------
    def list(self) -> list[CheckpointEntry]:
        """Every step folder under the root, oldest first. A root that does not exist holds none;
        any other error listing it is a StorageError (never "no checkpoints")."""
        try:
            names = self.storage.listdir(self.root)
        except FileNotFoundError:
            return []
        entries = []
        for name in names:
            match = STEP_DIR_RE.match(name)
            if match is not None:
                entries.append(self.entry(int(match.group(1))))
        return sorted(entries, key=lambda e: e.step)

    def entry(self, step: int) -> CheckpointEntry:
        """One step folder and the state of each of its manifests (absent if there is no folder)."""
        path = self.step_dir(step)
        try:
            names = self.storage.listdir(path)
        except FileNotFoundError:
            return CheckpointEntry(step=step, path=path)
        commits, save_dirs, loose = [], {}, False
        for name, size in names.items():
            match = MANIFEST_RE.match(name)
            if match is not None:
                commits.append(self._read_commit(step, path, name, int(match.group(1) or 1)))
            elif size is None:
                save_dirs[name] = save_dir_epoch(name)
            elif not name.startswith("."):
                loose = True
        commits.sort(key=lambda c: c.generation)
        return CheckpointEntry(step=step, path=path, commits=tuple(commits), save_dirs=save_dirs, loose_files=loose)

    def _read_commit(self, step: int, step_path: str, name: str, generation: int) -> Commit:
        try:
            manifest = self.read_manifest(step_path, name)
        except ManifestError as exc:
            return Commit(generation=generation, name=name, damage=exc.damage, problem=str(exc))
        if manifest.step != step or manifest.generation != generation:
            return Commit(generation=generation, name=name, damage=Damage.CORRUPT,
                          problem=f"{name} says step {manifest.step} generation {manifest.generation}")
        return Commit(generation=generation, name=name, manifest=manifest)

    def read_manifest(self, step_path: str, name: str = manifest_name(1)) -> Manifest:
        path = posixpath.join(step_path, name)
        try:
            data = self.storage.read(path)
        except FileNotFoundError as exc:
            raise ManifestError("no manifest (save never committed)") from exc
        except StorageError as exc:
            raise ManifestError(f"{name} is unreadable: {exc}", Damage.UNREADABLE) from exc
        return Manifest.from_json(data, self.secret)

    def read_file(self, data_dir: str, name: str) -> bytes:
        return self.storage.read(posixpath.join(data_dir, name))

    def open_read(self, path: str) -> Any:
        return self.storage.open_read(path)

    def prepare(self, step: int, data_dir: str, manifest: Manifest) -> None:
        """A load is about to read this commit (ReadSource; nothing to do on storage itself)."""

    # ---- writing ----------------------------------------------------------------------------
    def commit(self, step_path: str, manifest: Manifest) -> None:
        """The commit point: the manifest is created only if no manifest of that generation exists
        (FileExistsError otherwise)."""
        self.storage.create(posixpath.join(step_path, manifest_name(manifest.generation)),
                            manifest.to_json(self.secret))

    def write_file(self, data_dir: str, name: str, data: bytes, *, sync: bool) -> FileEntry:
        """Write a small file in one piece; returns its entry (rank filled in by the caller)."""
        with self.storage.open_write(posixpath.join(data_dir, name)) as f:
            f.write(data)
            if sync:
                self.storage.sync_file(f)
        sha = hashlib.sha256(data).hexdigest() if self.secret is not None else None
        return FileEntry(path=name, size=len(data), crc32=checksum.crc32(data), rank=0, sha256=sha)

    def delete_step(self, entry: CheckpointEntry) -> None:
        """Uncommit first (manifests, oldest generation first, so the newest commit stays whole until
        the last), then the files: never a half-deleted step that looks committed."""
        for commit in entry.commits:
            self.storage.remove(posixpath.join(entry.path, commit.name))
        self.storage.remove_tree(entry.path)

    # ---- verification -----------------------------------------------------------------------
    def verify_files(self, data_dir: str, files: Iterable[FileEntry]) -> list[str]:
        """Check each file's size and checksums; one line per problem (empty: all good)."""
        problems = []
        for entry in files:
            path = posixpath.join(data_dir, entry.path)
            problem = self._size_problem(path, entry)
            if problem is None:
                try:
                    problem = file_problem(entry, self._digest(path, entry.sha256 is not None))
                except (OSError, CheckpointError) as exc:
                    problem = f"{entry.path}: unreadable ({exc})"
            if problem is not None:
                problems.append(problem)
        return problems

    def check_sizes(self, data_dir: str, files: Iterable[FileEntry]) -> list[str]:
        """Check each file's size only, from one listing of the folder."""
        try:
            sizes = self.storage.listdir(data_dir)
        except FileNotFoundError:
            sizes = {}
        except StorageError as exc:
            return [f"{data_dir}: unreadable ({exc})"]
        problems = []
        for entry in files:
            size = sizes.get(entry.path, -1)
            if size == -1 or size is None:
                problems.append(f"{entry.path}: missing")
            elif size != entry.size:
                problems.append(f"{entry.path}: size {size} bytes, manifest says {entry.size}")
        return problems

    def _size_problem(self, path: str, entry: FileEntry) -> str | None:
        try:
            size = self.storage.size(path)
        except FileNotFoundError:
            return f"{entry.path}: missing"
        except StorageError as exc:
            return f"{entry.path}: unreadable ({exc})"
        if size != entry.size:
            return f"{entry.path}: size {size} bytes, manifest says {entry.size}"
        return None

    def _digest(self, path: str, sha: bool) -> tuple[int, str | None]:
        crc, hasher = 0, hashlib.sha256() if sha else None
        with self.storage.open_read(path) as f:
            while chunk := f.read(READ_CHUNK_BYTES):
                crc = checksum.crc32(chunk, crc)
                if hasher is not None:
                    hasher.update(chunk)
        return crc, (hasher.hexdigest() if hasher is not None else None)


def file_problem(entry: FileEntry, digest: tuple[int, str | None]) -> str | None:
    """The problem line when a file's (crc32, sha256) do not match its entry."""
    crc, sha = digest
    if crc != entry.crc32:
        return f"{entry.path}: crc32 {crc:08x}, manifest says {entry.crc32:08x}"
    if entry.sha256 is not None and sha != entry.sha256:
        return f"{entry.path}: sha256 does not match the signed manifest"
    return None
