"""etcd reachability as this node sees it: one log line per outage each way, listeners, and the outage
history the peer-loss grace rule reads; plus the jittered backoff every etcd retry here uses."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class Backoff:
    """Jittered exponential backoff: the n-th wait is drawn uniformly from [d/2, d], d = min(cap, base * 2^n).

    The jitter spreads a thousand agents that lost etcd at the same moment over half the
    interval, so a recovering etcd does not get their retries in lock step.
    """

    def __init__(self, *, base_s: float = 0.1, cap_s: float = 2.0, rng: Callable[[], float] = random.random) -> None:
        self._base_s = base_s
        self._cap_s = cap_s
        self._rng = rng
        self._n = 0

    @property
    def cap_s(self) -> float:
        return self._cap_s

    def next(self) -> float:
        d = min(self._cap_s, self._base_s * (2 ** min(self._n, 30)))
        self._n += 1
        return d * (0.5 + 0.5 * self._rng())

    def reset(self) -> None:
        self._n = 0


class EtcdHealth:
    """Up until a request fails; down until one succeeds. Listeners get every transition (metrics, readiness)."""

    def __init__(self, *, node_id: str, clock: Callable[[], float] = time.monotonic, history_s: float = 300.0) -> None:
        self._node_id = node_id
        self._clock = clock
        self._history_s = history_s
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._outages: list[tuple[float, float]] = []  # finished outages (start, end), recent ones only
        self._listeners: list[Callable[[bool], None]] = []

    def add_listener(self, fn: Callable[[bool], None]) -> None:
        """fn(up) on every transition, and once now with the current state."""
        with self._lock:
            self._listeners.append(fn)
            up = self._down_since is None
        self._notify([fn], up)

    @property
    def up(self) -> bool:
        with self._lock:
            return self._down_since is None

    def down_for_s(self) -> float:
        with self._lock:
            return 0.0 if self._down_since is None else self._clock() - self._down_since

    def failure(self, why: str) -> None:
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = self._clock()
            listeners = list(self._listeners)
        log.warning("node %s: etcd unreachable (%s); workers keep running, retrying with backoff",
                    self._node_id, why)
        self._notify(listeners, False)

    def success(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            now = self._clock()
            start, self._down_since = self._down_since, None
            self._outages = [o for o in self._outages if o[1] > now - self._history_s] + [(start, now)]
            listeners = list(self._listeners)
        log.warning("node %s: etcd reachable again after %.1f s", self._node_id, now - start)
        self._notify(listeners, True)

    def unreachable_since(self, t: float) -> bool:
        """Was etcd unreachable from here at any moment from monotonic time t until now?"""
        with self._lock:
            if self._down_since is not None:
                return True
            return any(end >= t for _, end in self._outages)

    def last_recovery(self) -> float | None:
        """When the latest finished outage ended (monotonic), or None."""
        with self._lock:
            return self._outages[-1][1] if self._outages else None

    @staticmethod
    def _notify(listeners: list[Callable[[bool], None]], up: bool) -> None:
        for fn in listeners:
            try:
                fn(up)
            except Exception as exc:  # noqa: BLE001 - a metrics hook must not stop the lease thread
                log.warning("etcd reachability listener failed: %s", exc)
