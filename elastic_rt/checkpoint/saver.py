"""One save from start to commit: a save folder of the writer's epoch, DCP shards and per-rank files, then
a create-only manifest, committed only while the writer's token is current.

Failure symmetry: every step a rank takes between two collectives is caught and carried, as a
status, into the next collective (the gather of file lists, the broadcast of the outcome), so an
error on any one rank (ENOSPC, an unpicklable per-rank value, a bug on rank 0) is one
CheckpointError on every rank within one collective round trip, never a wait for the timeout.
DCP's own steps already exchange their errors that way.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic_rt.checkpoint import collectives as coll
from elastic_rt.checkpoint.collectives import CheckpointGroups
from elastic_rt.checkpoint.guard import WriterGuard
from elastic_rt.checkpoint.manifest import FileEntry, Manifest
from elastic_rt.checkpoint.options import CheckpointOptions, SaveStats
from elastic_rt.checkpoint.staging import BufferPool, StagingSavePlanner
from elastic_rt.checkpoint.storage import CheckpointStore, rank_filename, save_dirname
from elastic_rt.checkpoint.user_state import encode_per_rank
from elastic_rt.checkpoint.writer import ChecksumWriter
from elastic_rt.errors import CheckpointError, ElasticRTError

log = logging.getLogger(__name__)

COMMIT_TRIES = 3


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
    returned: threading.Event = field(default_factory=threading.Event)  # async: save() has returned
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
    guard: WriterGuard
    make_writer: Callable[..., ChecksumWriter] = ChecksumWriter  # (storage, path, *, rank, step, sync_files, ...)
    before_prepare: Callable[[], None] = lambda: None  # rank 0, before touching the step folder


def run_save(job: SaveJob, ctx: SaveContext) -> SaveStats:
    """Write and commit job on this rank (every rank calls it). Raises CheckpointError on every rank
    alike; nothing is committed then."""
    try:
        return _save_and_commit(job, ctx)
    except ElasticRTError:
        raise
    except (Exception, CheckpointException) as exc:  # a collective failed: a peer died or timed out
        raise _failed(job, ctx, describe_error(exc)) from exc
    finally:
        job.staged.set()


def _failed(job: SaveJob, ctx: SaveContext, why: str) -> CheckpointError:
    return CheckpointError(f"saving step {job.step} to {ctx.url} failed ({why}); the previous checkpoint stays "
                           "the latest")


def _save_and_commit(job: SaveJob, ctx: SaveContext) -> SaveStats:
    store, io_group, rank = ctx.store, ctx.groups.io, ctx.groups.rank
    plan = _prepare(job, ctx) if rank == 0 else None
    plan = coll.broadcast(plan, io_group)
    if isinstance(plan, str):
        raise _failed(job, ctx, plan)
    step_path = store.step_dir(job.step)
    data_dir = posixpath.join(step_path, plan["save_dir"])
    files: list[FileEntry] = []
    error = None
    try:
        files = _write_rank_files(job, ctx, data_dir)
    except CheckpointException as exc:  # DCP's: every rank has it, with every rank's reasons
        error = describe_error(exc)
    except Exception as exc:  # this rank's alone: the others learn it in the gather below
        error = f"rank {rank}: {describe_error(exc)}"
    gathered = coll.gather((files, error), io_group)  # doubles as the barrier: every rank's files are durable
    outcome = None
    if rank == 0:
        outcome = _decide(job, ctx, step_path, plan, gathered)  # type: ignore[arg-type]
    outcome = _announce(job, ctx, outcome)
    if outcome is not None:
        raise _failed(job, ctx, outcome)
    now = time.monotonic()
    if job.async_save:  # blocked_s is final only once save() has added its own wait
        job.returned.wait()
    return SaveStats(
        step=job.step,
        world_size=ctx.groups.world_size,
        async_save=job.async_save,
        blocked_s=job.blocked_s if job.async_save else now - job.started,
        save_duration_s=now - job.started,
        staging_s=job.staging_s if job.async_save else 0.0,
        bytes_written=sum(f.size for f in files),
        url=ctx.url,
        fence_check_s=ctx.guard.last_check_s if rank == 0 else 0.0,
    )


def _announce(job: SaveJob, ctx: SaveContext, outcome: str | None) -> str | None:
    """Broadcast rank 0's outcome. When that fails (the peers are gone: a stale rank 0 resumed after the
    others were re-formed out of its group), rank 0 still says what it decided, not only the broken pipe."""
    try:
        return coll.broadcast(outcome, ctx.groups.io)
    except (Exception, CheckpointException) as exc:
        if ctx.groups.rank != 0:
            raise
        if outcome is None:
            raise CheckpointError(
                f"step {job.step} was committed under {ctx.url}, but telling the other ranks failed "
                f"({describe_error(exc)})") from exc
        # the collective's own text (gloo's, several sentences) adds nothing to rank 0's line: name it only
        raise _failed(job, ctx, f"{outcome}; the other ranks are gone ({type(exc).__name__} telling them)") from exc


def _prepare(job: SaveJob, ctx: SaveContext) -> dict[str, Any] | str:
    """Rank 0: the step's next generation and a new save folder of this writer's epoch, or an error line."""
    try:
        ctx.before_prepare()
        entry = ctx.store.entry(job.step)
        generation = max((c.generation for c in entry.commits), default=0) + 1
        save_dir = save_dirname(ctx.guard.epoch, uuid.uuid4().hex[:8])
        storage = ctx.store.storage
        storage.makedir(entry.path, sync=ctx.sync_files)
        storage.makedir(posixpath.join(entry.path, save_dir), sync=ctx.sync_files)
    except Exception as exc:  # carried to every rank by the broadcast
        return f"rank 0: cannot prepare step {job.step} under {ctx.url} ({describe_error(exc)})"
    return {"save_dir": save_dir, "generation": generation}


def _write_rank_files(job: SaveJob, ctx: SaveContext, data_dir: str) -> list[FileEntry]:
    store, rank = ctx.store, ctx.groups.rank
    sha = store.secret is not None
    writer = ctx.make_writer(store.storage, data_dir, rank=rank, step=job.step, sync_files=ctx.sync_files,
                             thread_count=ctx.options.thread_count, sha=sha)
    planner = StagingSavePlanner(
        pool=ctx.pool if job.async_save else None, on_staged=job.mark_staged, balance_ptrs=job.balance_ptrs)
    try:
        dcp.save(job.global_state, storage_writer=writer, planner=planner, process_group=ctx.groups.io,
                 no_dist=ctx.groups.io is None)
    finally:
        writer.close()
    files = writer.file_entries()
    if job.per_rank:  # after the shards: an async save() does not wait for this write
        entry = store.write_file(data_dir, rank_filename(rank), encode_per_rank(job.per_rank), sync=ctx.sync_files)
        files.append(replace(entry, rank=rank))
    if ctx.sync_files:
        store.storage.sync_dir(data_dir)
    return files


def _decide(job: SaveJob, ctx: SaveContext, step_path: str, plan: dict[str, Any],
            gathered: list[tuple[list[FileEntry], str | None]]) -> str | None:
    """Rank 0: commit if every rank wrote its files and this writer is current; else the error line
    (the save folder of this attempt is removed then: it is this writer's own)."""
    errors = list(dict.fromkeys(e for _, e in gathered if e))
    outcome = "; ".join(errors) if errors else None
    if outcome is None:
        try:
            outcome = _commit(job, ctx, step_path, plan, [f for files, _ in gathered for f in files])
        except Exception as exc:  # rank 0's own failure reaches the others through the broadcast
            outcome = f"rank 0: {describe_error(exc)}"
    if outcome is not None:
        try:
            ctx.store.storage.remove_tree(posixpath.join(step_path, plan["save_dir"]))
        except (OSError, CheckpointError) as exc:
            log.info("checkpoint step %d: the failed save's folder stays until the next clean-up (%s)", job.step, exc)
    return outcome


def _commit(job: SaveJob, ctx: SaveContext, step_path: str, plan: dict[str, Any], files: list[FileEntry]) -> str | None:
    """Rank 0: check the token, then create the manifest; another writer's manifest of that generation is
    never replaced (this one goes on top of it, as the next generation)."""
    manifest = Manifest(
        step=job.step,
        world_size=ctx.groups.world_size,
        files=tuple(files),
        created_unix_s=time.time(),
        torch_version=torch.__version__,
        per_rank_keys=tuple(sorted(job.per_rank)),
        generation=plan["generation"],
        data_dir=plan["save_dir"],
        writer=ctx.guard.token,
    )
    for _ in range(COMMIT_TRIES):
        ctx.guard.check()  # FencedError: one line, nothing committed
        try:
            ctx.store.commit(step_path, manifest)
            return None
        except FileExistsError:
            log.warning("checkpoint step %d under %s: generation %d was committed by another writer meanwhile; "
                        "committing this save as generation %d", job.step, ctx.url, manifest.generation,
                        manifest.generation + 1)
            manifest = replace(manifest, generation=manifest.generation + 1)
    return f"step {job.step} under {ctx.url}: {COMMIT_TRIES} generations were committed by other writers meanwhile"
