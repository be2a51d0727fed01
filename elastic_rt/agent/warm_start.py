"""Start a worker group from warm workers: torch's SubprocessContext around already-running processes.

torch's LocalElasticAgent._start_workers builds every worker's environment and
then calls `start_processes`. While `warm_start(pool)` is active, that call builds
a WarmSubprocessContext instead: the same PContext (pids, exit codes, error files,
log files and tee, close with a death signal), whose handlers wrap the warm
workers the pool hands over; a rank without a usable warm worker starts cold, and
one log line says why. Everything torch computes (environment, log paths) stays
torch's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import subprocess
from typing import Callable, Iterator

from torch.distributed.elastic.multiprocessing.api import RunProcsResult, SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler, get_subprocess_handler

from elastic_rt.diagnostics.failures import read_error_file
from elastic_rt.worker.numa import cpus_for_local_rank
from elastic_rt.agent.process_tree import kill_tree
from elastic_rt.agent.warm import WarmPool
from elastic_rt.torch_seams import patched_start_processes

log = logging.getLogger(__name__)

_CONTEXT_PARAMS = frozenset(inspect.signature(SubprocessContext.__init__).parameters) - {"self"}


class WarmHandler(SubprocessHandler):
    """A SubprocessHandler for a process that is already running (a warm worker that was started)."""

    def __init__(self, proc: subprocess.Popen, local_rank: int) -> None:  # noqa: super().__init__ spawns
        self.proc = proc
        self.local_rank_id = local_rank
        self._stdout = None
        self._stderr = None


class WarmSubprocessContext(SubprocessContext):
    """SubprocessContext whose ranks start from the warm pool where they can."""

    def __init__(self, *, pool: WarmPool, **kwargs) -> None:
        super().__init__(**kwargs)
        self._pool = pool
        self.warm_ranks: set[int] = set()

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("The subprocess handlers already initialized. Most likely the start method got called twice.")
        cold: dict[int, str] = {}
        importing: list[int] = []
        for rank in range(self.nprocs):
            cpus = cpus_for_local_rank(self._numa_options, rank) if self._numa_options is not None else None
            proc, why = self._pool.take(rank, entrypoint=self.entrypoint, args=self.args[rank], env=self.envs[rank],
                                        stdout=self.stdouts[rank], stderr=self.stderrs[rank], cpus=cpus)
            if proc is not None:
                self.subprocess_handlers[rank] = WarmHandler(proc, rank)
                self.warm_ranks.add(rank)
                if why:
                    importing.append(rank)
                continue
            cold[rank] = why
            self.subprocess_handlers[rank] = get_subprocess_handler(
                entrypoint=self.entrypoint, args=self.args[rank], env=self.envs[rank],
                stdout=self.stdouts[rank], stderr=self.stderrs[rank], local_rank_id=rank,
                numa_options=self._numa_options,
            )
        prefix = self._pool.log_prefix()
        if self.warm_ranks:
            log.info("%s started local rank(s) %s from warm workers%s", prefix, _ranks(self.warm_ranks),
                     f" ({_ranks(importing)} still importing)" if importing else "")
        if cold:
            log.warning("%s local rank(s) started cold: %s", prefix,
                        "; ".join(f"{r}: {why}" for r, why in sorted(cold.items())))


    def _poll(self) -> RunProcsResult | None:
        # torch's SubprocessContext would now SIGTERM the other workers and wait up to 30 s for them
        # (a worker that handles SIGTERM and sits in a collective takes seconds), before the agent
        # even hears of the failure. Report it at once: the agent stops the group itself (SIGKILL
        # and its process-tree stop for a broken group).
        done: set[int] = set()
        self._capture_process_failures(done)
        self._running_local_ranks.difference_update(done)
        if self._failures:
            self._take_raised(done)
            return RunProcsResult(failures=self._failures, stdouts=self.stdouts, stderrs=self.stderrs)
        return super()._poll()

    def _take_raised(self, done: set[int]) -> None:
        """A running worker whose exception is already recorded raised first and is still tearing
        down (an atexit handler, a DataLoader join): its peers failed because it closed their
        connections. It is the root cause, so it fails with them here, stopped at once (its whole
        tree; the agent would SIGKILL it next anyway), and is judged from its error file."""
        raised = [r for r in sorted(self._running_local_ranks)
                  if (rec := read_error_file(self.error_files.get(r))) is not None and rec.message]
        if not raised:
            return
        kill_tree([self.subprocess_handlers[r].proc.pid for r in raised])
        for r in raised:
            try:
                self.subprocess_handlers[r].proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # uninterruptible sleep: the agent's own stop reports it
                pass
        self._capture_process_failures(done)
        self._running_local_ranks.difference_update(done)


def _ranks(ranks) -> str:
    return ",".join(str(r) for r in sorted(ranks))


@contextlib.contextmanager
def warm_start(pool: WarmPool | None, *, ready: Callable[[], bool] | None = None) -> Iterator[None]:
    """Within the block, torch's agent starts its workers from `pool`; after it, the pool refills
    once `ready()` says the new workers are under way."""
    if pool is None:
        yield
        return

    def make(original):
        def start_processes(*args, **kwargs):
            options = {k: v for k, v in kwargs.items() if k != "start_method"}
            if args or not isinstance(kwargs.get("entrypoint"), str) or set(options) - _CONTEXT_PARAMS:
                return original(*args, **kwargs)  # a function entrypoint, or a torch this code does not know
            context = WarmSubprocessContext(pool=pool, **options)
            try:
                context.start()
                return context
            except Exception:
                context.close()
                raise

        return start_processes

    with patched_start_processes(make) as patched:
        yield
    if patched:
        pool.refill(ready)
