"""The manifest: a checkpoint's commit record (step, world size, files with sizes and crc32s)."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

from elastic_rt.errors import CheckpointError

FORMAT_NAME = "elastic-rt-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"


class ManifestError(CheckpointError):
    """A manifest is missing, unreadable, tampered with or from an unknown format version."""


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint, relative to its step directory, and who wrote it."""

    path: str
    size: int
    crc32: int
    rank: int

    def __post_init__(self) -> None:
        if not is_safe_name(self.path):
            raise ManifestError(f"unsafe file name {self.path!r} in manifest")
        for name in ("size", "crc32", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ManifestError(f"file {self.path!r}: {name} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Written last, by rank 0, after every rank's files are on storage: its presence commits."""

    step: int
    world_size: int
    files: tuple[FileEntry, ...]
    created_unix_s: float
    torch_version: str
    per_rank_keys: tuple[str, ...] = ()
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        body = self._body()
        body["manifest_crc32"] = _crc_of_body(body)
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "world_size": self.world_size,
            "created_unix_s": self.created_unix_s,
            "torch_version": self.torch_version,
            "per_rank_keys": list(self.per_rank_keys),
            "files": [
                {"path": f.path, "size": f.size, "crc32": f"{f.crc32:08x}", "rank": f.rank}
                for f in sorted(self.files, key=lambda f: f.path)
            ],
        }

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        """Parse and validate; raises ManifestError saying what is wrong."""
        try:
            body = json.loads(data.decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise ManifestError(f"manifest is not valid JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise ManifestError("manifest is not a JSON object")
        if body.get("format") != FORMAT_NAME:
            raise ManifestError(f"not an elastic-rt manifest (format={body.get('format')!r})")
        version = body.get("format_version")
        if not isinstance(version, int) or version < 1:
            raise ManifestError(f"bad format_version {version!r}")
        if version > FORMAT_VERSION:
            raise ManifestError(
                f"format_version {version} is newer than this elastic-rt understands "
                f"({FORMAT_VERSION}); upgrade elastic-rt to load it"
            )
        stored_crc = body.pop("manifest_crc32", None)
        if stored_crc != _crc_of_body(body):
            raise ManifestError("manifest checksum mismatch (the manifest itself is corrupt)")
        try:
            files = tuple(
                FileEntry(path=f["path"], size=f["size"], crc32=int(f["crc32"], 16), rank=f["rank"])
                for f in body["files"]
            )
            manifest = cls(
                step=body["step"],
                world_size=body["world_size"],
                files=files,
                created_unix_s=float(body["created_unix_s"]),
                torch_version=str(body["torch_version"]),
                per_rank_keys=tuple(body.get("per_rank_keys", ())),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"manifest field missing or of the wrong type ({exc!r})") from exc
        if not isinstance(manifest.step, int) or manifest.step < 0:
            raise ManifestError(f"bad step {manifest.step!r}")
        if not isinstance(manifest.world_size, int) or manifest.world_size < 1:
            raise ManifestError(f"bad world_size {manifest.world_size!r}")
        return manifest


def is_safe_name(name: object) -> bool:
    """A plain file name inside the step directory: no separators, no '..'."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
    )


def _crc_of_body(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{zlib.crc32(canonical):08x}"
