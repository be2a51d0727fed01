"""Connects agent events to Prometheus metrics, the /metrics server, heartbeats and hang detection."""

from __future__ import annotations

import logging
import os
import time

from prometheus_client import CollectorRegistry

from elastic_rt.errors import ElasticRTError
from elastic_rt.health.exporter import MetricsExporter
from elastic_rt.health.hang import HangDetector
from elastic_rt.health.heartbeat import HeartbeatReader, prepare_heartbeat_file
from elastic_rt.health.metrics import AgentMetrics

log = logging.getLogger(__name__)


class MetricsObserver:
    """AgentObserver that exports everything the agent sees and detects hung workers."""

    def __init__(self, *, run_id: str, node: str, heartbeat_dir: str, hang_timeout_s: float = 0.0,
                 sysfs_root: str | None = "/sys") -> None:
        self.registry = CollectorRegistry()
        self._pids: dict[int, int] = {}
        self._heartbeat_dir = heartbeat_dir
        self._reader = HeartbeatReader({})
        self.metrics = AgentMetrics(
            registry=self.registry, run_id=run_id, node=node,
            worker_pids=lambda: dict(self._pids), heartbeats=self._read_heartbeats, sysfs_root=sysfs_root,
        )
        self._hang = HangDetector(hang_timeout_s=hang_timeout_s) if hang_timeout_s > 0 else None
        self._exporter: MetricsExporter | None = None
        self._failure_at: float | None = None
        self.healthy = True

    def _read_heartbeats(self):
        return self._reader.read()

    # ---- exporter -----------------------------------------------------------
    def serve(self, host: str, port: int) -> int | None:
        """Start /metrics and /healthz; a port in use is logged and the agent goes on without."""
        if port == 0:
            return None
        exporter = MetricsExporter(registry=self.registry, healthy=lambda: self.healthy, host=host, port=port)
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
    def on_rendezvous(self, *, round: int, world_size: int, nodes: int, duration_s: float) -> None:
        self.metrics.on_rendezvous(round=round, world_size=world_size, nodes=nodes, duration_s=duration_s)

    def on_restart(self, reason: str) -> None:
        self.metrics.on_restart(reason)
        self.metrics.set_worker_states({r: "stopped" for r in self._pids})

    def on_recovered(self, duration_s: float) -> None:
        self.metrics.on_recovered(duration_s)

    def on_workers_started(self, pids: dict[int, int]) -> None:
        self._pids = dict(pids)
        paths = {r: os.path.join(self._heartbeat_dir, f"worker-{r}") for r in pids}
        for path in paths.values():
            prepare_heartbeat_file(path)
        self._reader = HeartbeatReader(paths)
        self.metrics.set_worker_states({r: "healthy" for r in pids})
        if self._hang is not None:
            self._hang.start(pids.keys())

    def on_workers_finished(self, state: str) -> None:
        self.metrics.set_worker_states({r: state for r in self._pids})

    def poll(self, agent) -> str | None:
        """Called every monitor tick while workers are healthy: 'hang' when they stopped progressing."""
        if self._hang is None:
            return None
        self._hang.observe_all(self._reader.read())
        verdict = self._hang.check()
        if verdict.hung:
            log.warning("workers hung: %s", verdict.reason)
            return "hang"
        return None
