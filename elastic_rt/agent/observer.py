"""Connects agent events to Prometheus metrics, the /metrics server, heartbeats and hang detection."""

from __future__ import annotations

import logging
import os
import threading
import time

from prometheus_client import CollectorRegistry
from torch.distributed.elastic.utils.distributed import get_free_port

from elastic_rt.errors import ElasticRTError
from elastic_rt.health import sntp
from elastic_rt.health.ckpt_report import CheckpointReportReader
from elastic_rt.health.clock import SkewEstimate, skew_warning
from elastic_rt.health.exporter import MetricsExporter
from elastic_rt.health.hang import HangDetector
from elastic_rt.health.heartbeat import HeartbeatReader, prepare_heartbeat_file
from elastic_rt.health.metrics import AgentMetrics
from elastic_rt.health.probe import spawn_probe
from elastic_rt.health.store_skew import measure_skew_via_store, serve_skew

# torch's DynamicRendezvousHandler declares a node dead when its heartbeat, stamped with
# that node's clock, looks older than 5 s x 3 on the reader's clock.
TORCH_HEARTBEAT_TOLERANCE_S = 15.0

log = logging.getLogger(__name__)


class MetricsObserver:
    """AgentObserver that exports everything the agent sees and detects hung workers."""

    def __init__(self, *, run_id: str, node: str, heartbeat_dir: str, hang_timeout_s: float = 0.0,
                 sysfs_root: str | None = "/sys", probe_bytes: int = 4 << 20, probe_timeout_s: float = 30.0,
                 probe_backend: str = "auto", ntp_servers: tuple[str, ...] = (), ntp_interval_s: float = 60.0,
                 skew_samples: int = 8, probe_interval_s: float = 0.0,
                 probe_failure_action: str = "report") -> None:
        self._probe_interval_s = probe_interval_s
        self._probe_failure_action = probe_failure_action
        self.probe_failed_round = -1
        self._node = node
        self._probe_bytes = probe_bytes
        self._probe_timeout_s = probe_timeout_s
        self._probe_backend = probe_backend
        self._skew_samples = skew_samples
        self._round = -1
        self.last_probe = None
        self.last_skew = None
        self._stop = threading.Event()
        self._ntp_servers = ntp_servers
        self._ntp_interval_s = ntp_interval_s
        self.registry = CollectorRegistry()
        self._pids: dict[int, int] = {}
        self._heartbeat_dir = heartbeat_dir
        self._reader = HeartbeatReader({})
        self.metrics = AgentMetrics(
            registry=self.registry, run_id=run_id, node=node,
            worker_pids=lambda: dict(self._pids), heartbeats=self._read_heartbeats, sysfs_root=sysfs_root,
        )
        self._hang = HangDetector(hang_timeout_s=hang_timeout_s) if hang_timeout_s > 0 else None
        self._ckpt = CheckpointReportReader(heartbeat_dir)
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
        self._stop.set()
        if self._exporter is not None:
            self._exporter.stop()

    def start_ntp(self) -> None:
        """Query each --ntp-server now and every ntp_interval_s (SNTP); failures are counted, not fatal."""
        if not self._ntp_servers:
            return

        def loop() -> None:
            warned: set[str] = set()
            while True:
                for server in self._ntp_servers:
                    try:
                        self.metrics.clock.on_ntp(sntp.query(server, timeout_s=2.0))
                    except ElasticRTError as exc:
                        self.metrics.clock.on_ntp_failure(server)
                        if server not in warned:
                            log.warning("NTP server %s: %s", server, exc)
                            warned.add(server)
                if self._stop.wait(self._ntp_interval_s):
                    return

        threading.Thread(target=loop, name="elastic-rt-ntp", daemon=True).start()

    # ---- after each rendezvous: collective probe and clock skew -----------------
    def on_round(self, *, round: int, store, group_rank: int, group_world_size: int,
                 master_addr: str | None = None) -> None:
        self._round = round
        if group_world_size < 2:
            return
        threading.Thread(
            target=self._round_checks, args=(round, store, group_rank, group_world_size, master_addr),
            name=f"elastic-rt-checks-{round}", daemon=True,
        ).start()

    def _round_checks(self, rnd: int, store, rank: int, world: int, master_addr: str | None) -> None:
        if self._probe_bytes > 0:
            self._probe_once(rnd, store, rank, world, master_addr, 0)
        self._measure_skew(rnd, store, rank, world)
        if self._probe_bytes <= 0 or self._probe_interval_s <= 0:
            return
        start, k = time.monotonic(), 1
        while not self._stop.wait(max(0.0, start + k * self._probe_interval_s - time.monotonic())):
            if rnd != self._round:
                return
            self._probe_once(rnd, store, rank, world, master_addr, k)
            k += 1

    def _probe_once(self, rnd: int, store, rank: int, world: int, master_addr: str | None, k: int) -> None:
        """Probe number k of round rnd; every node of the round runs the same k at about the same time."""
        key = f"elastic-rt/probe/{k}/port"
        try:
            if rank == 0:
                store.set(key, str(get_free_port()))
            port = int(store.get(key).decode())
            result = spawn_probe(
                master_addr=master_addr or "127.0.0.1", master_port=port, rank=rank, world_size=world,
                nbytes=self._probe_bytes, timeout_s=self._probe_timeout_s, backend=self._probe_backend,
            )
        except Exception as exc:  # noqa: BLE001 - HealthCheckError, or the store went with the round
            if rnd == self._round:  # a failure of an outdated round says nothing
                self.metrics.on_probe_failure()
                self.healthy = False
                self.probe_failed_round = rnd
                log.warning("[%s round %d] %s", self._node, rnd, exc)
            return
        self.last_probe = result
        self.healthy = True
        self.metrics.on_probe(latency_s=result.latency_s, bus_bandwidth_bytes_per_s=result.busbw_bytes_per_s)
        log.info("[%s round %d] probe: %s all-reduce of %d bytes over %d nodes: %.2f ms, busbw %.3f GB/s",
                 self._node, rnd, result.backend, result.nbytes, world, result.latency_s * 1e3,
                 result.busbw_bytes_per_s / 1e9)

    def _measure_skew(self, rnd: int, store, rank: int, world: int) -> None:
        try:
            if rank == 0:  # the reference clock: its skew is 0 by definition
                serve_skew(store, list(range(1, world)), samples=self._skew_samples)
                self.metrics.clock.on_skew(SkewEstimate(offset_s=0.0, round_trip_s=0.0, error_bound_s=0.0, samples=0))
                return
            est = measure_skew_via_store(store, rank, samples=self._skew_samples)
        except Exception as exc:  # noqa: BLE001 - the round may have ended under us
            if rnd == self._round:
                log.warning("[%s round %d] clock skew measurement failed: %s", self._node, rnd, exc)
            return
        self.last_skew = est
        self.metrics.clock.on_skew(est)
        warning = skew_warning(est.offset_s, TORCH_HEARTBEAT_TOLERANCE_S)
        if warning:
            log.warning("[%s round %d] %s", self._node, rnd, warning)

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
        if self._probe_failure_action == "leave" and self.probe_failed_round == self._round >= 0:
            return "probe_failure"
        report = self._ckpt.read_new()
        if report is not None:
            self.metrics.on_checkpoint(step=report.step, save_duration_s=report.save_duration_s,
                                       blocked_s=report.blocked_s)
        if self._hang is None:
            return None
        self._hang.observe_all(self._reader.read())
        verdict = self._hang.check()
        if verdict.hung:
            log.warning("workers hung: %s", verdict.reason)
            return "hang"
        return None
