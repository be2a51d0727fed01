"""The agent's observer: records what the agent reports (rounds, restarts, workers, checkpoints, monitor ticks,
etcd reachability) as Prometheus metrics and health checks, and serves them. It decides nothing; restart
decisions live in elastic_rt.agent.policy."""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping

from prometheus_client import CollectorRegistry

from elastic_rt.decisions import RestartReason
from elastic_rt.errors import ElasticRTError
from elastic_rt.interfaces import AgentObserver
from elastic_rt.metrics.definitions import AgentMetrics, HealthCollector
from elastic_rt.metrics.exporter import MetricsExporter
from elastic_rt.metrics.health_endpoints import LIVENESS, LIVENESS_MIN_S, READINESS, HealthChecks, MonitorLiveness
from elastic_rt.metrics.readiness import EtcdReachability, etcd_check
from elastic_rt.worker_reports.heartbeat import Heartbeat
from elastic_rt.worker_reports.inbox import WorkerReports

log = logging.getLogger(__name__)


class MetricsObserver(AgentObserver):
    """An AgentObserver that exports everything the agent sees.

    Health: `liveness` holds the check `monitor` (the monitor loop ticks, see MonitorLiveness);
    `readiness` holds `etcd` (fed by on_etcd) and whatever the launcher adds (probe, rdma, clock).
    Both are served at /livez and /readyz and exported as elastic_rt_health_check.
    """

    def __init__(self, *, run_id: str, node: str, reports: WorkerReports, sysfs_root: str | None = "/sys",
                 registry: CollectorRegistry | None = None, liveness_threshold_s: float = LIVENESS_MIN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry or CollectorRegistry()
        self._reports = reports
        self._pids: dict[int, int] = {}
        self.metrics = AgentMetrics(
            registry=self.registry, run_id=run_id, node=node,
            worker_pids=lambda: dict(self._pids), heartbeats=self._heartbeats, sysfs_root=sysfs_root,
        )
        self.monitor = MonitorLiveness(threshold_s=liveness_threshold_s, clock=clock)
        self.etcd = EtcdReachability(clock=clock)
        self.liveness = HealthChecks(LIVENESS, [("monitor", self.monitor.check)])
        self.readiness = HealthChecks(READINESS, [("etcd", etcd_check(self.etcd.status))])
        self.registry.register(HealthCollector(run_id=run_id, node=node, results=self._health_results,
                                               last_tick_age_s=self.monitor.last_tick_age_s))
        self._exporter: MetricsExporter | None = None

    def _heartbeats(self) -> Mapping[int, Heartbeat | None]:
        return self._reports.heartbeats()

    def _health_results(self):
        for checks in (self.liveness, self.readiness):
            for name, result in checks.run():
                yield checks.kind, name, result.ok

    # ---- exporter -----------------------------------------------------------
    def serve(self, host: str, port: int) -> int | None:
        """Start /metrics, /livez, /readyz (and /healthz); a port in use is logged and the agent goes on
        without. Returns the bound port."""
        if port == 0:
            return None
        exporter = MetricsExporter(registry=self.registry, liveness=self.liveness, readiness=self.readiness,
                                   host=host, port=port)
        try:
            exporter.start()
        except ElasticRTError as exc:
            log.warning("%s; continuing without the metrics server", exc)
            return None
        self._exporter = exporter
        return exporter.port

    def close(self) -> None:
        if self._exporter is not None:
            self._exporter.stop()

    # ---- AgentObserver --------------------------------------------------------
    def on_rendezvous_started(self) -> None:
        self.metrics.on_rendezvous_started()

    def track_warm_workers(self, ready: Callable[[], int]) -> None:
        self.metrics.track_warm_workers(ready)

    def on_rendezvous(self, *, round: int, world_size: int, nodes: int, duration_s: float) -> None:
        self.metrics.on_rendezvous(round=round, world_size=world_size, nodes=nodes, duration_s=duration_s)

    def on_restart(self, reason: RestartReason) -> None:
        self.monitor.on_restart(reason)
        self.metrics.on_restart(reason)
        self.metrics.set_worker_states({r: "stopped" for r in self._pids})

    def on_recovered(self, duration_s: float) -> None:
        self.metrics.on_recovered(duration_s)

    def on_workers_started(self, pids: dict[int, int]) -> None:
        self._pids = dict(pids)
        self.metrics.set_worker_states({r: "healthy" for r in pids})
        self.monitor.on_workers_started()

    def on_workers_finished(self, state: str) -> None:
        self.monitor.on_workers_finished(state)
        self.metrics.set_worker_states({r: state for r in self._pids})

    def on_tick(self) -> None:
        """Every monitor tick: note it (liveness), pick up what the workers reported since the last one."""
        self.monitor.on_tick()
        report = self._reports.new_checkpoint()
        if report is not None:
            self.metrics.on_checkpoint(step=report.step, save_duration_s=report.save_duration_s,
                                       blocked_s=report.blocked_s)

    def on_etcd(self, up: bool) -> None:
        """The rendezvous reached etcd (True) or lost it (False): the `etcd` gauges and readiness check."""
        self.etcd.on_etcd(up)
        self.metrics.etcd.on_etcd(up)
