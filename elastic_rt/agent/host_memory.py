"""The node's shared-memory directory for checkpoint copies (elastic_rt/checkpoint/host_cache.py):
created by the agent, handed to its workers, removed when it exits; those of dead agents cleaned."""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass

import psutil

from elastic_rt.agent.config import AgentConfig
from elastic_rt.sections import on_off, option, positive
from elastic_rt.worker_env import ENV_HOST_CACHE_DIR

log = logging.getLogger(__name__)

HOST_CACHE_PREFIX = "elastic-rt-"
HOST_CACHE_OWNER = ".owner"  # "<agent pid> <its start time>": a directory whose agent is gone is stale


def _gib(value: float | None) -> int | None:
    return None if value is None else int(positive("--memory-tier-replica-gib")(value) * (1 << 30))


@dataclass(frozen=True, kw_only=True)
class HostMemorySettings:
    """Checkpoint copies in this node's shared memory: its own (--host-cache) and peers' replicas."""

    host_cache: bool = option(
        "--host-cache", default="on", choices=("on", "off"), parse=on_off,
        help="keep the last checkpoint's files of this node's workers in shared memory "
             "(/dev/shm/elastic-rt-RUN-NODE/, removed at exit) so that a restart here loads from memory; storage "
             "stays the truth (default on)")
    replica_bytes: int | None = option(
        "--memory-tier-replica-gib", type=float, default=None, parse=_gib,
        help="the most GiB of peers' snapshot replicas this node holds in shared memory (CheckpointManager "
             "memory_every; docs/checkpoint.md 'Tiers'; default: a quarter of /dev/shm)")  # None: a quarter


def make_host_cache(cfg: AgentConfig, node_id: str, shm_root: str = "/dev/shm") -> str | None:
    """This node's (empty) directory for checkpoint copies in shared memory, handed to the workers
    (elastic_rt/checkpoint/host_cache.py); None without shared memory or with --host-cache off.
    Directories left by agents that were SIGKILLed (any run) are removed first."""
    if not cfg.section(HostMemorySettings).host_cache or not os.path.isdir(shm_root):
        return None
    remove_stale_host_caches(shm_root)
    path = os.path.join(shm_root, re.sub(r"[^\w.-]", "_", f"{HOST_CACHE_PREFIX}{cfg.rdzv_id}-{node_id}"))
    try:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, mode=0o700)
        with open(os.path.join(path, HOST_CACHE_OWNER), "w") as f:
            f.write(_process_identity(os.getpid()))
    except OSError as exc:
        log.warning("[%s] no checkpoint copies in host memory: %s", node_id, exc)
        return None
    os.environ[ENV_HOST_CACHE_DIR] = path
    return path


def _process_identity(pid: int) -> str:
    return f"{pid} {psutil.Process(pid).create_time():.3f}"


def remove_stale_host_caches(shm_root: str) -> list[str]:
    """Remove the host-cache directories whose owning agent no longer runs: this user's, and every user's when run
    as root (an agent SIGKILLed under another account leaves its copy in shared memory for good otherwise).
    Only real directories are touched, never a symbolic link (a user's link would point root elsewhere)."""
    removed = []
    for name in os.listdir(shm_root):
        path = os.path.join(shm_root, name)
        try:
            st = os.lstat(path)
            if not name.startswith(HOST_CACHE_PREFIX) or not stat.S_ISDIR(st.st_mode):
                continue
            if os.getuid() != 0 and st.st_uid != os.getuid():
                continue
            with open(os.path.join(path, HOST_CACHE_OWNER)) as f:
                owner = f.read().strip()
            pid = int(owner.split()[0])
            alive = psutil.pid_exists(pid) and _process_identity(pid) == owner
        except (OSError, ValueError, IndexError, psutil.Error):
            continue  # not ours, or not an agent's directory
        if not alive:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class HostCacheRoom:
    """A round listener: before workers start again, the node's copy is dropped when the shared memory's free
    space is below the reserve (NCCL and DataLoaders need it more than a restart needs the copy)."""

    def __init__(self, path: str, *, reserve_bytes: int, node_id: str) -> None:
        self._path = path
        self._reserve_bytes = reserve_bytes
        self._node_id = node_id

    def on_round(self, **_: object) -> None:
        try:
            free = shutil.disk_usage(self._path).free
            if free >= self._reserve_bytes:
                return
            dropped = [n for n in os.listdir(self._path) if n != HOST_CACHE_OWNER]
            for name in dropped:
                target = os.path.join(self._path, name)
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    os.unlink(target)
        except OSError as exc:
            log.warning("[%s] could not check the checkpoint copy in host memory: %s", self._node_id, exc)
            return
        if dropped:
            from elastic_rt.checkpoint.host_cache import mib  # imports torch: only where a copy is dropped

            log.warning("[%s] shared memory has %s free, below the %s reserve: the checkpoint copy in %s "
                        "dropped before the workers start (they load from storage)", self._node_id, mib(free),
                        mib(self._reserve_bytes), self._path)


if __name__ == "__main__":  # `python -m elastic_rt.agent.host_memory`: the systemd unit's ExecStopPost
    for gone in remove_stale_host_caches("/dev/shm"):
        print(f"removed {gone}")
