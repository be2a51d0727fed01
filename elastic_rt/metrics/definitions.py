"""The agent's Prometheus metrics (elastic_rt_*), all in a registry the caller owns."""

from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from elastic_rt.collectors.clock import ClockMetrics
from elastic_rt.reporting.heartbeat import Heartbeat
from elastic_rt.collectors.rdma import RdmaCollector
from elastic_rt.collectors.timex import TimexStatus, read_timex
from elastic_rt.metrics.workers import WorkerCollector

RESTART_REASONS = ("worker_failure", "peer_lost", "round_advanced", "scale_up", "hang", "probe_failure")
# torch.distributed.elastic WorkerState names, lower-cased.
WORKER_STATES = ("unknown", "init", "healthy", "unhealthy", "stopped", "succeeded", "failed")

RENDEZVOUS_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300)
RECOVERY_BUCKETS_S = (1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600)
CHECKPOINT_SAVE_BUCKETS_S = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
CHECKPOINT_BLOCKED_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class AgentMetrics:
    """Every metric one agent exports; the agent calls the on_* methods as events happen.

    Nothing touches the global prometheus registry. Scrape-time collectors (worker
    RSS/CPU/heartbeats, RDMA ports, timex) read their sources through the callables
    and paths given here; pass None to leave one out.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        run_id: str,
        node: str,
        worker_pids: Callable[[], Mapping[int, int]] | None = None,
        heartbeats: Callable[[], Mapping[int, Heartbeat | None]] | None = None,
        sysfs_root: str | None = "/sys",
        timex_reader: Callable[[], TimexStatus] | None = read_timex,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._base = (run_id, node)
        self._wall_clock = wall_clock
        base = ["run_id", "node"]

        def gauge(name: str, doc: str, extra: Iterable[str] = ()) -> Gauge:
            return Gauge(name, doc, base + list(extra), registry=registry)

        def counter(name: str, doc: str, extra: Iterable[str] = ()) -> Counter:
            return Counter(name, doc, base + list(extra), registry=registry)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, base, buckets=buckets, registry=registry)

        # Rendezvous and membership.
        self.world_size = gauge("elastic_rt_world_size", "Workers (global ranks) in the current round.")
        self.nodes = gauge("elastic_rt_nodes", "Nodes (agents) in the current round.")
        self.round = gauge("elastic_rt_rendezvous_round", "Number of the current rendezvous round.")
        self.rounds = counter("elastic_rt_rendezvous_rounds", "Rendezvous rounds this agent completed.")
        self.standby = gauge(
            "elastic_rt_standby",
            "1 while this agent is in the rendezvous without a worker group (joining, or a hot spare waiting "
            "for a place when --nnodes MAX is reached), 0 while its workers run. sum() counts the spares.",
        )
        self.warm_workers = gauge(
            "elastic_rt_warm_workers_ready",
            "Pre-started workers (torch imported) ready to take a local rank at the next start.",
        )
        self.rendezvous_duration = histogram(
            "elastic_rt_rendezvous_duration_seconds",
            "Time from joining a rendezvous to the round being complete.",
            RENDEZVOUS_BUCKETS_S,
        )
        # Failures and recovery.
        self.restarts = counter(
            "elastic_rt_restarts", "Worker group restarts, by what caused them.", extra=["reason"]
        )
        self.recovery = histogram(
            "elastic_rt_recovery_duration_seconds",
            "Time from a failure being detected to the workers running again.",
            RECOVERY_BUCKETS_S,
        )
        self.last_recovery = gauge(
            "elastic_rt_last_recovery_duration_seconds", "Duration of the most recent recovery."
        )
        self.worker_state = gauge(
            "elastic_rt_worker_state",
            "1 for the worker's current state, 0 for the others (torch elastic WorkerState).",
            extra=["local_rank", "state"],
        )
        # Checkpoints.
        self.checkpoint_save = histogram(
            "elastic_rt_checkpoint_save_duration_seconds",
            "Time to write and commit a checkpoint, end to end (async part included).",
            CHECKPOINT_SAVE_BUCKETS_S,
        )
        self.checkpoint_blocked = histogram(
            "elastic_rt_checkpoint_blocked_seconds",
            "Time training was blocked by a checkpoint save (the synchronous part).",
            CHECKPOINT_BLOCKED_BUCKETS_S,
        )
        self.checkpoint_step = gauge(
            "elastic_rt_checkpoint_last_committed_step", "Step of the last committed checkpoint."
        )
        self.checkpoint_time = gauge(
            "elastic_rt_checkpoint_last_commit_timestamp_seconds",
            "Unix time the last checkpoint was committed.",
        )
        # Collective probe.
        self.probe_latency = gauge(
            "elastic_rt_probe_latency_seconds", "Latency of the last collective probe (small all-reduce)."
        )
        self.probe_bandwidth = gauge(
            "elastic_rt_probe_bus_bandwidth_bytes_per_second",
            "Bus bandwidth of the last collective probe (nccl-tests busbw convention).",
        )
        self.probe_failures = counter("elastic_rt_probe_failures", "Collective probes that failed or timed out.")

        for reason in RESTART_REASONS:  # export zeros so rate() and alerts see every series
            self.restarts.labels(*self._base, reason)
        self.rounds.labels(*self._base)
        self.probe_failures.labels(*self._base)

        self.clock = ClockMetrics(registry=registry, run_id=run_id, node=node, timex_reader=timex_reader)
        registry.register(WorkerCollector(run_id=run_id, node=node, pids=worker_pids, heartbeats=heartbeats))
        if sysfs_root is not None:
            registry.register(RdmaCollector(sysfs_root=sysfs_root, const_labels={"run_id": run_id, "node": node}))
        self._worker_ranks: set[int] = set()

    # -- rendezvous -------------------------------------------------------------------
    def on_rendezvous_started(self) -> None:
        """The agent entered the rendezvous: no worker group until the round completes."""
        self.standby.labels(*self._base).set(1)

    def track_warm_workers(self, ready: Callable[[], int]) -> None:
        """Read the number of ready warm workers at scrape time."""
        self.warm_workers.labels(*self._base).set_function(ready)

    def on_rendezvous(self, *, round: int, world_size: int, nodes: int, duration_s: float) -> None:
        """A round completed: `nodes` agents, `world_size` workers, after `duration_s`."""
        self.standby.labels(*self._base).set(0)
        self.round.labels(*self._base).set(round)
        self.world_size.labels(*self._base).set(world_size)
        self.nodes.labels(*self._base).set(nodes)
        self.rounds.labels(*self._base).inc()
        self.rendezvous_duration.labels(*self._base).observe(duration_s)

    # -- failures -----------------------------------------------------------------------
    def on_restart(self, reason: str) -> None:
        """The worker group is being restarted; reason is one of RESTART_REASONS."""
        if reason not in RESTART_REASONS:
            raise ValueError(f"unknown restart reason {reason!r}; expected one of {RESTART_REASONS}")
        self.restarts.labels(*self._base, reason).inc()

    def on_recovered(self, duration_s: float) -> None:
        """Workers run again, `duration_s` after the failure was detected."""
        self.recovery.labels(*self._base).observe(duration_s)
        self.last_recovery.labels(*self._base).set(duration_s)

    def set_worker_states(self, states: Mapping[int, str]) -> None:
        """Replace the state of every local worker; ranks not given disappear."""
        for rank in self._worker_ranks - set(states):
            for state in WORKER_STATES:
                self.worker_state.remove(*self._base, str(rank), state)
        self._worker_ranks = set()
        for rank, state in states.items():
            self.on_worker_state(rank, state)

    def on_worker_state(self, local_rank: int, state: str) -> None:
        state = state.lower()
        if state not in WORKER_STATES:
            raise ValueError(f"unknown worker state {state!r}; expected one of {WORKER_STATES}")
        for s in WORKER_STATES:
            self.worker_state.labels(*self._base, str(local_rank), s).set(1.0 if s == state else 0.0)
        self._worker_ranks.add(local_rank)

    # -- checkpoints ------------------------------------------------------------------
    def on_checkpoint(self, *, step: int, save_duration_s: float, blocked_s: float) -> None:
        """A checkpoint of `step` was committed."""
        self.checkpoint_save.labels(*self._base).observe(save_duration_s)
        self.checkpoint_blocked.labels(*self._base).observe(blocked_s)
        self.checkpoint_step.labels(*self._base).set(step)
        self.checkpoint_time.labels(*self._base).set(self._wall_clock())

    # -- collective probe ---------------------------------------------------------------
    def on_probe(self, *, latency_s: float, bus_bandwidth_bytes_per_s: float | None = None) -> None:
        self.probe_latency.labels(*self._base).set(latency_s)
        if bus_bandwidth_bytes_per_s is not None:
            self.probe_bandwidth.labels(*self._base).set(bus_bandwidth_bytes_per_s)

    def on_probe_failure(self) -> None:
        self.probe_failures.labels(*self._base).inc()
