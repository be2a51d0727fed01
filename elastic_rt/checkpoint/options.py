"""Configuration and result types of the checkpoint manager (frozen, keyword-only dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Mapping

from elastic_rt.errors import ConfigError

IfBusy = Literal["wait", "skip"]


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How a CheckpointManager saves, keeps and loads checkpoints.

    keep_last: committed checkpoints kept; older ones are deleted after a newer commit.
    async_save: stage to host memory and upload in a background thread.
    if_busy: a save requested while one is in flight either waits for it or is skipped.
    verify_on_load: check every file's size and crc32 against the manifest before loading.
    per_rank_keys: top-level state keys saved separately for every rank (RNG states);
        every other key is global (replicated tensors are written once, DTensors by shard).
    collective_timeout_s: timeout of the checkpoint process groups' collectives.
    sync_files: fsync every file before commit; None means "on local file systems".
    thread_count: writer threads (one file per thread) per rank.
    storage_options: passed to fsspec (credentials, endpoints, ...).
    secret_file: a file holding the job secret: manifests are HMAC-signed and every file's sha256
        is in them; loads refuse what does not verify (docs/checkpoint.md, "Trust").
    file_mode, dir_mode: permissions of the files and folders a save creates (local disks).
    writer_lease_ttl_s: the writer lease's time to live (checkpoint/writer_lease.py).
    writer_wait_s: how long a new manager waits for another job's live lease on the URL to be
        released before refusing (0: refuse at once).
    fence_wait_s: how long a commit waits for the agent to confirm the round (a late lease beat)
        before refusing.
    memory_every, persist_every: with either set, save() is called every step and decides: a
        snapshot to the node's memory tier (replicated to a peer node) every `memory_every` steps,
        a checkpoint on storage every `persist_every` steps (docs/checkpoint.md, "Tiers").
    """

    keep_last: int = 3
    async_save: bool = False
    if_busy: IfBusy = "wait"
    verify_on_load: bool = True
    per_rank_keys: tuple[str, ...] = ("rng",)
    collective_timeout_s: float = 600.0
    sync_files: bool | None = None
    thread_count: int = 1
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    secret_file: str | None = None
    file_mode: int = 0o600
    dir_mode: int = 0o700
    writer_lease_ttl_s: float = 20.0
    writer_wait_s: float = 0.0
    fence_wait_s: float = 5.0
    memory_every: int | None = None
    persist_every: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ConfigError(
                f"keep_last must be an integer >= 1 (got {self.keep_last!r}); "
                "the newest committed checkpoint is never deleted"
            )
        if self.if_busy not in ("wait", "skip"):
            raise ConfigError(f"if_busy must be 'wait' or 'skip' (got {self.if_busy!r})")
        if not self.collective_timeout_s > 0:
            raise ConfigError(
                f"collective_timeout_s must be > 0 seconds (got {self.collective_timeout_s!r})"
            )
        if not isinstance(self.thread_count, int) or self.thread_count < 1:
            raise ConfigError(f"thread_count must be an integer >= 1 (got {self.thread_count!r})")
        for name in ("file_mode", "dir_mode"):
            mode = getattr(self, name)
            if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
                raise ConfigError(f"{name} must be a permission mode such as 0o600 (got {mode!r})")
        if not self.writer_lease_ttl_s > 0:
            raise ConfigError(f"writer_lease_ttl_s must be > 0 seconds (got {self.writer_lease_ttl_s!r})")
        for name in ("writer_wait_s", "fence_wait_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0 seconds (got {getattr(self, name)!r})")
        for name in ("memory_every", "persist_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1 or None (got {value!r})")
        if isinstance(self.per_rank_keys, str):
            raise ConfigError("per_rank_keys must be a tuple of key names, not a string")
        object.__setattr__(self, "per_rank_keys", tuple(self.per_rank_keys))
        object.__setattr__(self, "storage_options", MappingProxyType(dict(self.storage_options)))


@dataclass(frozen=True, kw_only=True)
class SaveStats:
    """What one committed save cost; handed to the on_saved callback (e.g. for Prometheus).

    blocked_s: time the training loop was blocked by this save (inside save(), waiting
        for a previous save, and waiting for staging before the next optimizer step).
    save_duration_s: from the save() call until the checkpoint was committed.
    staging_s: time spent copying this rank's share to host buffers (0 for sync saves).
    """

    step: int
    world_size: int
    async_save: bool
    blocked_s: float
    save_duration_s: float
    staging_s: float
    bytes_written: int
    url: str
    fence_check_s: float = 0.0  # rank 0: checking the writer's token before the commit
    tier: str = "storage"  # "memory": a snapshot in the memory tier (url memory-tier://<node>), reported once every
    # rank's push to its peer succeeded (a snapshot a node could not replicate is not reported: it would not survive
    # that node's loss)
