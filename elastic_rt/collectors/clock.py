"""Clock health: skew estimation against a peer, skew warnings, and clock metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry

from elastic_rt.errors import ConfigError, HealthCheckError
from elastic_rt.metric_spec import Kind, MetricSpec
from elastic_rt.collectors.sntp import NtpResult, query as ntp_query
from elastic_rt.collectors.timex import TimexCollector, TimexStatus, read_timex

__all__ = [
    "ClockMetrics",
    "NtpResult",
    "SkewEstimate",
    "SkewSample",
    "TimexCollector",
    "TimexStatus",
    "estimate_skew",
    "measure_skew",
    "ntp_query",
    "read_timex",
    "skew_warning",
]


@dataclass(frozen=True, kw_only=True)
class SkewSample:
    """One probe of a peer clock: our send time, the peer's time, our receive time."""

    t_send_local: float
    t_remote: float
    t_recv_local: float

    @property
    def round_trip_s(self) -> float:
        return self.t_recv_local - self.t_send_local

    @property
    def offset_s(self) -> float:
        # The peer read its clock, on average, halfway through the round trip.
        return self.t_remote - (self.t_send_local + self.t_recv_local) / 2.0


@dataclass(frozen=True, kw_only=True)
class SkewEstimate:
    """Peer clock minus local clock; the true value lies within +/- error_bound_s."""

    offset_s: float
    round_trip_s: float
    error_bound_s: float
    samples: int


def estimate_skew(samples: Iterable[SkewSample | tuple[float, float, float]]) -> SkewEstimate:
    """NTP-style: keep the sample with the smallest round trip (least queuing delay).

    Samples with a negative round trip (the local clock stepped back mid-probe) are
    dropped. Raises HealthCheckError when no usable sample remains.
    """
    usable: list[SkewSample] = []
    for s in samples:
        sample = s if isinstance(s, SkewSample) else SkewSample(t_send_local=s[0], t_remote=s[1], t_recv_local=s[2])
        if sample.round_trip_s >= 0:
            usable.append(sample)
    if not usable:
        raise HealthCheckError("clock skew: no usable sample (none given, or the local clock went backwards)")
    best = min(usable, key=lambda x: x.round_trip_s)
    return SkewEstimate(
        offset_s=best.offset_s,
        round_trip_s=best.round_trip_s,
        error_bound_s=best.round_trip_s / 2.0,
        samples=len(usable),
    )


def measure_skew(
    read_remote: Callable[[int], float],
    *,
    samples: int = 8,
    clock: Callable[[], float] = time.time,
) -> SkewEstimate:
    """Probe a peer clock `samples` times; read_remote(k) returns the peer's wall time for probe k.

    Wire read_remote to whatever reaches the peer (collectors/skew.py: rendezvous store keys
    that rank 0 answers). Both clocks must be wall clocks (Unix seconds).
    """
    if samples < 1:
        raise ConfigError(f"skew probe needs at least 1 sample, got {samples}")
    probes = []
    for k in range(samples):
        t1 = clock()
        remote = read_remote(k)
        t2 = clock()
        probes.append(SkewSample(t_send_local=t1, t_remote=remote, t_recv_local=t2))
    return estimate_skew(probes)


def skew_warning(
    skew_s: float,
    tolerance_s: float,
    *,
    fraction: float = 0.5,
    what: str = "clock skew vs rank 0",
) -> str | None:
    """A one-line warning when |skew_s| exceeds `fraction` of `tolerance_s`, else None."""
    if tolerance_s <= 0:
        raise ConfigError(f"skew tolerance must be > 0 s, got {tolerance_s!r}")
    if abs(skew_s) <= fraction * tolerance_s:
        return None
    pct = 100.0 * abs(skew_s) / tolerance_s
    verdict = "exceeds" if abs(skew_s) > tolerance_s else "is approaching"
    return (
        f"{what} is {skew_s:+.3f} s, {pct:.0f}% of the {tolerance_s:g} s tolerance ({verdict} it); "
        "synchronize clocks (chrony/ntpd) on this node"
    )


CLOCK = (
    MetricSpec(name="elastic_rt_clock_ntp_offset_seconds", kind=Kind.GAUGE, labels=("server",),
               help="NTP server clock minus local clock, from the last successful SNTP query.",
               doc="NTP server clock minus this node's clock, from the last successful SNTP query (positive: the "
                   "server is ahead)."),
    MetricSpec(name="elastic_rt_clock_ntp_round_trip_seconds", kind=Kind.GAUGE, labels=("server",),
               help="Round trip of the last successful SNTP query.",
               doc="Round trip of that query; the offset is exact to within half of it."),
    MetricSpec(name="elastic_rt_clock_ntp_query_failures_total", kind=Kind.COUNTER, labels=("server",),
               help="SNTP queries that timed out or got an unusable answer.",
               doc="SNTP queries that timed out or got an unusable reply."),
    MetricSpec(name="elastic_rt_clock_skew_seconds", kind=Kind.GAUGE,
               help="Rank 0's clock minus this node's clock, estimated over the rendezvous store.",
               doc="Rank 0's node clock minus this node's clock, estimated over the rendezvous store "
                   "(smallest-round-trip sample)."),
    MetricSpec(name="elastic_rt_clock_skew_error_bound_seconds", kind=Kind.GAUGE,
               help="Half the round trip of the probe behind elastic_rt_clock_skew_seconds.",
               doc="Half the round trip of the sample behind `elastic_rt_clock_skew_seconds`."),
)


class ClockMetrics:
    """Gauges for NTP queries and peer skew (CLOCK), plus the timex collector, in one registry."""

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        run_id: str,
        node: str,
        timex_reader: Callable[[], TimexStatus] | None = read_timex,
    ) -> None:
        self._base = (run_id, node)
        self.ntp_offset, self.ntp_round_trip, self.ntp_failures, self.skew, self.skew_error = (
            spec.build(registry, run_id=run_id, node=node) for spec in CLOCK)
        if timex_reader is not None:
            registry.register(TimexCollector(reader=timex_reader, const_labels={"run_id": run_id, "node": node}))

    def on_ntp(self, result: NtpResult) -> None:
        self.ntp_offset.labels(*self._base, result.server).set(result.offset_s)
        self.ntp_round_trip.labels(*self._base, result.server).set(result.round_trip_s)

    def on_ntp_failure(self, server: str) -> None:
        self.ntp_failures.labels(*self._base, server).inc()

    def on_skew(self, estimate: SkewEstimate) -> None:
        self.skew.labels(*self._base).set(estimate.offset_s)
        self.skew_error.labels(*self._base).set(estimate.error_bound_s)
