"""The node's shared-memory directory for checkpoint copies (elastic_rt/checkpoint/host_cache.py):
created by the agent, handed to its workers, removed when it exits; those of dead agents cleaned."""

from __future__ import annotations

import logging
import os
import re
import shutil

import psutil

from elastic_rt.agent.config import AgentConfig
from elastic_rt.worker_env import ENV_HOST_CACHE_DIR

log = logging.getLogger(__name__)

HOST_CACHE_PREFIX = "elastic-rt-"
HOST_CACHE_OWNER = ".owner"  # "<agent pid> <its start time>": a directory whose agent is gone is stale


def make_host_cache(cfg: AgentConfig, node_id: str, shm_root: str = "/dev/shm") -> str | None:
    """This node's (empty) directory for checkpoint copies in shared memory, handed to the workers
    (elastic_rt/checkpoint/host_cache.py); None without shared memory or with --host-cache off.
    Directories left by agents that were SIGKILLed (any run) are removed first."""
    if not cfg.host_cache or not os.path.isdir(shm_root):
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
    """Remove this user's host-cache directories whose owning agent no longer runs."""
    removed = []
    for name in os.listdir(shm_root):
        path = os.path.join(shm_root, name)
        try:
            if not name.startswith(HOST_CACHE_PREFIX) or os.stat(path).st_uid != os.getuid():
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
