"""The manifest: a checkpoint's commit record (step, writer token, files with sizes and checksums), signed
with the job secret when there is one."""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

from elastic_rt.errors import CheckpointError
from elastic_rt.checkpoint import checksum

FORMAT_NAME = "elastic-rt-checkpoint"
FORMAT_VERSION = 2  # 2: writer token, generation, data folder, optional sha256 and HMAC
MANIFEST_NAME = "MANIFEST.json"


class Damage(enum.Enum):
    """Why a manifest that exists is not a commit; decides what a load does."""

    UNREADABLE = "unreadable"  # storage error: stop, the fix is the storage's
    NEWER_FORMAT = "newer_format"  # stop: upgrade elastic-rt
    CORRUPT = "corrupt"  # proven damage (bad JSON, checksum): fall back with a warning
    UNTRUSTED = "untrusted"  # unsigned or signed with another secret: fall back with a warning

    @property
    def stops_load(self) -> bool:
        return self in (Damage.UNREADABLE, Damage.NEWER_FORMAT)


class ManifestError(CheckpointError):
    """A manifest is unreadable, tampered with, damaged or from an unknown format version."""

    def __init__(self, message: str, damage: Damage = Damage.CORRUPT) -> None:
        super().__init__(message)
        self.damage = damage


@dataclass(frozen=True, kw_only=True)
class WriterToken:
    """Who wrote a checkpoint: the job's run id, its launch, the rendezvous round, and the writer
    lease's epoch (one per writer, increasing: what retention compares)."""

    run_id: str = ""
    launch_id: str = ""
    round: int = 0
    epoch: int = 0

    def describe(self) -> str:
        return f"run {self.run_id or '-'} launch {self.launch_id or '-'} round {self.round} epoch {self.epoch}"


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint, relative to its data folder, and who wrote it."""

    path: str
    size: int
    crc32: int
    rank: int
    sha256: str | None = None  # with a job secret: what the signed manifest vouches for

    def __post_init__(self) -> None:
        if not is_safe_name(self.path):
            raise ManifestError(f"unsafe file name {self.path!r} in manifest")
        for name in ("size", "crc32", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ManifestError(f"file {self.path!r}: {name} must be an integer >= 0, got {value!r}")
        if self.sha256 is not None and (not isinstance(self.sha256, str) or len(self.sha256) != 64):
            raise ManifestError(f"file {self.path!r}: bad sha256 {self.sha256!r}")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Written last, by rank 0, after every rank's files are on storage: its creation commits."""

    step: int
    world_size: int
    files: tuple[FileEntry, ...]
    created_unix_s: float
    torch_version: str
    per_rank_keys: tuple[str, ...] = ()
    generation: int = 1
    data_dir: str = ""  # the save's folder inside the step folder ("" for format 1: the step folder)
    writer: WriterToken = WriterToken()
    signed: bool = False
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self, secret: bytes | None = None) -> bytes:
        body = self._body()
        body["manifest_crc32"] = _crc_of_body(body)
        if secret is not None:
            body["manifest_hmac"] = _hmac_of_body(body, secret)
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    def _body(self) -> dict[str, Any]:
        files = []
        for f in sorted(self.files, key=lambda f: f.path):
            entry = {"path": f.path, "size": f.size, "crc32": f"{f.crc32:08x}", "rank": f.rank}
            if f.sha256 is not None:
                entry["sha256"] = f.sha256
            files.append(entry)
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "generation": self.generation,
            "data_dir": self.data_dir,
            "writer": {"run_id": self.writer.run_id, "launch_id": self.writer.launch_id,
                       "round": self.writer.round, "epoch": self.writer.epoch},
            "world_size": self.world_size,
            "created_unix_s": self.created_unix_s,
            "torch_version": self.torch_version,
            "per_rank_keys": list(self.per_rank_keys),
            "files": files,
        }

    @classmethod
    def from_json(cls, data: bytes, secret: bytes | None = None) -> "Manifest":
        """Parse and validate; raises ManifestError saying what is wrong (and how bad: `damage`).
        With `secret`, a manifest must carry a valid HMAC of it."""
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
                f"written by a newer elastic-rt (format_version {version}, this one reads up to "
                f"{FORMAT_VERSION}); upgrade elastic-rt to load it", Damage.NEWER_FORMAT)
        stored_hmac = body.pop("manifest_hmac", None)
        stored_crc = body.pop("manifest_crc32", None)
        if stored_crc != _crc_of_body(body):
            raise ManifestError("manifest checksum mismatch (the manifest itself is corrupt)")
        if secret is not None:
            body["manifest_crc32"] = stored_crc
            if stored_hmac is None:
                raise ManifestError("manifest is not signed, but this job has a secret_file", Damage.UNTRUSTED)
            if not isinstance(stored_hmac, str) or not hmac.compare_digest(stored_hmac, _hmac_of_body(body, secret)):
                raise ManifestError("manifest is signed with another secret (or was altered)", Damage.UNTRUSTED)
        try:
            manifest = cls._from_body(body, version, signed=secret is not None)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"manifest field missing or of the wrong type ({exc!r})") from exc
        if isinstance(manifest.step, bool) or not isinstance(manifest.step, int) or manifest.step < 0:
            raise ManifestError(f"bad step {manifest.step!r}")
        if not isinstance(manifest.world_size, int) or manifest.world_size < 1:
            raise ManifestError(f"bad world_size {manifest.world_size!r}")
        if manifest.data_dir and not is_safe_name(manifest.data_dir):
            raise ManifestError(f"unsafe data folder {manifest.data_dir!r} in manifest")
        if secret is not None and any(f.sha256 is None for f in manifest.files):
            raise ManifestError("a file of the manifest has no sha256, but this job has a secret_file",
                                Damage.UNTRUSTED)
        return manifest

    @classmethod
    def _from_body(cls, body: dict[str, Any], version: int, *, signed: bool) -> "Manifest":
        files = tuple(
            FileEntry(path=f["path"], size=f["size"], crc32=int(f["crc32"], 16), rank=f["rank"],
                      sha256=f.get("sha256"))
            for f in body["files"]
        )
        writer = body.get("writer") or {}
        return cls(
            step=body["step"],
            world_size=body["world_size"],
            files=files,
            created_unix_s=float(body["created_unix_s"]),
            torch_version=str(body["torch_version"]),
            per_rank_keys=tuple(body.get("per_rank_keys", ())),
            generation=int(body.get("generation", 1)),
            data_dir=str(body.get("data_dir", "")),
            writer=WriterToken(run_id=str(writer.get("run_id", "")), launch_id=str(writer.get("launch_id", "")),
                               round=int(writer.get("round", 0)), epoch=int(writer.get("epoch", 0))),
            signed=signed,
            format_version=version,
        )


def manifest_name(generation: int) -> str:
    """MANIFEST.json for the first commit of a step, MANIFEST.<g>.json for the g-th."""
    return MANIFEST_NAME if generation == 1 else f"MANIFEST.{generation}.json"


def is_safe_name(name: object) -> bool:
    """A plain file name inside the step directory: no separators, no '..'."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
    )


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _crc_of_body(body: dict[str, Any]) -> str:
    return f"{checksum.crc32(_canonical(body)):08x}"


def _hmac_of_body(body: dict[str, Any], secret: bytes) -> str:
    return hmac.new(secret, b"elastic-rt-manifest\0" + _canonical(body), hashlib.sha256).hexdigest()
