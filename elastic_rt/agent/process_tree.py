"""Stop worker process trees completely: signal, grace period, SIGKILL; grandchildren included."""

from __future__ import annotations

import logging
import signal
from typing import Callable, Iterable

import psutil

log = logging.getLogger(__name__)


def collect_tree(roots: Iterable[int | psutil.Process]) -> list[psutil.Process]:
    """Every live process under (and including) the given roots (pids or psutil.Process).

    A psutil.Process keeps its identity (pid and create time): once it has exited, its pid
    reused by an unrelated process is not it, and nothing is found under it.
    """
    procs: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            proc = root if isinstance(root, psutil.Process) else psutil.Process(root)
            found = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:  # exited (or its pid is someone else's now): nothing to stop
            continue
        for p in found:
            procs.setdefault(p.pid, p)
    return list(procs.values())


def _send(procs: Iterable[psutil.Process], sig: int) -> list[int]:
    """Signal each process through its psutil.Process (which refuses a reused pid)."""
    sent = []
    for p in procs:
        try:
            p.send_signal(sig)
            sent.append(p.pid)
        except psutil.NoSuchProcess:  # exited meanwhile: nothing to stop
            continue
    return sent


def kill_tree(roots: Iterable[int | psutil.Process]) -> list[int]:
    """SIGKILL every process of the trees at once, and reap none of them: the caller still
    collects its children's exit codes (psutil's wait would reap them and lose the codes)."""
    return _send(collect_tree(roots), signal.SIGKILL)


def stop_tree(roots: Iterable[int | psutil.Process], *, sig: int = signal.SIGTERM, grace_s: float = 30.0,
              before_kill: Callable[[list[int]], object] | None = None) -> list[int]:
    """Send `sig` to every process of the trees, SIGKILL what is left after grace_s.
    before_kill(pids) is called with the roots still alive when the grace period ran out.

    The trees are captured once, before the first signal, so children that a dying parent
    leaves behind (re-parented to init) are still found and killed. Every later signal goes
    through the psutil.Process objects of that capture, never through a pid looked up again:
    a worker reaped during the grace period frees its pid, and a new process may get it.
    Returns the pids that had to be SIGKILLed.
    """
    roots = list(roots)
    root_pids = {r.pid if isinstance(r, psutil.Process) else r for r in roots}
    procs = collect_tree(roots)
    _send(procs, sig)
    _, alive = psutil.wait_procs(procs, timeout=grace_s) if grace_s > 0 else ([], procs)
    if before_kill is not None and grace_s > 0 and sig != signal.SIGKILL:
        survivors = [p.pid for p in alive if p.pid in root_pids]
        if survivors:
            try:
                before_kill(survivors)
            except Exception as exc:  # diagnostics must never keep a process from being stopped
                log.warning("collecting the stacks of processes that outlived SIGTERM failed: %s", exc)
    # Children started during the grace period (e.g. a DataLoader respawning workers), found
    # under the processes of the first capture that are still alive.
    left = collect_tree(alive)
    killed = _send(left, signal.SIGKILL)
    _, still = psutil.wait_procs(left, timeout=10)
    for p in still:
        log.error("process %d did not die after SIGKILL (uninterruptible sleep?)", p.pid)
    return killed
