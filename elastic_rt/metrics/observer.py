"""The agent's observer: records what the agent reports (rounds, restarts, workers, checkpoints) as
Prometheus metrics and serves them. It decides nothing; restart decisions live in elastic_rt.agent.policy."""

from __future__ import annotations

import logging
from typing import Callable, Mapping

from prometheus_client import CollectorRegistry

from elastic_rt.errors import ElasticRTError
from elastic_rt.metrics.definitions import AgentMetrics
from elastic_rt.metrics.exporter import HealthResult, MetricsExporter
from elastic_rt.reporting.heartbeat import Heartbeat
from elastic_rt.reporting.inbox import WorkerReports

log = logging.getLogger(__name__)


class MetricsObserver:
    """AgentObserver that exports everything the agent sees."""

    def __init__(self, *, run_id: str, node: str, reports: WorkerReports, sysfs_root: str | None = "/sys",
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._reports = reports
        self._pids: dict[int, int] = {}
        self.metrics = AgentMetrics(
            registry=self.registry, run_id=run_id, node=node,
            worker_pids=lambda: dict(self._pids), heartbeats=self._heartbeats, sysfs_root=sysfs_root,
        )
        self._exporter: MetricsExporter | None = None

    def _heartbeats(self) -> Mapping[int, Heartbeat | None]:
        return self._reports.heartbeats()

    # ---- exporter -----------------------------------------------------------
    def serve(self, host: str, port: int, healthy: Callable[[], HealthResult] = lambda: True) -> int | None:
        """Start /metrics and /healthz; a port in use is logged and the agent goes on without."""
        if port == 0:
            return None
        exporter = MetricsExporter(registry=self.registry, healthy=healthy, host=host, port=port)
        try:
            exporter.start()
        except ElasticRTError as exc:
            log.warning("%s; continuing without the metrics server", exc)
            return None
        self._exporter = exporter
        log.info("metrics at %s", exporter.url)
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

    def on_restart(self, reason: str) -> None:
        self.metrics.on_restart(reason)
        self.metrics.set_worker_states({r: "stopped" for r in self._pids})

    def on_recovered(self, duration_s: float) -> None:
        self.metrics.on_recovered(duration_s)

    def on_workers_started(self, pids: dict[int, int]) -> None:
        self._pids = dict(pids)
        self.metrics.set_worker_states({r: "healthy" for r in pids})

    def on_workers_finished(self, state: str) -> None:
        self.metrics.set_worker_states({r: state for r in self._pids})

    def on_tick(self) -> None:
        """Every monitor tick: pick up what the workers reported since the last one."""
        report = self._reports.new_checkpoint()
        if report is not None:
            self.metrics.on_checkpoint(step=report.step, save_duration_s=report.save_duration_s,
                                       blocked_s=report.blocked_s)
