"""When the node collectors run: NTP queries in the background, and the checks after every rendezvous
(the collective probe across the round's nodes, clock skew against rank 0). Results go to AgentMetrics."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from elastic_rt.collectors import sntp
from elastic_rt.collectors.clock import SkewEstimate, skew_warning
from elastic_rt.collectors.probe import ProbeResult, spawn_probe
from elastic_rt.decisions import DETECTION_ACTIONS, DetectionAction
from elastic_rt.errors import ConfigError, ElasticRTError, RoundOverError
from elastic_rt.sections import option, positive

# torch's DynamicRendezvousHandler declares a node dead when its heartbeat, stamped with
# that node's clock, looks older than 5 s x 3 on the reader's clock.
TORCH_HEARTBEAT_TOLERANCE_S = 15.0

log = logging.getLogger(__name__)


def _probe_bytes(value: int) -> int:
    if value < 0:
        raise ConfigError(f"--probe-bytes {value}: must be >= 0 (0 = no probe)")
    return value


def _probe_backend(value: str) -> str:
    if value not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"--probe-backend {value!r}: choose auto, gloo or nccl")
    return value


@dataclass(frozen=True, kw_only=True)
class CollectorSettings:
    """The node collectors' config section: NTP servers, and the collective probe after each rendezvous."""

    ntp_servers: tuple[str, ...] = option(
        "--ntp-server", action="append", default=[], parse=tuple,
        help="NTP server to measure offset against (repeatable)")
    probe_bytes: int = option(
        "--probe-bytes", type=int, default=4 << 20, parse=_probe_bytes,
        help="size of the all-reduce probe run across the nodes after every rendezvous (default 4 MiB; 0 = off)")
    probe_timeout_s: float = option(
        "--probe-timeout", type=float, default=30.0, parse=positive("--probe-timeout"),
        help="seconds before the probe counts as failed")
    probe_backend: str = option(
        "--probe-backend", default="auto", parse=_probe_backend, help="auto (nccl with CUDA, else gloo), gloo or nccl")
    probe_interval_s: float = option(
        "--probe-interval", type=float, default=0.0, parse=positive("--probe-interval", zero_ok=True),
        help="also probe every this many seconds while the round lasts (default 0 = after rendezvous only)")
    probe_failure_action: DetectionAction = option(
        "--probe-failure-action", default=DetectionAction.REPORT.value, choices=DETECTION_ACTIONS,
        parse=DetectionAction,
        help="report: fail the /readyz check `probe` and count it; leave: also stop this node's workers and leave "
             "the job so the others re-form without it (default report)")


class NtpPoller:
    """Queries each server now and every interval_s (SNTP); failures are counted, not fatal."""

    def __init__(self, *, servers: tuple[str, ...], clock_metrics, stop: threading.Event,
                 interval_s: float = 60.0, timeout_s: float = 2.0) -> None:
        self._servers = servers
        self._metrics = clock_metrics
        self._stop = stop
        self._interval_s = interval_s
        self._timeout_s = timeout_s

    def start(self) -> None:
        if self._servers:
            threading.Thread(target=self._loop, name="elastic-rt-ntp", daemon=True).start()

    def _loop(self) -> None:
        warned: set[str] = set()
        while True:
            for server in self._servers:
                try:
                    self._metrics.on_ntp(sntp.query(server, timeout_s=self._timeout_s))
                except ElasticRTError as exc:
                    self._metrics.on_ntp_failure(server)
                    if server not in warned:
                        log.warning("NTP server %s: %s", server, exc)
                        warned.add(server)
            if self._stop.wait(self._interval_s):
                return


class RoundChecks:
    """After each rendezvous: the collective probe (then every probe_interval_s, if set) and clock skew.

    Runs in a thread per round; a round that ended makes its checks stop and its failures moot.
    """

    def __init__(self, *, node: str, metrics, stop: threading.Event, settings: CollectorSettings = CollectorSettings(),
                 skew_samples: int = 8) -> None:
        self._node = node
        self._metrics = metrics
        self._stop = stop
        self._probe_bytes = settings.probe_bytes
        self._probe_timeout_s = settings.probe_timeout_s
        self._probe_backend = settings.probe_backend
        self._probe_interval_s = settings.probe_interval_s
        self._skew_samples = skew_samples
        self.round = -1
        self.last_probe: ProbeResult | None = None
        self.last_skew: SkewEstimate | None = None
        self.probe_failed_round = -1
        self.probe_error = ""

    def probe_failure(self) -> str | None:
        """Why the last probe of the current round failed, or None if it did not (or none ran)."""
        if self.round >= 0 and self.probe_failed_round == self.round:
            return self.probe_error or "collective probe failed"
        return None

    def on_round(self, *, round: int, store, group_rank: int, group_world_size: int,
                 master_addr: str | None = None) -> None:
        self.round = round
        if group_world_size < 2:
            return
        threading.Thread(
            target=self._run, args=(round, store, group_rank, group_world_size, master_addr),
            name=f"elastic-rt-checks-{round}", daemon=True,
        ).start()

    def _run(self, rnd: int, store, rank: int, world: int, master_addr: str | None) -> None:
        if self._probe_bytes > 0:
            self._probe_once(rnd, store, rank, world, master_addr, 0)
        self._measure_skew(rnd, store, rank, world)
        if self._probe_bytes <= 0 or self._probe_interval_s <= 0:
            return
        start, k = time.monotonic(), 1
        while not self._stop.wait(max(0.0, start + k * self._probe_interval_s - time.monotonic())):
            if rnd != self.round:
                return
            self._probe_once(rnd, store, rank, world, master_addr, k)
            k += 1

    def _probe_once(self, rnd: int, store, rank: int, world: int, master_addr: str | None, k: int) -> None:
        """Probe number k of round rnd; every node of the round runs the same k at about the same time."""
        from torch.distributed.elastic.utils.distributed import get_free_port  # torch: only once a round runs

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
            if self._current(rnd, exc):  # a failure of an outdated round says nothing
                self._metrics.on_probe_failure()
                self.probe_error = str(exc) or type(exc).__name__
                self.probe_failed_round = rnd
                log.warning("[%s round %d] %s", self._node, rnd, exc)
            return
        self.last_probe = result
        if self.probe_failed_round == rnd:
            self.probe_failed_round = -1
        self._metrics.on_probe(latency_s=result.latency_s, bus_bandwidth_bytes_per_s=result.busbw_bytes_per_s)
        log.info("[%s round %d] probe: %s all-reduce of %d bytes over %d nodes: %.2f ms, busbw %.3f GB/s",
                 self._node, rnd, result.backend, result.nbytes, world, result.latency_s * 1e3,
                 result.busbw_bytes_per_s / 1e9)

    def _current(self, rnd: int, exc: Exception) -> bool:
        """Whether a failure in round rnd speaks of the round that runs (not of one that ended under it)."""
        return rnd == self.round and not isinstance(exc, RoundOverError)

    def _measure_skew(self, rnd: int, store, rank: int, world: int) -> None:
        from elastic_rt.collectors.skew import measure_skew_via_store, serve_skew  # torch.distributed

        try:
            if rank == 0:  # the reference clock: its skew is 0 by definition
                serve_skew(store, list(range(1, world)), samples=self._skew_samples)
                self._metrics.clock.on_skew(
                    SkewEstimate(offset_s=0.0, round_trip_s=0.0, error_bound_s=0.0, samples=0))
                return
            est = measure_skew_via_store(store, rank, samples=self._skew_samples)
        except Exception as exc:  # noqa: BLE001 - the round may have ended under us
            if self._current(rnd, exc):
                log.warning("[%s round %d] clock skew measurement failed: %s", self._node, rnd, exc)
            return
        self.last_skew = est
        self._metrics.clock.on_skew(est)
        warning = skew_warning(est.offset_s, TORCH_HEARTBEAT_TOLERANCE_S)
        if warning:
            log.warning("[%s round %d] %s", self._node, rnd, warning)
