"""When a scale-up restarts the group: not while a node's warm workers are still on their way.

A node waiting to join makes every running node restart its workers (the scale-up). The workers a
restart starts are the pool's warm ones; right after a restart (a node lost, the group re-formed
smaller) those are still importing, and a scale-up then would stop a training group to wait for
imports. So a running node holds the scale-up while its pool is warming (a refill requested or a
warm worker importing), for at most `max_wait_s` from the moment it first saw the waiting node; the
group trains meanwhile. Every other reason to restart (a lost peer, a failed worker, a hang, a new
round) acts at once, and a held scale-up is taken as soon as the pool is ready.

The joining node does the same from its side (join_when_warm): when the job is already running, it
asks for a place only once its own warm workers have imported (at most `max_wait_s`), so that the
restart it causes does not wait for its imports either.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

log = logging.getLogger(__name__)

SCALE_UP_WAIT_S = 60.0


class Warming(Protocol):
    def warming(self) -> bool: ...


class ScaleUpGate:
    """Whether this node holds a scale-up now; see the module docstring."""

    def __init__(self, pool: Warming | None, *, max_wait_s: float = SCALE_UP_WAIT_S,
                 clock: Callable[[], float] = time.monotonic, log_prefix: Callable[[], str] = lambda: "") -> None:
        self._pool, self.max_wait_s, self._clock, self._prefix = pool, max_wait_s, clock, log_prefix
        self._seen_at: float | None = None  # when this node first held the pending scale-up

    def hold(self) -> bool:
        """Called while a node waits to join: True to let the group train on for now."""
        if self._pool is None or self.max_wait_s <= 0 or not self._pool.warming():
            self._done("warm workers ready")
            return False
        now = self._clock()
        if self._seen_at is None:
            self._seen_at = now
            log.info("%s a node waits to join: the scale-up waits for this node's warm workers to import "
                     "(at most %.0f s); training goes on", self._prefix(), self.max_wait_s)
        if now - self._seen_at < self.max_wait_s:
            return True
        self._done(f"still importing after {self.max_wait_s:.0f} s")
        return False

    def _done(self, why: str) -> None:
        if self._seen_at is not None:
            log.info("%s scale-up after %.1f s held: %s", self._prefix(), self._clock() - self._seen_at, why)
        self._seen_at = None

    def reset(self) -> None:
        """The group restarted (for any reason): a later waiting node is a new scale-up."""
        self._seen_at = None


def join_when_warm(pool: Warming | None, *, running: Callable[[], bool], max_wait_s: float = SCALE_UP_WAIT_S,
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                   log_prefix: Callable[[], str] = lambda: "") -> float:
    """Before a node's first rendezvous: while the job runs without it (`running()`) and its warm workers are
    on their way, wait for them, at most max_wait_s. Returns the seconds waited."""
    if pool is None or max_wait_s <= 0 or not pool.warming() or not running():
        return 0.0
    started = clock()
    log.info("%s the job is running: this node asks to join once its warm workers have imported (at most %.0f s)",
             log_prefix(), max_wait_s)
    while pool.warming() and clock() - started < max_wait_s:
        sleep(0.2)
    waited = clock() - started
    log.info("%s joining after %.1f s: %s", log_prefix(), waited,
             "warm workers ready" if not pool.warming() else f"still importing after {max_wait_s:.0f} s")
    return waited
