"""Stop worker process trees completely: signal, grace period, SIGKILL; grandchildren included."""

from __future__ import annotations

import logging
import signal
from typing import Callable

import psutil

log = logging.getLogger(__name__)


def collect_tree(root_pids: list[int]) -> list[psutil.Process]:
    """Every live process under (and including) the given roots."""
    procs: dict[int, psutil.Process] = {}
    for pid in root_pids:
        try:
            root = psutil.Process(pid)
            procs[pid] = root
            for child in root.children(recursive=True):
                procs[child.pid] = child
        except psutil.NoSuchProcess:
            continue
    return list(procs.values())


def stop_tree(root_pids: list[int], *, sig: int = signal.SIGTERM, grace_s: float = 30.0,
              before_kill: Callable[[list[int]], object] | None = None) -> list[int]:
    """Send `sig` to every process of the trees, SIGKILL what is left after grace_s.
    before_kill(pids) is called with the roots still alive when the grace period ran out.

    The tree is captured before the first signal, so children that a dying
    parent leaves behind (re-parented to init) are still found and killed.
    Returns the pids that had to be SIGKILLed.
    """
    procs = collect_tree(root_pids)
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s) if grace_s > 0 else ([], procs)
    if before_kill is not None and grace_s > 0 and sig != signal.SIGKILL:
        survivors = [p.pid for p in alive if p.pid in root_pids]
        if survivors:
            try:
                before_kill(survivors)
            except Exception as exc:  # diagnostics must never keep a process from being stopped
                log.warning("collecting the stacks of processes that outlived SIGTERM failed: %s", exc)
    # Children started during the grace period (e.g. a DataLoader respawning workers).
    alive = {p.pid: p for p in alive}
    for p in collect_tree(list(alive) + list(root_pids)):
        alive.setdefault(p.pid, p)
    killed = []
    for p in alive.values():
        try:
            p.kill()
            killed.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(list(alive.values()), timeout=10)
    for p in still:
        log.error("process %d did not die after SIGKILL (uninterruptible sleep?)", p.pid)
    return killed
