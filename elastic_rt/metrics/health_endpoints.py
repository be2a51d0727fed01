"""Named health checks behind /livez and /readyz: a small registry, its Kubernetes-style answers, and the
agent's liveness (its monitor loop ticks). Checks only report; nothing here decides what the agent does."""

from __future__ import annotations

import re
import threading
import time
from typing import Callable, Iterable, Sequence

from elastic_rt.checks.model import Check, CheckResult, run_check
from elastic_rt.decisions import RestartReason

LIVENESS = "liveness"
READINESS = "readiness"
ENDPOINTS = {LIVENESS: "livez", READINESS: "readyz"}

# /livez fails when the monitor loop, while workers run, has not ticked for this long:
# max(LIVENESS_MIN_S, LIVENESS_INTERVALS x --monitor-interval). One tick checks the workers,
# membership and the restart policy, all local and sub-millisecond; 30 s without one is a
# wedged agent on any machine, and a few hundred missed ticks on a slow --monitor-interval too.
LIVENESS_MIN_S = 30.0
LIVENESS_INTERVALS = 50

_NAME = re.compile(r"[a-z][a-z0-9_]*")
REASON_MAX_CHARS = 300


def _run_one(name: str, check: Check) -> CheckResult:
    """A broken check fails itself, never the endpoint; every reason is one bounded line."""
    return run_check(name, check, limit=REASON_MAX_CHARS, raised_prefix="check raised ")


class HealthChecks:
    """The named checks of one endpoint, run in the order added, at every request and scrape."""

    def __init__(self, kind: str, checks: Iterable[tuple[str, Check]] = ()) -> None:
        if kind not in ENDPOINTS:
            raise ValueError(f"unknown health check kind {kind!r}; expected one of {sorted(ENDPOINTS)}")
        self.kind = kind
        self._checks: dict[str, Check] = {}
        self._lock = threading.Lock()
        for name, check in checks:
            self.add(name, check)

    @property
    def endpoint(self) -> str:
        return ENDPOINTS[self.kind]

    def add(self, name: str, check: Check) -> None:
        if not _NAME.fullmatch(name):
            raise ValueError(f"health check name {name!r}: use lower case letters, digits and _")
        with self._lock:
            if name in self._checks:
                raise ValueError(f"health check {name!r} is already registered for /{self.endpoint}")
            self._checks[name] = check

    def names(self) -> list[str]:
        with self._lock:
            return list(self._checks)

    def run(self, *, only: str | None = None, exclude: Iterable[str] = ()) -> list[tuple[str, CheckResult]]:
        """(name, result) of every check, or of `only`; excluded names are skipped."""
        with self._lock:
            checks = list(self._checks.items())
        skip = set(exclude)
        return [(n, _run_one(n, c)) for n, c in checks if (only is None or n == only) and n not in skip]


def render(endpoint: str, results: Sequence[tuple[str, CheckResult]], *, verbose: bool) -> tuple[int, str]:
    """(HTTP status, body) in the format of Kubernetes' own /livez and /readyz.

    200 `ok`, or 503 naming each failing check and its reason on one line; with ?verbose a line
    per check (`[+]name ok: reason`, `[-]name failed: reason`) and a verdict line.
    """
    failed = [(n, r) for n, r in results if not r.ok]
    status = 503 if failed else 200
    if verbose:
        lines = [f"[{'+' if r.ok else '-'}]{n} {'ok' if r.ok else 'failed'}: {r.detail}" for n, r in results]
        lines.append(f"{endpoint} check {'failed' if failed else 'passed'}")
        return status, "\n".join(lines) + "\n"
    if not failed:
        return status, "ok\n"
    return status, "; ".join(f"{n} failed: {r.detail}" for n, r in failed) + "\n"


def liveness_threshold_s(monitor_interval_s: float) -> float:
    """How long the monitor loop may go without a tick while workers run, before /livez fails."""
    return max(LIVENESS_MIN_S, LIVENESS_INTERVALS * monitor_interval_s)


class MonitorLiveness:
    """Whether the agent's monitor loop is alive, from the events the agent reports.

    The loop ticks (observer.on_tick) every --monitor-interval while the workers run. It does not
    tick while the agent joins a rendezvous, restarts the group or waits at the exit barrier:
    those block by design (waiting for nodes is not a wedged agent) and each ends within its own
    timeout (join_timeout, the stop grace period, the exit barrier's 300 s), after which the agent
    exits. So only the running phase has a tick deadline; the others are reported with their age.
    """

    def __init__(self, *, threshold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if threshold_s <= 0:
            raise ValueError(f"liveness threshold must be > 0 s, got {threshold_s!r}")
        self.threshold_s = threshold_s
        self._clock = clock
        self._phase: tuple[str, float] = ("joining the rendezvous", clock())  # (what, since)
        self._last_tick: float | None = None

    # ---- what the agent reports (through MetricsObserver) ---------------------------
    def on_tick(self) -> None:
        self._last_tick = self._clock()

    def on_workers_started(self) -> None:
        self._phase = ("running", self._clock())

    def on_restart(self, reason: RestartReason) -> None:
        self._phase = (f"restarting the workers ({RestartReason(reason).words})", self._clock())

    def on_workers_finished(self, state: str) -> None:
        self._phase = (f"workers {state}; waiting for the other nodes", self._clock())

    # ---- what /livez and the metrics read -------------------------------------------
    def last_tick_age_s(self) -> float | None:
        """Seconds since the monitor loop last ticked; None before the first tick."""
        last = self._last_tick
        return None if last is None else max(0.0, self._clock() - last)

    def check(self) -> CheckResult:
        (phase, since), last, now = self._phase, self._last_tick, self._clock()
        if phase != "running":
            return CheckResult.of(True, f"{phase} for {now - since:.0f} s")
        ticked = last is not None and last >= since
        age = now - (last if ticked else since)
        if age > self.threshold_s:
            what = "last ticked" if ticked else "has not ticked since the workers started,"
            return CheckResult.of(False, f"monitor loop {what} {age:.1f} s ago (limit {self.threshold_s:g} s): "
                                      "the agent is wedged")
        if not ticked:
            return CheckResult.of(True, f"workers started {age:.1f} s ago")
        return CheckResult.of(True, f"monitor loop ticked {age:.1f} s ago")
