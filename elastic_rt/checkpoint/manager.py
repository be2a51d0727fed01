"""CheckpointManager: sharded, atomic, optionally asynchronous checkpoints on fsspec (DCP underneath)."""

from __future__ import annotations

import copy
import logging
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, MutableMapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic_rt.checkpoint import collectives as coll
from elastic_rt.checkpoint.manifest import FileEntry, Manifest, ManifestError
from elastic_rt.checkpoint.options import CheckpointOptions, IfBusy, SaveStats, pause_file_from_env
from elastic_rt.checkpoint.staging import BufferPool, StagingSavePlanner
from elastic_rt.checkpoint.state import (
    decode_per_rank,
    encode_per_rank,
    optimizer_storage_ptrs,
    snapshot,
    split_state,
    storage_ptr,
)
from elastic_rt.checkpoint.store import CheckpointEntry, CheckpointStore, rank_filename
from elastic_rt.checkpoint.writer import (
    PHASE_STAGING,
    ChecksumWriter,
    FilePauseHook,
    FsspecCheckpointReader,
    PauseHook,
)
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
class _SaveJob:
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


class CheckpointManager:
    """Save and restore training state under one fsspec URL: <url>/step_<N>/ per checkpoint,
    committed by <url>/step_<N>/MANIFEST.json. Construct it on every rank at the same time
    (it creates its own gloo process groups); call save()/load_latest() on every rank."""

    def __init__(
        self,
        url: str,
        *,
        keep_last: int = 3,
        async_save: bool = False,
        if_busy: IfBusy = "wait",
        verify_on_load: bool = True,
        per_rank_keys: tuple[str, ...] = ("rng",),
        collective_timeout_s: float = 600.0,
        sync_files: bool | None = None,
        thread_count: int = 1,
        storage_options: dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        on_saved: Callable[[SaveStats], None] | None = None,
        test_pause_file: str | None = None,
        test_pause_hook: PauseHook | None = None,
    ) -> None:
        self.options = CheckpointOptions(
            keep_last=keep_last,
            async_save=async_save,
            if_busy=if_busy,
            verify_on_load=verify_on_load,
            per_rank_keys=per_rank_keys,
            collective_timeout_s=collective_timeout_s,
            sync_files=sync_files,
            thread_count=thread_count,
            storage_options=storage_options or {},
            test_pause_file=test_pause_file or pause_file_from_env(),
        )
        self.url = url
        self._store = CheckpointStore(url, self.options.storage_options)
        self._sync_files = self._store.is_local if sync_files is None else sync_files
        if test_pause_hook is None and self.options.test_pause_file:
            test_pause_hook = FilePauseHook(self.options.test_pause_file)
        self._pause_hook = test_pause_hook
        self._on_saved = on_saved
        self._groups = coll.CheckpointGroups.create(process_group, self.options.collective_timeout_s)
        if self._groups.io is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
        self.rank, self.world_size = self._groups.rank, self._groups.world_size
        self._pool = BufferPool()
        self._executor: ThreadPoolExecutor | None = None
        self._gc_executor: ThreadPoolExecutor | None = None
        self._retention: Future | None = None
        self._inflight: _SaveJob | None = None
        self._guarded: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._last_stats: SaveStats | None = None
        self._closed = False

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: MutableMapping[str, Any]) -> bool:
        """Checkpoint `state` as step `step`. Sync: returns once committed. Async: returns once
        staged (or at once when guard_optimizer() is used); False when skipped (if_busy='skip')."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be an integer >= 0, got {step!r}")
        entered = time.monotonic()
        self._raise_background_error()
        if self.options.async_save and self.options.if_busy == "skip":
            busy = self._inflight is not None and not self._inflight.future.done()  # type: ignore[union-attr]
            if coll.any_true(busy, self._groups.ctl):
                log.info("checkpoint step %d skipped: the previous save is still being written", step)
                return False
        self._wait_inflight()
        global_part, per_rank = split_state(state, self.options.per_rank_keys)
        protected = frozenset(optimizer_storage_ptrs(self._guarded))
        if not self.options.async_save:
            job = _SaveJob(
                step=step,
                global_state=snapshot(global_part, keep_live=lambda t: True),
                per_rank=per_rank,
                async_save=False,
                started=entered,
                balance_ptrs=protected,
            )
            self._run_job(job)
            return True
        overlap = bool(self._guarded)
        keep_live = (lambda t: storage_ptr(t) in protected) if overlap else (lambda t: True)
        job = _SaveJob(
            step=step,
            global_state=snapshot(global_part, keep_live=keep_live),
            per_rank=copy.deepcopy(per_rank),
            async_save=True,
            started=entered,
            balance_ptrs=protected,
        )
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-rt-ckpt")
        job.future = self._executor.submit(self._run_job, job)
        self._inflight = job
        if not overlap:
            job.staged.wait()
        job.add_blocked(time.monotonic() - entered)
        return True

    def guard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Declare the optimizer whose step() is the only thing that changes its parameters and
        state. Async saves then copy those tensors in the background, overlapped with the next
        forward/backward, and optimizer.step() waits until the copy is done (do not change them
        otherwise before that step, or call wait_staged() first). Replicated copies of them
        (DDP) are identical on every rank, so their writes are spread across ranks by size;
        other replicated tensors (e.g. BatchNorm buffers) are written from rank 0."""
        self._check_open()
        self._guarded.append(optimizer)
        self._hooks.append(optimizer.register_step_pre_hook(lambda *_args: self.wait_staged()))

    def wait_staged(self) -> None:
        """Block until the in-flight save no longer reads the live tensors."""
        job = self._inflight
        if job is None or job.staged.is_set():
            return
        started = time.monotonic()
        job.staged.wait()
        job.add_blocked(time.monotonic() - started)

    def wait(self) -> SaveStats | None:
        """Finish the in-flight save; raises CheckpointError if it failed. Returns the last stats."""
        self._wait_inflight()
        return self._last_stats

    @property
    def last_stats(self) -> SaveStats | None:
        return self._last_stats

    def _wait_inflight(self) -> None:
        job = self._inflight
        if job is None:
            return
        if not job.future.done():  # type: ignore[union-attr]
            started = time.monotonic()
            job.future.exception()  # type: ignore[union-attr]  # waits
            job.add_blocked(time.monotonic() - started)
        self._raise_background_error()
        self._inflight = None

    def _raise_background_error(self) -> None:
        job = self._inflight
        if job is None or not job.future.done():  # type: ignore[union-attr]
            return
        self._inflight = None
        exc = job.future.exception()  # type: ignore[union-attr]
        if exc is not None:
            raise CheckpointError(
                f"background checkpoint save failed: {describe_error(exc)}"
            ) from exc

    def _run_job(self, job: _SaveJob) -> SaveStats | None:
        try:
            return self._save_and_commit(job)
        except ElasticRTError:
            raise
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(
                f"saving step {job.step} to {self.url} failed ({describe_error(exc)}); "
                "the previous checkpoint stays the latest"
            ) from exc
        finally:
            job.staged.set()

    def _save_and_commit(self, job: _SaveJob) -> SaveStats | None:
        store, io_group = self._store, self._groups.io
        step_dir = store.step_dir(job.step)
        decision = self._prepare_step_dir(job.step, step_dir) if self.rank == 0 else None
        decision = coll.broadcast(decision, io_group)
        if decision == "exists":
            log.info("checkpoint step %d already committed under %s; not saving it again", job.step, self.url)
            return None
        if decision != "go":
            raise CheckpointError(str(decision))
        store.makedirs(step_dir)
        files: list[FileEntry] = []
        if job.per_rank:
            name = rank_filename(self.rank)
            size, crc = store.write_file(step_dir, name, encode_per_rank(job.per_rank), sync=self._sync_files)
            files.append(FileEntry(path=name, size=size, crc32=crc, rank=self.rank))
        writer = ChecksumWriter(
            store.fs,
            step_dir,
            rank=self.rank,
            step=job.step,
            sync_files=self._sync_files,
            thread_count=self.options.thread_count,
            pause_hook=self._pause_hook,
        )
        hook = self._pause_hook
        planner = StagingSavePlanner(
            pool=self._pool if job.async_save else None,
            on_staged=job.mark_staged,
            balance_ptrs=job.balance_ptrs,
            before_stage=(lambda: hook(rank=self.rank, step=job.step, phase=PHASE_STAGING)) if hook else None,
        )
        try:
            dcp.save(job.global_state, storage_writer=writer, planner=planner, process_group=io_group, no_dist=io_group is None)
        finally:
            writer.close()
        files.extend(writer.file_entries())
        if self._sync_files:
            store.fsync_dir(step_dir)
        gathered = coll.gather(files, io_group)
        error = None
        if self.rank == 0:
            error = self._commit(job, step_dir, [f for per_rank in gathered for f in per_rank])  # type: ignore[union-attr]
        error = coll.broadcast(error, io_group)
        if error is not None:
            raise CheckpointError(error)
        if self.rank == 0:  # deleting old checkpoints is off the training loop's path
            if self._gc_executor is None:
                self._gc_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-rt-ckpt-gc")
            self._retention = self._gc_executor.submit(self._apply_retention, job.step)
        written = sum(f.size for f in files)
        stats = SaveStats(
            step=job.step,
            world_size=self.world_size,
            async_save=job.async_save,
            blocked_s=(time.monotonic() - job.started) if not job.async_save else job.blocked_s,
            save_duration_s=time.monotonic() - job.started,
            staging_s=job.staging_s if job.async_save else 0.0,
            bytes_written=written,
            url=self.url,
        )
        self._last_stats = stats
        if self._on_saved is not None:
            try:
                self._on_saved(stats)
            except Exception as exc:  # a metrics hook must not fail a committed save
                log.warning("checkpoint on_saved callback failed: %s", exc)
        return stats

    def _wait_retention(self) -> None:
        """Rank 0: retention must not run while a save is writing a new step directory."""
        if self._retention is not None:
            self._retention.result()  # _apply_retention never raises
            self._retention = None

    def _prepare_step_dir(self, step: int, step_dir: str) -> str:
        """Rank 0: 'exists' if the step is committed, else clear leftovers of a crashed save."""
        self._wait_retention()
        try:
            if self._store.fs.exists(step_dir):
                try:
                    self._store.read_manifest(step_dir)
                    return "exists"
                except ManifestError:
                    self._store.delete(step_dir)
            self._store.makedirs(step_dir)
        except OSError as exc:
            return f"cannot prepare {step_dir} on {self.url} ({exc})"
        return "go"

    def _commit(self, job: _SaveJob, step_dir: str, files: list[FileEntry]) -> str | None:
        """Rank 0: write the manifest, the commit point; returns an error message or None."""
        try:
            manifest = Manifest(
                step=job.step,
                world_size=self.world_size,
                files=tuple(files),
                created_unix_s=time.time(),
                torch_version=torch.__version__,
                per_rank_keys=tuple(sorted(job.per_rank)),
            )
            self._store.write_manifest(step_dir, manifest)
        except (OSError, ElasticRTError) as exc:
            return f"committing step {job.step} to {self.url} failed: {exc}"
        return None

    def _apply_retention(self, newest_step: int) -> None:
        """Rank 0, after the commit was announced: other ranks do not wait for the deletes."""
        try:
            deleted = self._store.apply_retention(self.options.keep_last, newest_step)
            if deleted:
                log.info("checkpoint retention under %s deleted steps %s", self.url, deleted)
        except (OSError, ElasticRTError) as exc:
            log.warning("checkpoint retention under %s failed: %s", self.url, exc)

    # ----------------------------------------------------------------- loading

    def load_latest(self, state: MutableMapping[str, Any]) -> int | None:
        """Load the newest committed checkpoint that verifies into `state` (in place); falls back
        to older ones with a warning. Returns its step, or None when there is none at all."""
        self._check_open()
        self._wait_inflight()
        candidates: Any = None
        if self.rank == 0:
            self._wait_retention()
            try:
                candidates = [(e.step, e.manifest) for e in reversed(self._store.list()) if e.committed]
            except ElasticRTError as exc:
                candidates = str(exc)
        candidates = coll.broadcast(candidates, self._groups.ctl)
        if isinstance(candidates, str):
            raise CheckpointError(candidates)
        failures = []
        for i, (step, manifest) in enumerate(candidates):
            step_dir = self._store.step_dir(step)
            problems = []
            if self.options.verify_on_load:
                mine = [f for j, f in enumerate(manifest.files) if j % self.world_size == self.rank]
                problems = self._store.verify_files(step_dir, mine)
            problems = sorted(p for per_rank in coll.all_gather(problems, self._groups.ctl) for p in per_rank)
            if problems:
                following = f"step {candidates[i + 1][0]}" if i + 1 < len(candidates) else "nothing"
                failures.append(f"step {step}: {problems[0]}")
                if self.rank == 0:
                    log.warning(
                        "checkpoint step %d under %s is corrupt (%s); falling back to %s",
                        step, self.url, "; ".join(problems), following,
                    )
                continue
            self._load_step(step, step_dir, manifest, state)
            return step
        if failures:
            raise CheckpointError(
                f"none of the {len(failures)} committed checkpoints under {self.url} verifies "
                f"({'; '.join(failures)}); move them aside to start from scratch"
            )
        return None

    def _load_step(self, step: int, step_dir: str, manifest: Manifest, state: MutableMapping[str, Any]) -> None:
        global_part, per_rank = split_state(state, self.options.per_rank_keys)
        reader = FsspecCheckpointReader(self._store.fs, step_dir)
        try:
            dcp.load(global_part, storage_reader=reader, process_group=self._groups.io, no_dist=self._groups.io is None)
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(
                f"loading step {step} from {self.url} failed ({describe_error(exc)}); "
                "does the state passed to load_latest() have the keys and shapes that were saved?"
            ) from exc
        state.update(global_part)
        wanted = set(per_rank) & set(manifest.per_rank_keys)
        name = rank_filename(self.rank)
        if not wanted:
            return
        if not any(f.path == name for f in manifest.files):
            log.info(
                "rank %d: step %d was saved at world size %d and has no %s for this rank; keeping current",
                self.rank, step, manifest.world_size, sorted(wanted),
            )
            return
        loaded = decode_per_rank(self._store.read_file(step_dir, name))
        for key in wanted & set(loaded):
            state[key] = loaded[key]

    # --------------------------------------------------------------- inspection / lifecycle

    def list_checkpoints(self) -> list[CheckpointEntry]:
        """Step directories under the URL, oldest first (committed or not; not verified)."""
        self._wait_retention()
        return self._store.list()

    def latest_committed_step(self) -> int | None:
        self._wait_retention()
        committed = [e.step for e in self._store.list() if e.committed]
        return committed[-1] if committed else None

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.url} is closed")

    def close(self) -> None:
        """Finish the in-flight save (raising its error, if any) and release threads and groups."""
        if self._closed:
            return
        try:
            self._wait_inflight()
        finally:
            self._closed = True
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self._guarded.clear()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._wait_retention()
            if self._gc_executor is not None:
                self._gc_executor.shutdown(wait=True)
            self._pool.clear()
            self._groups.destroy()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
