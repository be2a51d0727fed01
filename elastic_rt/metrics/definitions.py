"""The agent's Prometheus metrics (elastic_rt_*), all in a registry the caller owns."""

from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from elastic_rt.collectors.clock import ClockMetrics
from elastic_rt.decisions import COLLECTIVE_ERROR_KINDS, FailureCause, Response, RestartReason
from elastic_rt.worker_reports.heartbeat import Heartbeat
from elastic_rt.collectors.rdma import RdmaCollector
from elastic_rt.collectors.timex import TimexStatus, read_timex
from elastic_rt.metrics.workers import WorkerCollector

# elastic_rt_restarts_total{reason}: the series exported at zero from the start (rate() and alerts see each
# one): every reason the agent restarts its group for, and probe_failure, which the restart-storm runbook in
# docs/deploy.md names (a node that leaves is restarted by the others under peer_lost).
RESTART_REASONS: tuple[RestartReason, ...] = (
    *(r for r in RestartReason if r.response is Response.RESTART), RestartReason.PROBE_FAILURE)
FAILURE_CAUSES: tuple[FailureCause, ...] = tuple(FailureCause)
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
        self.last_restart = gauge(
            "elastic_rt_last_restart_timestamp_seconds",
            "Unix time of this agent's last worker group restart for the reason (absent before the first).",
            extra=["reason"],
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
        # Histograms too: a series born at its first observation holds 1 in its first sample, which rate()
        # and increase() never count, so a dashboard's quantiles would stay empty until the second event.
        for hist in (self.rendezvous_duration, self.recovery, self.checkpoint_save, self.checkpoint_blocked):
            hist.labels(*self._base)
        self.rounds.labels(*self._base)
        self.probe_failures.labels(*self._base)

        self.clock = ClockMetrics(registry=registry, run_id=run_id, node=node, timex_reader=timex_reader)
        self.etcd = EtcdMetrics(registry=registry, run_id=run_id, node=node)
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
    def on_restart(self, reason: RestartReason) -> None:
        """The worker group is being restarted; reason is one of RESTART_REASONS."""
        if reason not in RESTART_REASONS:
            raise ValueError(f"unknown restart reason {str(reason)!r}; expected one of "
                             f"{', '.join(RESTART_REASONS)}")
        self.restarts.labels(*self._base, reason).inc()
        self.last_restart.labels(*self._base, reason).set(self._wall_clock())

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


# ---- health checks (/livez, /readyz) as metrics ---------------------------------------------------
HEALTH_CHECK_METRIC = "elastic_rt_health_check"
LAST_TICK_AGE_METRIC = "elastic_rt_agent_last_tick_age_seconds"


class HealthCollector:
    """The /livez and /readyz checks as gauges, evaluated at scrape time like the endpoints.

    results() yields (kind, check, ok) with kind "liveness" or "readiness"; last_tick_age_s()
    gives the seconds since the agent's monitor loop last ticked (None before the first tick).
    """

    def __init__(self, *, run_id: str, node: str, results: Callable[[], Iterable[tuple[str, str, bool]]],
                 last_tick_age_s: Callable[[], float | None]) -> None:
        self._base = [run_id, node]
        self._results = results
        self._last_tick_age_s = last_tick_age_s

    def _families(self):
        from prometheus_client.core import GaugeMetricFamily

        checks = GaugeMetricFamily(
            HEALTH_CHECK_METRIC, "1 while the named /livez or /readyz check passes, else 0.",
            labels=["run_id", "node", "kind", "check"])
        age = GaugeMetricFamily(
            LAST_TICK_AGE_METRIC, "Seconds since the agent's monitor loop last ticked (it ticks while workers run).",
            labels=["run_id", "node"])
        return checks, age

    def collect(self):
        checks, age = self._families()
        for kind, name, ok in self._results():
            checks.add_metric(self._base + [kind, name], 1.0 if ok else 0.0)
        yield checks
        value = self._last_tick_age_s()
        if value is not None:
            age.add_metric(self._base, value)
        yield age

    def describe(self):
        yield from self._families()  # registering must not run the checks
# ---- goodput, step timing and stragglers (recorded by elastic_rt.goodput) --------------------------
# (imports kept with this block so that it merges as one piece)
import bisect  # noqa: E402
import threading  # noqa: E402

from prometheus_client.core import HistogramMetricFamily  # noqa: E402
from prometheus_client.registry import Collector  # noqa: E402

GOODPUT_CATEGORIES = ("productive", "startup", "restart", "checkpoint", "restore", "lost", "other")
STEP_TIME_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class StepTimeHistogram(Collector):
    """elastic_rt_step_duration_seconds per local rank, where one observation may stand for many steps
    (a tick that saw 100 steps of 1 ms adds 100 to the count): _count is steps, _sum their time."""

    def __init__(self, *, run_id: str, node: str, buckets: tuple = STEP_TIME_BUCKETS_S) -> None:
        self._base = [run_id, node]
        self._bounds = tuple(float(b) for b in buckets) + (float("inf"),)
        self._ranks: dict[int, tuple[list[int], list[float]]] = {}  # rank -> (bucket counts, [sum])
        self._lock = threading.Lock()

    def observe(self, local_rank: int, duration_s: float, steps: int = 1) -> None:
        with self._lock:
            counts, total = self._ranks.setdefault(local_rank, ([0] * len(self._bounds), [0.0]))
            counts[bisect.bisect_left(self._bounds, duration_s)] += steps
            total[0] += duration_s * steps

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily("elastic_rt_step_duration_seconds",
                                     "Time per training step of each local worker, from its step heartbeats.",
                                     labels=["run_id", "node", "local_rank"])

    def collect(self):
        fam = self._family()
        with self._lock:
            snapshot = {r: (list(c), t[0]) for r, (c, t) in self._ranks.items()}
        for rank, (counts, total) in sorted(snapshot.items()):
            cumulative, acc = [], 0
            for bound, n in zip(self._bounds, counts):
                acc += n
                cumulative.append(("+Inf" if bound == float("inf") else repr(bound), acc))
            fam.add_metric(self._base + [str(rank)], cumulative, total)
        yield fam

    def describe(self):
        yield self._family()


class GoodputMetrics:
    """Goodput by category, step time per rank and straggler flags of one agent."""

    def __init__(self, *, registry: CollectorRegistry, run_id: str, node: str) -> None:
        self._base = (run_id, node)
        base = ["run_id", "node"]
        self.seconds = Counter("elastic_rt_goodput_seconds",
                               "Wall time of this agent since the job started, by category (settled time).",
                               base + ["category"], registry=registry)
        self.uncommitted = Gauge("elastic_rt_goodput_uncommitted_seconds",
                                 "Training time since the last commit: productive if kept, lost on a failure.",
                                 base, registry=registry)
        self.ratio = Gauge("elastic_rt_goodput_ratio",
                           "(productive + uncommitted) / wall time since the job started.", base, registry=registry)
        self.lost_steps = Counter("elastic_rt_goodput_lost_steps", "Steps re-done after failures.", base,
                                  registry=registry)
        self.step_time = Gauge("elastic_rt_step_time_seconds", "Median step time of the worker in the last window.",
                               base + ["local_rank"], registry=registry)
        self.step_time_ratio = Gauge("elastic_rt_step_time_ratio",
                                     "The worker's median step time / the job's median (all nodes).",
                                     base + ["local_rank"], registry=registry)
        self.compute_time = Gauge("elastic_rt_compute_time_seconds",
                                  "Median compute time per step of the worker in the last window: the time between "
                                  "optimizer steps outside backward() (where lock-step ranks wait for each other).",
                                  base + ["local_rank"], registry=registry)
        self.compute_time_ratio = Gauge("elastic_rt_compute_time_ratio",
                                        "The worker's median compute time per step / the job's median (all nodes).",
                                        base + ["local_rank"], registry=registry)
        self.straggler = Gauge("elastic_rt_straggler",
                               "1 while the worker is flagged as a straggler, else 0.", base + ["local_rank"],
                               registry=registry)
        self.step_histogram = StepTimeHistogram(run_id=run_id, node=node)
        registry.register(self.step_histogram)
        for category in GOODPUT_CATEGORIES:
            self.seconds.labels(*self._base, category)
        self.lost_steps.labels(*self._base)
        self._exported = dict.fromkeys(GOODPUT_CATEGORIES, 0.0)
        self._ranks: set[int] = set()

    def on_totals(self, totals: Mapping[str, float], *, uncommitted_s: float, ratio: float) -> None:
        """The ledger's totals (they only grow): counters advance by the difference."""
        for category in GOODPUT_CATEGORIES:
            delta = totals.get(category, 0.0) - self._exported[category]
            if delta > 0:
                self.seconds.labels(*self._base, category).inc(delta)
                self._exported[category] += delta
        self.uncommitted.labels(*self._base).set(uncommitted_s)
        self.ratio.labels(*self._base).set(ratio)

    def on_lost_steps(self, steps: int) -> None:
        self.lost_steps.labels(*self._base).inc(max(0, steps))

    def on_step_times(self, medians: Mapping[int, float], *, job_median_s: float | None = None) -> None:
        for rank, value in medians.items():
            self.step_time.labels(*self._base, str(rank)).set(value)
            if job_median_s:
                self.step_time_ratio.labels(*self._base, str(rank)).set(value / job_median_s)
            self._ranks.add(rank)

    def on_compute_times(self, medians: Mapping[int, float], *, job_median_s: float | None = None) -> None:
        for rank, value in medians.items():
            self.compute_time.labels(*self._base, str(rank)).set(value)
            if job_median_s:
                self.compute_time_ratio.labels(*self._base, str(rank)).set(value / job_median_s)

    def on_stragglers(self, flagged: set[int], local_ranks: set[int]) -> None:
        """Set the flag of every local rank (1: flagged)."""
        for rank in local_ranks | self._ranks:
            self.straggler.labels(*self._base, str(rank)).set(1.0 if rank in flagged else 0.0)


# ---- Why workers failed: causes, hangs, collective backend errors ------------------------
class FailureMetrics:
    """Worker failures by cause, hangs by the rank that stopped first, collective backend errors."""

    def __init__(self, *, registry: CollectorRegistry, run_id: str, node: str,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._base = (run_id, node)
        self._wall_clock = wall_clock
        base = ["run_id", "node"]
        self.last_failure = Gauge(
            "elastic_rt_last_worker_failure_timestamp_seconds",
            "Unix time of the last worker failure of this node with the cause (absent before the first).",
            base + ["cause"], registry=registry)
        self.failures = Counter(
            "elastic_rt_worker_failures", "Worker failures by cause (see docs/failures.md).", base + ["cause"],
            registry=registry)
        self.hangs = Counter(
            "elastic_rt_hangs",
            "Hang restarts, by the local rank that stopped progressing first and its process state "
            "(psutil: stopped, disk-sleep, sleeping, running).",
            base + ["local_rank", "process_state"], registry=registry)
        self.collective_errors = Counter(
            "elastic_rt_collective_errors",
            "Collective backend errors seen in failed workers (NCCL watchdog timeouts, communicator aborts, "
            "gloo timeouts and closed peers).",
            base + ["backend", "kind"], registry=registry)
        for cause in FAILURE_CAUSES:  # export zeros so rate() and alerts see every series
            self.failures.labels(*self._base, cause)
        for backend, kind in COLLECTIVE_ERROR_KINDS:
            self.collective_errors.labels(*self._base, backend, kind)

    def on_failure(self, cause: FailureCause, collective: tuple[str, str] | None = None) -> None:
        if cause not in FAILURE_CAUSES:
            raise ValueError(f"unknown failure cause {str(cause)!r}; expected one of {', '.join(FAILURE_CAUSES)}")
        self.failures.labels(*self._base, cause).inc()
        self.last_failure.labels(*self._base, cause).set(self._wall_clock())
        if collective is not None:
            self.collective_errors.labels(*self._base, *collective).inc()

    def on_hang(self, local_rank: int, process_state: str) -> None:
        self.failures.labels(*self._base, FailureCause.HANG).inc()
        self.last_failure.labels(*self._base, FailureCause.HANG).set(self._wall_clock())
        self.hangs.labels(*self._base, str(local_rank), process_state).inc()
# ---- etcd reachability (fed by the rendezvous through observer.on_etcd) -------------------------
class EtcdMetrics:
    """elastic_rt_etcd_up and elastic_rt_etcd_unreachable_seconds_total; the seconds grow at scrape
    time while etcd is unreachable, so a dashboard sees an outage as it happens."""

    def __init__(self, *, registry: CollectorRegistry, run_id: str, node: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._labels = [run_id, node]
        self._clock = clock
        self._down_since: float | None = None
        self._total_s = 0.0
        registry.register(self)

    def on_etcd(self, up: bool) -> None:
        now = self._clock()
        if up and self._down_since is not None:
            self._total_s += now - self._down_since
            self._down_since = None
        elif not up and self._down_since is None:
            self._down_since = now

    def _families(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up = GaugeMetricFamily("elastic_rt_etcd_up", "1 while this agent reaches etcd, 0 while it does not "
                               "(workers keep running; membership changes wait).", labels=["run_id", "node"])
        down = CounterMetricFamily("elastic_rt_etcd_unreachable_seconds",
                                   "Seconds this agent spent unable to reach etcd.", labels=["run_id", "node"])
        return up, down

    def collect(self):
        up, down = self._families()
        since = self._down_since
        up.add_metric(self._labels, 1.0 if since is None else 0.0)
        down.add_metric(self._labels, self._total_s + (0.0 if since is None else self._clock() - since))
        yield up
        yield down

    def describe(self):
        yield from self._families()


# ---- the pre-flight node test (recorded by elastic_rt.doctor.preflight) -----------------------------
class PreflightMetrics:
    """The launch's pre-flight test: this node's matmul times, its ring link, and whether it was named."""

    def __init__(self, *, registry: CollectorRegistry, run_id: str, node: str) -> None:
        self._base = (run_id, node)
        base = ["run_id", "node"]
        self.compute = Gauge("elastic_rt_preflight_compute_seconds",
                             "Median seconds per matmul of each local device in the pre-flight test.",
                             base + ["local_rank"], registry=registry)
        self.compute_ratio = Gauge("elastic_rt_preflight_compute_ratio",
                                   "A local device's pre-flight matmul time / the job's median.",
                                   base + ["local_rank"], registry=registry)
        self.link = Gauge("elastic_rt_preflight_link_seconds",
                          "Seconds the pre-flight ring test took to receive from the previous node.", base,
                          registry=registry)
        self.slow = Gauge("elastic_rt_preflight_slow", "1 when the pre-flight test named this node, else 0.",
                          base, registry=registry)
        self.duration = Gauge("elastic_rt_preflight_duration_seconds",
                              "Seconds the last pre-flight phase took (compute test, or ring test and verdict).",
                              base + ["phase"], registry=registry)
        self._compute: dict[int, float] = {}

    def on_compute(self, seconds: Mapping[int, float], *, duration_s: float) -> None:
        self._compute = dict(seconds)
        for rank, value in seconds.items():
            self.compute.labels(*self._base, str(rank)).set(value)
        self.duration.labels(*self._base, "compute").set(duration_s)

    def on_verdict(self, *, compute_median_s: float, link_s: float | None, slow: bool, duration_s: float) -> None:
        if compute_median_s > 0:
            for rank, value in self._compute.items():
                self.compute_ratio.labels(*self._base, str(rank)).set(value / compute_median_s)
        if link_s is not None:
            self.link.labels(*self._base).set(link_s)
        self.slow.labels(*self._base).set(1.0 if slow else 0.0)
        self.duration.labels(*self._base, "round").set(duration_s)
