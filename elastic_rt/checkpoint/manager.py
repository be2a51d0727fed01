"""CheckpointManager: sharded, atomic, optionally asynchronous checkpoints on fsspec (DCP underneath)."""

from __future__ import annotations

import copy
import logging
import threading
import time
import warnings
from dataclasses import replace
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, MutableMapping

import torch
import torch.distributed as dist

from elastic_rt.checkpoint import collectives as coll
from elastic_rt.checkpoint import loader
from elastic_rt.checkpoint.backends import Storage, open_storage
from elastic_rt.checkpoint.guard import WriterGuard
from elastic_rt.checkpoint.host_cache import HostCache
from elastic_rt.checkpoint.memory_tier import MemoryTier
from elastic_rt.checkpoint.options import CheckpointOptions, IfBusy, SaveStats
from elastic_rt.checkpoint.retention import apply_retention
from elastic_rt.checkpoint.saver import SaveContext, SaveJob, describe_error, run_save
from elastic_rt.checkpoint.staging import BufferPool
from elastic_rt.checkpoint.storage import CheckpointEntry, CheckpointStore
from elastic_rt.checkpoint.secret import read_secret_file
from elastic_rt.checkpoint.user_state import optimizer_storage_ptrs, snapshot, split_state, storage_ptr
from elastic_rt.checkpoint.writer import ChecksumWriter
from elastic_rt.errors import CheckpointError, ElasticRTError
from elastic_rt.worker_env import WorkerEnvironment

log = logging.getLogger(__name__)


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
        secret_file: str | None = None,
        file_mode: int = 0o600,
        dir_mode: int = 0o700,
        writer_lease_ttl_s: float = 20.0,
        writer_wait_s: float | None = None,
        fence_wait_s: float = 5.0,
        storage: Storage | None = None,
        memory_every: int | None = None,
        persist_every: int | None = None,
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
            secret_file=secret_file,
            file_mode=file_mode,
            dir_mode=dir_mode,
            writer_lease_ttl_s=writer_lease_ttl_s,
            # None: what the launcher's environment says (ELASTIC_RT_CHECKPOINT_WRITER_WAIT_S), else long
            # enough for a crashed predecessor on another host to be taken over (its beat stands still for
            # the TTL); a live holder is refused after that
            writer_wait_s=writer_wait_s if writer_wait_s is not None else (
                WorkerEnvironment.from_env().checkpoint_writer_wait_s or 1.5 * writer_lease_ttl_s),
            fence_wait_s=fence_wait_s,
            memory_every=memory_every,
            persist_every=persist_every,
        )
        if keep_last == 1:
            log.warning("checkpoint keep_last=1 under %s: a save that turns out damaged leaves nothing to fall back "
                        "to; keep at least 2", url)
        self.url = url
        secret = read_secret_file(secret_file) if secret_file else None
        storage = storage or open_storage(url, self.options.storage_options, file_mode=file_mode, dir_mode=dir_mode)
        self._store = CheckpointStore(url, storage=storage, secret=secret)
        self._sync_files = storage.local if sync_files is None else sync_files
        self._on_saved = on_saved
        self._groups = coll.CheckpointGroups.create(process_group, self.options.collective_timeout_s)
        if self._groups.io is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
        self.rank, self.world_size = self._groups.rank, self._groups.world_size
        self._guard = WriterGuard.acquire(self._store.storage, self._groups, lease_ttl_s=writer_lease_ttl_s,
                                          wait_s=self.options.writer_wait_s, fence_wait_s=fence_wait_s)
        self._host_cache = HostCache.from_env(rank=self.rank)  # the node's copy in shared memory, if any
        self._ctx = SaveContext(
            url=url,
            store=self._store,
            groups=self._groups,
            options=self.options,
            sync_files=self._sync_files,
            pool=BufferPool(),
            guard=self._guard,
            make_writer=self._make_writer,
            before_prepare=self._wait_retention,
        )
        self._tier = (MemoryTier.from_env(rank=self.rank, groups=self._groups, secret=secret)
                      if memory_every else None)
        self._mem_ctx = None if self._tier is None else replace(
            self._ctx, url=self._tier.store.url, store=self._tier.store, pool=BufferPool(), sync_files=False,
            before_prepare=lambda: None)
        self._snapshot_step: int | None = None  # the newest snapshot committed (or restored) in the memory tier
        # a step restored from the memory tier is on the old world's nodes and their replicas, not replicated along
        # the new ring: the first save() after the restore snapshots whatever memory_every says, so that a second
        # node loss before the next due snapshot does not fall back to storage
        self._replicate_restored = False
        self.restored_from: str | None = None  # the tier the last load_latest() read: "memory", "storage" or None
        self._executor: ThreadPoolExecutor | None = None
        self._gc_executor: ThreadPoolExecutor | None = None
        self._retention: Future | None = None
        self._inflight: SaveJob | None = None
        self._retention_lock = threading.Lock()
        self._guarded: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._last_stats: SaveStats | None = None
        self.skipped_snapshots = 0  # memory tier snapshots not taken because the previous save was in flight
        self._closed = False

    # ------------------------------------------------------------------ saving

    def _make_writer(
        self, storage: Storage, path: str, *, rank: int, step: int, sync_files: bool, thread_count: int,
        sha: bool = False,
    ) -> ChecksumWriter:
        """The DCP storage writer of one rank's save (a subclass may wrap it)."""
        return ChecksumWriter(storage, path, rank=rank, step=step, sync_files=sync_files, thread_count=thread_count,
                              sha=sha)

    def save(self, step: int, state: MutableMapping[str, Any], *, persist: bool | None = None) -> bool:
        """Checkpoint `state` as step `step`. Sync: returns once committed. Async: returns once
        staged (or at once when guard_optimizer() is used); False when skipped (if_busy='skip').
        With memory_every/persist_every, call it every step: it snapshots to the memory tier or
        persists to storage when the step is due (persist=True: to storage now, e.g. on SIGTERM),
        and returns False for a step that is neither. The first call after load_latest() restored a
        snapshot from the memory tier of a multi-node job snapshots whatever memory_every says: the
        restored step's shards are not yet replicated along the new world's ring. With async_save, a snapshot due while any save is
        in flight is skipped on every rank (False): snapshots coalesce, never queue."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be an integer >= 0, got {step!r}")
        ctx = self._ctx
        every, mem_every = self.options.persist_every, self.options.memory_every
        if every or mem_every:
            to_storage = persist if persist is not None else bool(every and step % every == 0)
            if not to_storage:
                due = bool(mem_every) and step % mem_every == 0
                if self._mem_ctx is None or not (due or self._replicate_restored):
                    return False
                ctx = self._mem_ctx
        entered = time.monotonic()
        self._raise_background_error()
        coalesce = self.options.async_save and ctx is self._mem_ctx
        if coalesce or (self.options.async_save and self.options.if_busy == "skip"):
            busy = self._inflight is not None and not self._inflight.future.done()  # type: ignore[union-attr]
            if coll.any_true(busy, self._groups.ctl):
                if coalesce:  # the one in flight is the newest the tier will have
                    self.skipped_snapshots += 1
                    log.debug("memory tier snapshot of step %d skipped: the previous save is still in flight", step)
                else:
                    log.info("checkpoint step %d skipped: the previous save is still being written", step)
                return False
        self._replicate_restored = False
        self._wait_inflight()
        global_part, per_rank = split_state(state, self.options.per_rank_keys)
        protected = frozenset(optimizer_storage_ptrs(self._guarded))
        if not self.options.async_save:
            job = SaveJob(
                step=step,
                global_state=snapshot(global_part, keep_live=lambda t: True),
                per_rank=per_rank,
                async_save=False,
                started=entered,
                balance_ptrs=protected,
            )
            self._run_job(job, ctx)
            return True
        overlap = bool(self._guarded)
        keep_live = (lambda t: storage_ptr(t) in protected) if overlap else (lambda t: True)
        job = SaveJob(
            step=step,
            global_state=snapshot(global_part, keep_live=keep_live),
            per_rank=copy.deepcopy(per_rank),
            async_save=True,
            started=entered,
            balance_ptrs=protected,
        )
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-rt-ckpt")
        job.future = self._executor.submit(self._run_job, job, ctx)
        self._inflight = job
        try:
            if not overlap:
                job.staged.wait()
            job.add_blocked(time.monotonic() - entered)
        finally:
            job.returned.set()  # the writer reports blocked_s only after this, so it counts the wait above
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

    def _run_job(self, job: SaveJob, ctx: SaveContext) -> SaveStats:
        stats = run_save(job, ctx)
        report = True
        if ctx is self._mem_ctx:
            report = self._tier.after_commit(job.step, self._groups,  # type: ignore[union-attr]
                                             keep_from=self._snapshot_step)
            self._snapshot_step = job.step
            stats = replace(stats, tier="memory")
            if not report and self.rank == 0:
                log.warning("snapshot step %d is in its nodes' memory but not replicated from every node: not "
                            "reported as committed (the loss of a node whose push failed falls back to an older "
                            "step)", job.step)
        elif self._host_cache is not None:
            self._host_cache.keep(self._store, job.step)
        if self.rank == 0 and ctx is self._ctx:  # deleting old checkpoints is off the training loop's path
            with self._retention_lock:
                if self._gc_executor is None:
                    self._gc_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-rt-ckpt-gc")
                self._retention = self._gc_executor.submit(self._apply_retention, job.step)
        self._last_stats = stats
        if report and self._on_saved is not None:
            try:
                self._on_saved(stats)
            except Exception as exc:  # a metrics hook must not fail a committed save
                log.warning("checkpoint on_saved callback failed: %s", exc)
        return stats

    def _apply_retention(self, newest_step: int) -> None:
        """Rank 0, after the commit was announced, so no other rank waits for the deletes."""
        try:
            deleted = apply_retention(self._store, self._guard, keep_last=self.options.keep_last,
                                      newest_step=newest_step)
            if deleted:
                log.info("checkpoint retention under %s deleted steps %s", self.url, deleted)
        except (OSError, ElasticRTError) as exc:
            log.warning("checkpoint retention under %s stopped: %s", self.url, exc)

    def _wait_retention(self) -> None:
        """Rank 0: retention must not run while a save writes a new step directory."""
        with self._retention_lock:
            pending, self._retention = self._retention, None
        if pending is not None:
            pending.result()  # _apply_retention never raises

    # ----------------------------------------------------------------- loading

    def load_latest(self, state: MutableMapping[str, Any]) -> int | None:
        """Load the newest committed checkpoint that verifies into `state` (in place: tensors are
        copied into the given ones, other values replaced); older ones are the fallback, with a
        warning. Returns its step; None when no checkpoint was ever committed under the URL."""
        self._check_open()
        self._wait_inflight()
        self._wait_retention()
        if self._tier is not None:
            step = self._load_from_memory(state)
            if step is not None:
                self.restored_from = "memory"
                return step
        self.restored_from = "storage"
        if self._host_cache is None:
            step = loader.load_latest(state, store=self._store, source=self._store, groups=self._groups,
                                      options=self.options)
        else:
            source = self._host_cache.source(self._store, self._groups, verify=self.options.verify_on_load)
            step = source.report(loader.load_latest(state, store=self._store, source=source, groups=self._groups,
                                                    options=self.options))
        if self._tier is not None and self._tier.leader:  # snapshots newer than storage's step: none loaded
            self._tier.prune(keep=set(), above=-1 if step is None else step)
        return step

    def _load_from_memory(self, state: MutableMapping[str, Any]) -> int | None:
        """The newest snapshot in the memory tier newer than storage's newest commit, read from this node's
        memory, the replicas and the live peers; None (storage next) when there is none or none verifies."""
        tier = self._tier
        newest = None
        if self.rank == 0:
            try:
                newest = self.latest_committed_step()
            except ElasticRTError as exc:
                newest = str(exc)
        newest = coll.broadcast(newest, self._groups.ctl)
        if isinstance(newest, str):
            raise CheckpointError(newest)
        counts = tier.storage.counts
        before = (counts.own, counts.replicas, sum(counts.peers.values()))
        try:
            step = loader.load_latest(state, store=tier.store, source=tier.store, groups=self._groups,
                                      options=self.options, newer_than=newest)
        except CheckpointError as exc:
            if self.rank == 0:
                log.warning("memory tier: no snapshot newer than storage's step %s loads (%s); loading from storage",
                            newest, exc)
            return None
        if step is None:
            return None
        own, replicas, peers = (counts.own - before[0], counts.replicas - before[1],
                                sum(counts.peers.values()) - before[2])
        log.info("rank %d: step %d restored from the memory tier: %d file(s) from this node's snapshots, "
                 "%d from replicas held here, %d from peers; none from storage", self.rank, step, own, replicas, peers)
        if tier.leader:
            tier.prune(keep=set(), above=step)
        self._snapshot_step = step
        self._replicate_restored = tier.successor is not None
        return step

    # --------------------------------------------------------------- inspection / lifecycle

    def list_checkpoints(self) -> list[CheckpointEntry]:
        """Step folders under the URL, oldest first: absent, committed or damaged (files not verified)."""
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
            if self._guard.lease is not None:
                self._guard.lease.release()
            if self._host_cache is not None:
                self._host_cache.close()
            self._ctx.pool.clear()
            self._groups.destroy()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
