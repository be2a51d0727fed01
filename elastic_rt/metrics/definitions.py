"""The agent's own Prometheus metrics (elastic_rt_*: rendezvous, restarts and recovery, worker states,
checkpoints, the collective probe, etcd reachability, health checks) as MetricSpecs, in a registry the caller
owns. A metric fed by an event AgentMetrics already has needs only its spec here."""

from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry

from elastic_rt.collectors.clock import ClockMetrics
from elastic_rt.collectors.rdma import RdmaCollector
from elastic_rt.collectors.timex import TimexStatus, read_timex
from elastic_rt.decisions import Response, RestartReason
from elastic_rt.metric_spec import WALL_CLOCK, Feed, Kind, MetricSpec, SpecMetrics
from elastic_rt.metrics.workers import WorkerCollector
from elastic_rt.worker_reports.heartbeat import Heartbeat

# elastic_rt_restarts_total{reason}: the series exported at zero from the start (rate() and alerts see each
# one): every reason the agent restarts its group for, and probe_failure, which the restart-storm runbook in
# docs/deploy.md names (a node that leaves is restarted by the others under peer_lost).
RESTART_REASONS: tuple[RestartReason, ...] = (
    *(r for r in RestartReason if r.response is Response.RESTART), RestartReason.PROBE_FAILURE)
# torch.distributed.elastic WorkerState names, lower-cased.
WORKER_STATES = ("unknown", "init", "healthy", "unhealthy", "stopped", "succeeded", "failed")

RENDEZVOUS_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300)
RECOVERY_BUCKETS_S = (1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600)
CHECKPOINT_SAVE_BUCKETS_S = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
CHECKPOINT_BLOCKED_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
NO_LABELS = ((),)  # `zeros` of a metric without labels of its own: its one series from the start

# AgentMetrics' events: each is a method of AgentMetrics with these keyword arguments.
EVENTS = frozenset({"rendezvous_started", "rendezvous", "restart", "recovered", "checkpoint", "probe",
                    "probe_failure"})

RENDEZVOUS = (
    MetricSpec(name="elastic_rt_world_size", kind=Kind.GAUGE, help="Workers (global ranks) in the current round.",
               fed_by=(Feed(event="rendezvous", value="world_size"),)),
    MetricSpec(name="elastic_rt_nodes", kind=Kind.GAUGE, help="Nodes (agents) in the current round.",
               fed_by=(Feed(event="rendezvous", value="nodes"),)),
    MetricSpec(name="elastic_rt_rendezvous_round", kind=Kind.GAUGE, help="Number of the current rendezvous round.",
               fed_by=(Feed(event="rendezvous", value="round"),)),
    MetricSpec(name="elastic_rt_rendezvous_rounds_total", kind=Kind.COUNTER,
               help="Rendezvous rounds this agent completed.", zeros=NO_LABELS,
               fed_by=(Feed(event="rendezvous"),)),
    MetricSpec(name="elastic_rt_rendezvous_duration_seconds", kind=Kind.HISTOGRAM,
               help="Time from joining a rendezvous to the round being complete.", buckets=RENDEZVOUS_BUCKETS_S,
               zeros=NO_LABELS, fed_by=(Feed(event="rendezvous", value="duration_s"),)),
    MetricSpec(name="elastic_rt_standby", kind=Kind.GAUGE,
               help="1 while this agent is in the rendezvous without a worker group (joining, or a hot spare "
                    "waiting for a place when --nnodes MAX is reached), 0 while its workers run. sum() counts "
                    "the spares.",
               doc="1 while the agent is in the rendezvous without a worker group (joining, or a hot spare "
                   "waiting for a place once `--nnodes` MAX nodes run), 0 while its workers run. `sum()` over "
                   "nodes counts the spares (see docs/warm-restarts.md).",
               fed_by=(Feed(event="rendezvous_started", value=1), Feed(event="rendezvous", value=0))),
    MetricSpec(name="elastic_rt_warm_workers_ready", kind=Kind.GAUGE,
               help="Pre-started workers (torch imported) ready to take a local rank at the next start.",
               doc="Pre-started workers ready to take a local rank at the next start (`--warm-workers on`)."),
)

RECOVERY = (
    MetricSpec(name="elastic_rt_restarts_total", kind=Kind.COUNTER, labels=("reason",),
               help="Worker group restarts, by what caused them.",
               doc="Worker group restarts by cause: `reason` is one of the [restart reasons](#restart-reasons) "
                   "that restart the group (" + ", ".join(f"`{r}`" for r in RESTART_REASONS) + "), each "
                   "exported at 0 from the start.",
               zeros=tuple((r.value,) for r in RESTART_REASONS), fed_by=(Feed(event="restart"),)),
    MetricSpec(name="elastic_rt_last_restart_timestamp_seconds", kind=Kind.GAUGE, labels=("reason",),
               help="Unix time of this agent's last worker group restart for the reason (absent before the first).",
               doc="Unix time of this agent's last restart for the reason; absent before the first. The greatest "
                   "across reasons and nodes is the job's last failure (`elastic-rt status` shows it).",
               fed_by=(Feed(event="restart", value=WALL_CLOCK),)),
    MetricSpec(name="elastic_rt_recovery_duration_seconds", kind=Kind.HISTOGRAM,
               help="Time from a failure being detected to the workers running again.", buckets=RECOVERY_BUCKETS_S,
               zeros=NO_LABELS, fed_by=(Feed(event="recovered", value="duration_s"),)),
    MetricSpec(name="elastic_rt_last_recovery_duration_seconds", kind=Kind.GAUGE,
               help="Duration of the most recent recovery.", fed_by=(Feed(event="recovered", value="duration_s"),)),
    MetricSpec(name="elastic_rt_worker_state", kind=Kind.GAUGE, labels=("local_rank", "state"),
               help="1 for the worker's current state, 0 for the others (torch elastic WorkerState).",
               doc="1 for the worker's current state, 0 for the others. `state`: "
                   + ", ".join(f"`{s}`" for s in WORKER_STATES)
                   + " (torch elastic `WorkerState`). Series of local ranks that no longer exist are removed."),
)

CHECKPOINTS = (
    MetricSpec(name="elastic_rt_checkpoint_save_duration_seconds", kind=Kind.HISTOGRAM,
               help="Time to write and commit a checkpoint, end to end (async part included).",
               doc="Time to write and commit a checkpoint end to end, asynchronous part included.",
               buckets=CHECKPOINT_SAVE_BUCKETS_S, zeros=NO_LABELS,
               fed_by=(Feed(event="checkpoint", value="save_duration_s"),)),
    MetricSpec(name="elastic_rt_checkpoint_blocked_seconds", kind=Kind.HISTOGRAM,
               help="Time training was blocked by a checkpoint save (the synchronous part).",
               doc="Time training was blocked by a save (the synchronous part).",
               buckets=CHECKPOINT_BLOCKED_BUCKETS_S, zeros=NO_LABELS,
               fed_by=(Feed(event="checkpoint", value="blocked_s"),)),
    MetricSpec(name="elastic_rt_checkpoint_last_committed_step", kind=Kind.GAUGE,
               help="Step of the last committed checkpoint.",
               doc="Step of the last committed checkpoint: what a restart resumes from.",
               fed_by=(Feed(event="checkpoint", value="step"),)),
    MetricSpec(name="elastic_rt_checkpoint_last_commit_timestamp_seconds", kind=Kind.GAUGE,
               help="Unix time the last checkpoint was committed.", doc="Unix time of that commit.",
               fed_by=(Feed(event="checkpoint", value=WALL_CLOCK),)),
)

PROBE = (
    MetricSpec(name="elastic_rt_probe_latency_seconds", kind=Kind.GAUGE,
               help="Latency of the last collective probe (small all-reduce).",
               fed_by=(Feed(event="probe", value="latency_s"),)),
    MetricSpec(name="elastic_rt_probe_bus_bandwidth_bytes_per_second", kind=Kind.GAUGE,
               help="Bus bandwidth of the last collective probe (nccl-tests busbw convention).",
               doc="Bus bandwidth of the last probe, nccl-tests `busbw` convention (algorithm bandwidth x "
                   "2(n-1)/n for all-reduce).",
               fed_by=(Feed(event="probe", value="bus_bandwidth_bytes_per_s"),)),
    MetricSpec(name="elastic_rt_probe_failures_total", kind=Kind.COUNTER,
               help="Collective probes that failed or timed out.", doc="Probes that failed or timed out.",
               zeros=NO_LABELS, fed_by=(Feed(event="probe_failure"),)),
)

ETCD = (
    MetricSpec(name="elastic_rt_etcd_up", kind=Kind.GAUGE,
               help="1 while this agent reaches etcd, 0 while it does not (workers keep running; membership "
                    "changes wait).",
               doc="1 while this agent reaches etcd, 0 while it does not. Workers keep running without etcd; "
                   "only membership changes wait for it (see docs/failure-model.md)."),
    MetricSpec(name="elastic_rt_etcd_unreachable_seconds_total", kind=Kind.COUNTER,
               help="Seconds this agent spent unable to reach etcd.",
               doc="Seconds this agent spent unable to reach etcd; grows during an outage, at scrape time."),
)

HEALTH = (
    MetricSpec(name="elastic_rt_health_check", kind=Kind.GAUGE, labels=("kind", "check"),
               help="1 while the named /livez or /readyz check passes, else 0.",
               doc="1 while the check passes, 0 while it fails. `kind`: `liveness` (`/livez`; check `monitor`) "
                   "or `readiness` (`/readyz`; checks `etcd`, `probe`, `rdma`, `clock`)."),
    MetricSpec(name="elastic_rt_agent_last_tick_age_seconds", kind=Kind.GAUGE,
               help="Seconds since the agent's monitor loop last ticked (it ticks while workers run).",
               doc="Seconds since the agent's monitor loop last ticked. It ticks every `--monitor-interval` "
                   "while workers run, not while the agent joins a rendezvous, restarts or waits at the exit "
                   "barrier, so it grows then. Absent before the first tick."),
)
HEALTH_CHECK_METRIC, LAST_TICK_AGE_METRIC = (spec.name for spec in HEALTH)


class AgentMetrics:
    """Every metric one agent exports; the agent calls the on_* methods as events happen, and each applies the
    Feeds of its event (RENDEZVOUS, RECOVERY, CHECKPOINTS, PROBE).

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
        self._metrics = SpecMetrics((*RENDEZVOUS, *RECOVERY, *CHECKPOINTS, *PROBE), registry=registry,
                                    run_id=run_id, node=node, wall_clock=wall_clock)
        unknown = self._metrics.events() - EVENTS
        if unknown:
            raise ValueError(f"metrics fed by events AgentMetrics does not have: {sorted(unknown)}")
        self.worker_state = self._metrics.metric["elastic_rt_worker_state"]
        self.clock = ClockMetrics(registry=registry, run_id=run_id, node=node, timex_reader=timex_reader)
        self.etcd = EtcdMetrics(registry=registry, run_id=run_id, node=node)
        registry.register(WorkerCollector(run_id=run_id, node=node, pids=worker_pids, heartbeats=heartbeats))
        if sysfs_root is not None:
            registry.register(RdmaCollector(sysfs_root=sysfs_root, const_labels={"run_id": run_id, "node": node}))
        self._worker_ranks: set[int] = set()

    # -- rendezvous -------------------------------------------------------------------
    def on_rendezvous_started(self) -> None:
        """The agent entered the rendezvous: no worker group until the round completes."""
        self._metrics.emit("rendezvous_started")

    def track_warm_workers(self, ready: Callable[[], int]) -> None:
        """Read the number of ready warm workers at scrape time."""
        self._metrics.metric["elastic_rt_warm_workers_ready"].labels(*self._base).set_function(ready)

    def on_rendezvous(self, *, round: int, world_size: int, nodes: int, duration_s: float) -> None:
        """A round completed: `nodes` agents, `world_size` workers, after `duration_s`."""
        self._metrics.emit("rendezvous", round=round, world_size=world_size, nodes=nodes, duration_s=duration_s)

    # -- failures -----------------------------------------------------------------------
    def on_restart(self, reason: RestartReason) -> None:
        """The worker group is being restarted; reason is one of RESTART_REASONS."""
        if reason not in RESTART_REASONS:
            raise ValueError(f"unknown restart reason {str(reason)!r}; expected one of "
                             f"{', '.join(RESTART_REASONS)}")
        self._metrics.emit("restart", reason=reason)

    def on_recovered(self, duration_s: float) -> None:
        """Workers run again, `duration_s` after the failure was detected."""
        self._metrics.emit("recovered", duration_s=duration_s)

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
        self._metrics.emit("checkpoint", step=step, save_duration_s=save_duration_s, blocked_s=blocked_s)

    # -- collective probe ---------------------------------------------------------------
    def on_probe(self, *, latency_s: float, bus_bandwidth_bytes_per_s: float | None = None) -> None:
        self._metrics.emit("probe", latency_s=latency_s, bus_bandwidth_bytes_per_s=bus_bandwidth_bytes_per_s)

    def on_probe_failure(self) -> None:
        self._metrics.emit("probe_failure")


# ---- health checks (/livez, /readyz) as metrics ---------------------------------------------------
class HealthCollector:
    """The /livez and /readyz checks as gauges (HEALTH), evaluated at scrape time like the endpoints.

    results() yields (kind, check, ok) with kind "liveness" or "readiness"; last_tick_age_s()
    gives the seconds since the agent's monitor loop last ticked (None before the first tick).
    """

    def __init__(self, *, run_id: str, node: str, results: Callable[[], Iterable[tuple[str, str, bool]]],
                 last_tick_age_s: Callable[[], float | None]) -> None:
        self._base = [run_id, node]
        self._results = results
        self._last_tick_age_s = last_tick_age_s

    @staticmethod
    def _families():
        return tuple(spec.family() for spec in HEALTH)

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


# ---- etcd reachability (fed by the rendezvous through observer.on_etcd) -------------------------
class EtcdMetrics:
    """ETCD: elastic_rt_etcd_up and elastic_rt_etcd_unreachable_seconds_total; the seconds grow at scrape
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

    @staticmethod
    def _families():
        return tuple(spec.family() for spec in ETCD)

    def collect(self):
        up, down = self._families()
        since = self._down_since
        up.add_metric(self._labels, 1.0 if since is None else 0.0)
        down.add_metric(self._labels, self._total_s + (0.0 if since is None else self._clock() - since))
        yield up
        yield down

    def describe(self):
        yield from self._families()
