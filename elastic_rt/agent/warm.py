"""Warm workers, agent side: per local rank a pre-started worker process that waits for its environment.

The pool starts each warm worker through the normal worker entry point (so it has
PR_SET_PDEATHSIG and the teardown guard) with the environment the agent has before
any rendezvous, minus the variables a rendezvous decides (rank, world size, master
address, round, ...). A start hands the worker its full environment on a pipe
(take()); the pool then starts the next one in the background (refill()), niced
and only once the new workers have reported a step or refill_wait_s has passed,
so that it does not slow their first steps. Anything that does not match what
the warm worker was started with makes take() say why, and the caller starts
that rank cold.

Warm workers are spawned by one thread that lives as long as the agent: the
kernel sends PR_SET_PDEATHSIG when the *thread* that forked a child exits.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import select
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from elastic_rt.worker.warm_child import ENV_PAD, FLAG_FD, FLAG_IMPORTS, FLAG_NICE
from elastic_rt.errors import ConfigError
from elastic_rt.agent.scale_up import SCALE_UP_WAIT_S
from elastic_rt.sections import on_off, option, positive
from elastic_rt.torchrun_compat import virtual_local_rank_env
from elastic_rt.worker_env import (
    ENV_HEARTBEAT_DIR,
    ENV_HEARTBEAT_FILE,
    ENV_NODE_ID,
    ENV_PARENT_PID,
    ENV_ROUND,
    ENV_RUN_ID,
)

log = logging.getLogger(__name__)

# What a warm worker imports before it knows its rank: torch's own modules (DDP imports torch._dynamo
# on first use: seconds) and elastic-rt's checkpointing; nothing of the user's.
DEFAULT_WARM_IMPORTS = ("torch", "torch._dynamo", "torch.distributed.checkpoint", "elastic_rt.checkpoint")


def _modules(text: str) -> tuple[str, ...]:
    modules = tuple(m.strip() for m in (text or "").split(",") if m.strip())
    bad = [m for m in modules if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", m)]
    if bad:
        raise ConfigError(f"--warm-imports {bad[0]!r}: expected dotted module names, e.g. torch,numpy")
    return modules


@dataclass(frozen=True, kw_only=True)
class WarmSettings:
    """Warm workers' config section: --warm-workers, --warm-imports."""

    enabled: bool = option(
        "--warm-workers", default="on", choices=("on", "off"), parse=on_off,
        help="keep a pre-started worker per local rank (torch imported, waiting for its rank) so that a restart "
             "skips the interpreter start and imports (default on)")
    imports: tuple[str, ...] = option(
        "--warm-imports", default=",".join(DEFAULT_WARM_IMPORTS), parse=_modules,
        help="modules a warm worker imports ahead (comma-separated; library modules only: they run before the "
             "worker knows its rank)")
    scale_up_wait_s: float = option(
        "--warm-scale-up-wait", type=float, default=SCALE_UP_WAIT_S,
        parse=positive("--warm-scale-up-wait", zero_ok=True),
        help="seconds a running node holds the restart that admits a joining node while its own warm workers are "
             "still importing (the group trains meanwhile), and a node joining a running job waits for its own "
             "(default 60; 0: at once)")


WORKER_MODULE = "elastic_rt.worker.main"
# Variables a rendezvous decides (torch's LocalElasticAgent sets them per worker; the agent sets
# the ELASTIC_RT_* ones per round). A warm worker starts without them and learns them at start.
LATE_KEYS = frozenset({
    "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ENV_RUN_ID, ENV_NODE_ID, ENV_ROUND, ENV_HEARTBEAT_DIR, ENV_HEARTBEAT_FILE,
})
LATE_PREFIXES = ("TORCHELASTIC_",)
PAD_BYTES = 16 << 10
PIPE_BYTES = 1 << 20


def is_late(key: str) -> bool:
    return key in LATE_KEYS or key.startswith(LATE_PREFIXES)


def warm_environment(base: Mapping[str, str], agent_pid: int) -> dict[str, str]:
    """The environment a warm worker starts with: `base` without the late variables, the agent's pid,
    and the pad (last) that the worker overwrites with what it learns at start."""
    env = {k: v for k, v in base.items() if not is_late(k) and k != ENV_PAD}
    env[ENV_PARENT_PID] = str(agent_pid)
    env[ENV_PAD] = "x" * PAD_BYTES
    return env


def incompatibility(initial: Mapping[str, str], final: Mapping[str, str]) -> str | None:
    """Why a worker started with `initial` cannot become one whose environment is `final`; None if it can."""
    for key, value in initial.items():
        if key != ENV_PAD and final.get(key) != value:
            return f"{key} {'changed' if key in final else 'was unset'} after the warm worker started"
    for key in final:
        if key not in initial and not is_late(key):
            return f"{key} was set after the warm worker started"
    added = sum(len(k) + len(v) + 2 for k, v in final.items() if k not in initial)
    if added + 1 > len(ENV_PAD) + PAD_BYTES + 2:
        return "the worker environment outgrew the warm worker's room for it"
    return None


def warm_command(entrypoint: str, cold_args: Sequence[str], *, fd: int, ready_fd: int, nice: int,
                 imports: Sequence[str]) -> list[str] | None:
    """The warm worker's command line for a cold one (entrypoint, cold_args); None if not warmable."""
    args = list(cold_args)
    if len(args) < 4 or args[:4] != ["-u", "-m", WORKER_MODULE, "--"]:
        return None
    return [entrypoint, "-u", "-m", WORKER_MODULE, FLAG_FD, f"{fd},{ready_fd}", FLAG_NICE, str(nice),
            FLAG_IMPORTS, ",".join(imports), *args[3:]]


@dataclass
class _Warm:
    proc: subprocess.Popen
    write_fd: int
    env: dict[str, str]
    entrypoint: str
    cold_args: tuple[str, ...]
    started_at: float
    ready: threading.Event


class WarmPool:
    """Pre-started workers, one per local rank; see the module docstring."""

    def __init__(
        self,
        *,
        entrypoint: str,
        args_for_rank: Callable[[int], Sequence[str]],
        nproc: int,
        imports: Sequence[str] = DEFAULT_WARM_IMPORTS,
        nice: int = 10,
        refill_wait_s: float = 5.0,
        environ: Mapping[str, str] = os.environ,
        clock: Callable[[], float] = time.monotonic,
        env_for_rank: Callable[[int], Mapping[str, str]] = lambda rank: {},
    ) -> None:
        self.entrypoint, self._args_for_rank, self.nproc = entrypoint, args_for_rank, nproc
        self._env_for_rank = env_for_rank  # per-rank variables known before a rendezvous (--virtual-local-rank)
        self.imports, self.nice, self.refill_wait_s = tuple(imports), nice, refill_wait_s
        self._environ, self._clock = environ, clock
        self.log_prefix: Callable[[], str] = lambda: ""
        self._idle: dict[int, _Warm] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._request: tuple[int, Callable[[], bool] | None] | None = None
        self._generation = 0
        self._done = 0  # the last refill generation the spawning thread carried out (its spawns started)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.spawned = 0

    # ---- main thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the spawning thread and fill the pool now."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="elastic-rt-warm", daemon=True)
            self._thread.start()
        self.refill(ready=None)

    def refill(self, ready: Callable[[], bool] | None) -> None:
        """Start the missing warm workers once `ready()` is true (or refill_wait_s has passed)."""
        with self._wake:
            self._generation += 1
            self._request = (self._generation, ready)
            self._wake.notify_all()

    def warming(self) -> bool:
        """A warm worker is on its way: a refill is requested and not yet carried out, or one is still importing."""
        with self._lock:
            if self._closed:
                return False
            if self._request is not None and self._request[0] != self._done:
                return True
            return any(not w.ready.is_set() and w.proc.poll() is None for w in self._idle.values())

    def idle_pids(self, *, ready_only: bool = False) -> dict[int, int]:
        with self._lock:
            return {rank: w.proc.pid for rank, w in self._idle.items() if w.ready.is_set() or not ready_only}

    def take(self, local_rank: int, *, entrypoint: str, args: Sequence[str], env: Mapping[str, str],
             stdout: str, stderr: str, cpus: Sequence[int] | None = None) -> tuple[subprocess.Popen | None, str]:
        """Hand local_rank's warm worker its start message: (the process, "" or "still importing"),
        or (None, why not). `cpus`: bind the worker to these before it runs the script (--numa-binding)."""
        with self._lock:
            warm = self._idle.pop(local_rank, None)
        if warm is None:
            return None, "no warm worker ready"
        final = {**self._environ, **env}
        why = self._refusal(warm, entrypoint, tuple(str(a) for a in args), final)
        if why is None:
            message = json.dumps({"env": final, "stdout": stdout, "stderr": stderr,
                                  "argv": list(warm.cold_args[4:]),
                                  "cpus": sorted(cpus) if cpus is not None else None}).encode()
            try:
                if len(message) > fcntl.fcntl(warm.write_fd, fcntl.F_GETPIPE_SZ):
                    why = "the start message does not fit in the pipe"
                else:
                    _write_all(warm.write_fd, message)
            except OSError as exc:
                why = f"cannot hand over the start message ({exc.strerror or exc})"
        if why is not None:
            _discard(warm)
            return None, why
        os.close(warm.write_fd)
        return warm.proc, "" if warm.ready.is_set() else "still importing"

    def close(self) -> None:
        """Stop every idle warm worker (started workers belong to their PContext)."""
        with self._wake:
            self._closed = True
            idle, self._idle = list(self._idle.values()), {}
            self._wake.notify_all()
        for warm in idle:
            _discard(warm)

    # ---- the spawning thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        # Never returns while the agent lives: the warm workers' death signal is tied to this thread.
        while True:
            with self._wake:
                while self._closed or self._request is None or self._request[0] == self._done:
                    self._wake.wait()
                generation, ready = self._request
            deadline = self._clock() + self.refill_wait_s
            while ready is not None and self._clock() < deadline and not self._superseded(generation):
                try:
                    if ready():
                        break
                except Exception:  # a reader error must not stop the pool: refill at the deadline
                    pass
                time.sleep(0.1)
            if self._superseded(generation):
                continue
            self._spawn_missing()
            with self._lock:
                self._done = generation

    def _superseded(self, generation: int) -> bool:
        with self._lock:
            return self._closed or self._generation != generation

    def _spawn_missing(self) -> None:
        batch: dict[int, tuple[_Warm, int]] = {}
        for rank in range(self.nproc):
            with self._lock:
                current = self._idle.get(rank)
                if self._closed or (current is not None and current.proc.poll() is None):
                    continue
                self._idle.pop(rank, None)
            if current is not None:
                _discard(current)
            spawned = self._spawn(rank)
            if spawned is not None:
                batch[rank] = spawned
        if batch:
            threading.Thread(target=self._watch, args=(batch,), name="elastic-rt-warm-ready", daemon=True).start()

    def _spawn(self, rank: int) -> tuple[_Warm, int] | None:
        cold_args = tuple(str(a) for a in self._args_for_rank(rank))
        env = warm_environment({**self._environ, **self._env_for_rank(rank)}, os.getpid())
        read_fd, write_fd = os.pipe()
        ready_r, ready_w = os.pipe()
        try:
            try:
                fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:
                pass  # the default 64 KiB; take() checks the message fits
            cmd = warm_command(self.entrypoint, cold_args, fd=read_fd, ready_fd=ready_w, nice=self.nice,
                               imports=self.imports)
            if cmd is None:
                raise OSError(f"not a worker entry point command: {' '.join(cold_args[:4])}")
            proc = subprocess.Popen(cmd, env=env, pass_fds=(read_fd, ready_w), start_new_session=True)
        except OSError as exc:
            os.close(write_fd)
            os.close(ready_r)
            log.warning("%s warm worker for local rank %d not started: %s", self.log_prefix(), rank, exc)
            return None
        finally:
            os.close(read_fd)
            os.close(ready_w)
        warm = _Warm(proc=proc, write_fd=write_fd, env=env, entrypoint=self.entrypoint, cold_args=cold_args,
                     started_at=self._clock(), ready=threading.Event())
        with self._lock:
            closed = self._closed
            if not closed:
                self._idle[rank] = warm
                self.spawned += 1
        if closed:
            _discard(warm)
        return warm, ready_r

    def _watch(self, batch: dict[int, tuple[_Warm, int]]) -> None:
        """Mark each warm worker ready when it says so; one log line when the whole batch is."""
        waiting = {fd: (rank, warm) for rank, (warm, fd) in batch.items()}
        ready: list[int] = []
        while waiting:
            readable, _, _ = select.select(list(waiting), [], [])
            for fd in readable:
                rank, warm = waiting.pop(fd)
                try:
                    ok = os.read(fd, 1) == b"R"
                except OSError:
                    ok = False
                os.close(fd)
                if ok:
                    warm.ready.set()
                    with self._lock:
                        if self._idle.get(rank) is warm:  # not already started as a worker
                            ready.append(rank)
        if ready:
            took = max(self._clock() - batch[r][0].started_at for r in ready)
            log.info("%s warm workers ready for local rank(s) %s (imports took %.1f s)", self.log_prefix(),
                     ",".join(map(str, sorted(ready))), took)

    @staticmethod
    def _refusal(warm: _Warm, entrypoint: str, args: tuple[str, ...], final: Mapping[str, str]) -> str | None:
        code = warm.proc.poll()
        if code is not None:
            return f"the warm worker exited (code {code}) before its start"
        if entrypoint != warm.entrypoint or args != warm.cold_args:
            return "the worker command differs from the warm worker's"
        return incompatibility(warm.env, final)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _discard(warm: _Warm) -> None:
    """SIGKILL an unused warm worker (its process group) and reap it."""
    try:
        os.close(warm.write_fd)
    except OSError:
        pass
    try:
        os.killpg(warm.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        warm.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.error("warm worker %d did not die after SIGKILL", warm.proc.pid)


def make_warm_pool(settings: WarmSettings, *, node: str, entrypoint: str, args: Sequence[str], nproc: int,
                   no_python: bool, virtual_local_rank: bool) -> WarmPool | None:
    """This node's warm-worker pool, or None (--warm-workers off; --no-python: one log line). `args` may hold
    torch's ${local_rank} macro, substituted per rank."""
    from torch.distributed.elastic.utils import macros

    if not settings.enabled:
        return None
    if no_python:
        log.info("[%s] warm workers off: --no-python runs an executable the agent cannot start ahead", node)
        return None
    environ = dict(os.environ)
    return WarmPool(entrypoint=entrypoint, nproc=nproc, imports=settings.imports,
                    args_for_rank=lambda rank: macros.substitute(list(args), str(rank)),
                    env_for_rank=(lambda rank: virtual_local_rank_env(rank, environ)) if virtual_local_rank
                    else (lambda rank: {}))
