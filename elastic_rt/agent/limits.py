"""The open-files limit the agent hands its workers: the rank-0 worker's TCPStore holds one socket per worker."""

from __future__ import annotations

import logging
import resource
from typing import Callable

log = logging.getLogger(__name__)

# Sockets and files a worker process holds besides the store's connections (CUDA, NCCL, data
# loaders, checkpoints): headroom on top of one connection per worker of the job.
HEADROOM = 1024
# Never raise the soft limit past this: the point is to fit the job, not to unlimit the host.
CAP = 1 << 20


def needed_open_files(*, max_nodes: int, nproc_per_node: int) -> int:
    """Descriptors the rank-0 worker needs at the job's largest size: one store connection per worker."""
    return max_nodes * nproc_per_node + HEADROOM


def raise_open_files_limit(
    needed: int, *,
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
    setrlimit: Callable[[int, tuple[int, int]], None] = resource.setrlimit,
) -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE (inherited by the workers it starts) to
    min(hard, max(needed, soft), CAP) when the soft limit is lower than `needed`; never lowers it,
    never touches the hard limit. Returns (old soft, new soft). A hard limit below `needed` is
    logged with the fix (`ulimit -n` / LimitNOFILE=); the job still starts, as torchrun's would.
    """
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft, soft
    ceiling = CAP if hard == resource.RLIM_INFINITY else min(hard, CAP)
    target = max(soft, min(needed, ceiling))
    if target > soft:
        try:
            setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
            return soft, soft
        log.info("open-files limit raised from %d to %d for the workers' TCPStore (%d needed)",
                 soft, target, needed)
    if target < needed:
        log.warning("open-files limit is %d (hard %d) but the rank-0 worker's TCPStore may need %d "
                    "connections at --nnodes MAX; raise it (ulimit -n %d, systemd LimitNOFILE=, "
                    "Kubernetes: the container runtime's nofile)", target, hard, needed, needed)
    return soft, target
