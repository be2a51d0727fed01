"""One save from start to commit: step directory, per-rank file, DCP shards, then the manifest."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic_rt.checkpoint import collectives as coll
from elastic_rt.checkpoint.collectives import CheckpointGroups
from elastic_rt.checkpoint.manifest import FileEntry, Manifest, ManifestError
from elastic_rt.checkpoint.options import CheckpointOptions, SaveStats
from elastic_rt.checkpoint.staging import BufferPool, StagingSavePlanner
from elastic_rt.checkpoint.user_state import encode_per_rank
from elastic_rt.checkpoint.storage import CheckpointStore, rank_filename
from elastic_rt.checkpoint.writer import ChecksumWriter
from elastic_rt.errors import CheckpointError, ElasticRTError

log = logging.getLogger(__name__)


def describe_error(exc: BaseException) -> str:
    """One line for an error, also for DCP's CheckpointException (which carries tracebacks)."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {rank}: {describe_error(err)}" for rank, (err, _) in sorted(exc.failures.items()))
    if isinstance(exc, ElasticRTError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


@dataclass(kw_only=True)
class SaveJob:
    """Bookkeeping of one save, shared by the training thread and the writer thread."""

    step: int
    global_state: dict[str, Any]
    per_rank: dict[str, Any]
    async_save: bool
    started: float = field(default_factory=time.monotonic)
    staged: threading.Event = field(default_factory=threading.Event)
    staging_s: float = 0.0
    blocked_s: float = 0.0
    balance_ptrs: frozenset[int] = frozenset()
    future: Future | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_blocked(self, seconds: float) -> None:
        with self.lock:
            self.blocked_s += seconds

    def mark_staged(self, staging_s: float) -> None:
        self.staging_s = staging_s
        self.staged.set()


@dataclass(frozen=True, kw_only=True)
class SaveContext:
    """What a save needs from its manager."""

    url: str
    store: CheckpointStore
    groups: CheckpointGroups
    options: CheckpointOptions
    sync_files: bool
    pool: BufferPool
    make_writer: Callable[..., ChecksumWriter] = ChecksumWriter  # (fs, path, *, rank, step, sync_files, thread_count)
    before_prepare: Callable[[], None] = lambda: None  # rank 0, before touching the step directory


def run_save(job: SaveJob, ctx: SaveContext) -> SaveStats | None:
    """Write and commit job on this rank (every rank calls it); None when the step was already
    committed. Raises CheckpointError; nothing is committed then."""
    try:
        return _save_and_commit(job, ctx)
    except ElasticRTError:
        raise
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(
            f"saving step {job.step} to {ctx.url} failed ({describe_error(exc)}); "
            "the previous checkpoint stays the latest"
        ) from exc
    finally:
        job.staged.set()


def _save_and_commit(job: SaveJob, ctx: SaveContext) -> SaveStats | None:
    store, io_group, rank = ctx.store, ctx.groups.io, ctx.groups.rank
    step_dir = store.step_dir(job.step)
    decision = _prepare_step_dir(job.step, step_dir, ctx) if rank == 0 else None
    decision = coll.broadcast(decision, io_group)
    if decision == "exists":
        log.info("checkpoint step %d already committed under %s; not saving it again", job.step, ctx.url)
        return None
    if decision != "go":
        raise CheckpointError(str(decision))
    store.makedirs(step_dir)
    writer = ctx.make_writer(
        store.fs,
        step_dir,
        rank=rank,
        step=job.step,
        sync_files=ctx.sync_files,
        thread_count=ctx.options.thread_count,
    )
    planner = StagingSavePlanner(
        pool=ctx.pool if job.async_save else None,
        on_staged=job.mark_staged,
        balance_ptrs=job.balance_ptrs,
    )
    try:
        dcp.save(
            job.global_state, storage_writer=writer, planner=planner, process_group=io_group, no_dist=io_group is None
        )
    finally:
        writer.close()
    files = writer.file_entries()
    if job.per_rank:  # after the shards: an async save() does not wait for this write
        name = rank_filename(rank)
        size, crc = store.write_file(step_dir, name, encode_per_rank(job.per_rank), sync=ctx.sync_files)
        files.append(FileEntry(path=name, size=size, crc32=crc, rank=rank))
    if ctx.sync_files:
        store.fsync_dir(step_dir)
    gathered = coll.gather(files, io_group)  # doubles as the barrier: every rank's files are durable
    error = None
    if rank == 0:
        error = _commit(job, step_dir, [f for per_rank in gathered for f in per_rank], ctx)  # type: ignore[union-attr]
    error = coll.broadcast(error, io_group)
    if error is not None:
        raise CheckpointError(error)
    now = time.monotonic()
    return SaveStats(
        step=job.step,
        world_size=ctx.groups.world_size,
        async_save=job.async_save,
        blocked_s=job.blocked_s if job.async_save else now - job.started,
        save_duration_s=now - job.started,
        staging_s=job.staging_s if job.async_save else 0.0,
        bytes_written=sum(f.size for f in files),
        url=ctx.url,
    )


def _prepare_step_dir(step: int, step_dir: str, ctx: SaveContext) -> str:
    """Rank 0: 'exists' if the step is committed, else clear leftovers of a crashed save."""
    ctx.before_prepare()
    try:
        if ctx.store.fs.exists(step_dir):
            try:
                ctx.store.read_manifest(step_dir)
                return "exists"
            except ManifestError as exc:
                log.info("checkpoint step %d under %s: clearing leftovers of an interrupted save (%s)",
                         step, ctx.url, exc)
                ctx.store.delete(step_dir)
        ctx.store.make_step_dir(step_dir, sync=ctx.sync_files)
    except OSError as exc:
        return f"cannot prepare {step_dir} on {ctx.url} ({exc})"
    return "go"


def _commit(job: SaveJob, step_dir: str, files: list[FileEntry], ctx: SaveContext) -> str | None:
    """Rank 0: write the manifest, the commit point; returns an error message or None."""
    try:
        manifest = Manifest(
            step=job.step,
            world_size=ctx.groups.world_size,
            files=tuple(files),
            created_unix_s=time.time(),
            torch_version=torch.__version__,
            per_rank_keys=tuple(sorted(job.per_rank)),
        )
        ctx.store.write_manifest(step_dir, manifest)
    except (OSError, ElasticRTError) as exc:
        return f"committing step {job.step} to {ctx.url} failed: {exc}"
    return None
