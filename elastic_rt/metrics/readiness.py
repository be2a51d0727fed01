"""The node-fitness checks behind /readyz (collective probe, RDMA ports, clock, etcd), each built on the data
source it is given, so tests drive them with their own."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable, Mapping, Protocol

from elastic_rt.collectors.clock import SkewEstimate, skew_warning
from elastic_rt.collectors.rdma import PortReading, RdmaCollector
from elastic_rt.collectors.timex import TimexStatus, read_timex
from elastic_rt.checks.model import CheckResult, Status
from elastic_rt.checks.rdma import rdma_verdict

# torch's heartbeat-based liveness (backends other than etcd-v3) tolerates this much skew;
# the clock check fails at half of it, the same rule as the agent's skew warning.
CLOCK_SKEW_TOLERANCE_S = 15.0


class ProbeSource(Protocol):
    """What the probe check reads (elastic_rt.collectors.schedule.RoundChecks)."""

    round: int
    last_probe: object | None

    def probe_failure(self) -> str | None: ...


def probe_check(source: ProbeSource, *, enabled: bool = True) -> Callable[[], CheckResult]:
    """Fails while the current round's collective probe failed, with the probe's error."""

    def check() -> CheckResult:
        if not enabled:
            return CheckResult.of(True, "off (--probe-bytes 0)")
        failure = source.probe_failure()
        if failure:
            return CheckResult.of(False, f"round {source.round}: {failure}")
        last = source.last_probe
        if last is None:
            return CheckResult.of(True, "no probe yet (it runs after each rendezvous of 2 or more nodes)")
        return CheckResult.of(True, f"{last.backend} all-reduce of {last.nbytes} bytes over {last.world_size} nodes "
                                 f"in {last.latency_s * 1e3:.2f} ms")

    return check


def rdma_check(read_ports: Callable[[], Iterable[PortReading]], env: Mapping[str, str]) -> Callable[[], CheckResult]:
    """Fails while a port NCCL would use (NCCL_IB_HCA) is not ACTIVE: the RDMA-port rule of elastic_rt.checks.rdma,
    the doctor's and the ElasticRTRDMAPortDown alert's. Down ports under NCCL_IB_DISABLE=1, and unreadable
    states, are named but do not fail."""

    def check() -> CheckResult:
        ports = list(read_ports())
        verdict = rdma_verdict(ports, env)
        if verdict.status is Status.SKIP:
            return CheckResult.of(True, "no RDMA devices on this node")
        note = f"; {verdict.not_selected} not selected by NCCL_IB_HCA" if verdict.not_selected else ""
        if not verdict.used:
            return CheckResult(status=Status.WARN,
                               detail=f"NCCL_IB_HCA={env.get('NCCL_IB_HCA')} selects none of the {len(ports)} ports")
        named = verdict.down + verdict.unreadable
        if named:
            unused = ", unused: NCCL_IB_DISABLE=1" if verdict.down and verdict.ib_disabled else ""
            return CheckResult(status=verdict.status, detail=", ".join(_describe_port(p) for p in named)
                               + f" ({len(named)} of {len(verdict.used)} ports not active{unused}{note})")
        return CheckResult.of(True, f"{len(verdict.used)} port(s) active" + (f" ({note[2:]})" if note else ""))

    return check


def _describe_port(p: PortReading) -> str:
    state = f"{p.state[1]} (state {p.state[0]})" if p.state else "state unreadable"
    phys = f", physical {p.phys_state[1]}" if p.phys_state else ""
    return f"{p.device} port {p.port} is {state}{phys}"


def clock_check(skew: Callable[[], SkewEstimate | None], timex: Callable[[], TimexStatus] | None = None,
                *, tolerance_s: float = CLOCK_SKEW_TOLERANCE_S) -> Callable[[], CheckResult]:
    """Fails while this node's clock is off rank 0's by more than half of `tolerance_s`.

    The kernel's synchronization state is reported, not judged: many hosts run no NTP daemon
    the kernel knows of, and an unsynchronized clock that agrees with its peers harms nothing
    (the ElasticRTClockNotSynchronized alert reports it).
    """

    def check() -> CheckResult:
        parts = []
        est = skew()
        if est is not None:
            warning = skew_warning(est.offset_s, tolerance_s)
            if warning:
                return CheckResult.of(False, warning)
            parts.append(f"skew vs rank 0 {est.offset_s * 1e3:+.1f} ms" if est.samples else "rank 0 (the reference)")
        else:
            parts.append("no skew measured (rank 0 is the reference; the others measure after each rendezvous)")
        if timex is not None:
            try:
                st = timex()
            except Exception as exc:  # noqa: BLE001 - e.g. adjtimex denied by seccomp: report, do not fail
                parts.append(f"kernel state unreadable ({exc})")
            else:
                parts.append("kernel clock synchronized" if st.synchronized
                             else f"kernel clock not synchronized (max error {st.max_error_s:g} s)")
        return CheckResult.of(True, "; ".join(parts))

    return check


class EtcdReachability:
    """etcd reachability as the rendezvous reports it (observer.on_etcd); read by the etcd check."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._state: tuple[bool, float] | None = None  # (up, since)

    def on_etcd(self, up: bool) -> None:
        with self._lock:
            if self._state is None or self._state[0] != bool(up):
                self._state = (bool(up), self._clock())

    def status(self) -> tuple[bool, str]:
        """(ok, reason): unreachable fails; no report yet passes (the rendezvous retries on its own)."""
        state = self._state
        if state is None:
            return True, "no report from the rendezvous yet"
        up, since = state
        age = self._clock() - since
        if up:
            return True, f"reachable for {age:.0f} s"
        return False, (f"unreachable for {age:.0f} s; training goes on, membership changes wait until it is back")


def etcd_check(status: Callable[[], tuple[bool, str]]) -> Callable[[], CheckResult]:
    """Wraps any (ok, reason) source of etcd reachability."""

    def check() -> CheckResult:
        ok, reason = status()
        return CheckResult.of(bool(ok), reason)

    return check


def add_readiness_checks(readiness, round_checks, *, sysfs_root: str, probe_enabled: bool) -> None:
    """/readyz: this node's fitness for the job, each check on its own data source. (`etcd` is the
    observer's own, fed by on_etcd; /livez holds the monitor-loop check.)"""
    readiness.add("probe", probe_check(round_checks, enabled=probe_enabled))
    readiness.add("rdma", rdma_check(RdmaCollector(sysfs_root=sysfs_root).read_ports, os.environ))
    readiness.add("clock", clock_check(lambda: round_checks.last_skew, read_timex))
