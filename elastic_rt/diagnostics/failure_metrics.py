"""Why workers failed, as Prometheus metrics (FAILURES: failures by cause, hangs by the rank that stopped
first, collective backend errors) as MetricSpecs, recorded by failure_diagnostics."""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry

from elastic_rt.decisions import COLLECTIVE_ERROR_KINDS, FailureCause
from elastic_rt.metric_spec import Kind, MetricSpec

FAILURE_CAUSES: tuple[FailureCause, ...] = tuple(FailureCause)


FAILURES = (
    MetricSpec(name="elastic_rt_worker_failures_total", kind=Kind.COUNTER, labels=("cause",),
               help="Worker failures by cause (see docs/failures.md).",
               doc="Worker failures by cause: `cause` is one of the [failure causes](#failure-causes) "
                   "([failures.md](failures.md)). Exported at 0 for every cause.",
               zeros=tuple((c.value,) for c in FAILURE_CAUSES)),
    MetricSpec(name="elastic_rt_last_worker_failure_timestamp_seconds", kind=Kind.GAUGE, labels=("cause",),
               help="Unix time of the last worker failure of this node with the cause (absent before the first).",
               doc="Unix time of this node's last worker failure with the cause; absent before the first."),
    MetricSpec(name="elastic_rt_hangs_total", kind=Kind.COUNTER, labels=("local_rank", "process_state"),
               help="Hang restarts, by the local rank that stopped progressing first and its process state "
                    "(psutil: stopped, disk-sleep, sleeping, running).",
               doc="Hang restarts, by the local rank that stopped progressing first and its psutil process "
                   "state (`stopped`, `disk-sleep`, `sleeping`, `running`, ...)."),
    MetricSpec(name="elastic_rt_collective_errors_total", kind=Kind.COUNTER, labels=("backend", "kind"),
               help="Collective backend errors seen in failed workers (NCCL watchdog timeouts, communicator "
                    "aborts, gloo timeouts and closed peers).",
               doc="Collective backend errors in failed workers' messages: `nccl` `timeout` (watchdog), `abort` "
                   "(communicator aborted), `error`; `gloo` `timeout`, `peer_closed`; `c10d` `timeout`.",
               zeros=COLLECTIVE_ERROR_KINDS),
)


class FailureMetrics:
    """Worker failures by cause, hangs by the rank that stopped first, collective backend errors."""

    def __init__(self, *, registry: CollectorRegistry, run_id: str, node: str,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._base = (run_id, node)
        self._wall_clock = wall_clock
        self.failures, self.last_failure, self.hangs, self.collective_errors = (
            spec.build(registry, run_id=run_id, node=node) for spec in FAILURES)

    def on_failure(self, cause: FailureCause, collective: tuple[str, str] | None = None) -> None:
        if cause not in FAILURE_CAUSES:
            raise ValueError(f"unknown failure cause {str(cause)!r}; expected one of {', '.join(FAILURE_CAUSES)}")
        self._count(cause)
        if collective is not None:
            self.collective_errors.labels(*self._base, *collective).inc()

    def on_hang(self, local_rank: int, process_state: str) -> None:
        self._count(FailureCause.HANG)
        self.hangs.labels(*self._base, str(local_rank), process_state).inc()

    def _count(self, cause: FailureCause) -> None:
        self.failures.labels(*self._base, cause).inc()
        self.last_failure.labels(*self._base, cause).set(self._wall_clock())
