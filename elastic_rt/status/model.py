"""One screen of a job, decided in one place: each node's state from etcd, the numbers from its agent's /metrics."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping

from elastic_rt.decisions import RestartReason, Signal
from elastic_rt.status.agents import AgentReading
from elastic_rt.status.etcd_state import NodeRecord, RunState

# Restarts of one group happen at every node within the time it takes them to notice: a lease TTL or two.
# The last failure is the most recent restart of any node with the most recent restarts of the others
# within this window.
SAME_EVENT_S = 10.0
# Of the reasons the nodes give for one restart, the first here says what happened (round_advanced is
# what the other nodes see of a failure elsewhere).
REASON_ORDER = (RestartReason.WORKER_FAILURE, RestartReason.HANG, RestartReason.PROBE_FAILURE,
                RestartReason.PEER_LOST, RestartReason.SCALE_UP, RestartReason.ROUND_ADVANCED)
# a node's own workers failed (the reasons counted against --max-restarts): name that node
LOCAL_REASONS = tuple(r for r in RestartReason if r.counted)


class NodeState(str, Enum):
    """What a node is doing, from the run's etcd keys (and its agent's elastic_rt_standby)."""

    TRAINING = "training"  # a member of the round that formed last, its workers running
    RESTARTING = "restarting"  # a member whose agent has no worker group now (stopping, starting)
    JOINING = "joining"  # alive, in a rendezvous round that has not formed yet
    WAITING = "waiting"  # alive, the round runs without it, and the next round has room for it
    SPARE = "spare"  # alive, the round runs without it at --nnodes MAX: a hot spare
    LOST = "lost"  # a member of the current or the previous round whose lease is gone
    FINISHED = "finished"  # the run is closed and the agent left
    UNKNOWN = "unknown"  # its alive/ key holds what elastic-rt did not write


@dataclass(frozen=True, kw_only=True)
class NodeStatus:
    node: str
    state: NodeState
    rank: int | None = None  # group rank in the current round
    address: str | None = None  # where its agent serves /metrics
    answered: bool = False
    error: str | None = None  # why its agent gave no numbers
    activity: str | None = None  # the agent's own words (/livez check `monitor`), or why it is gone
    workers: int | None = None
    step: int | None = None
    step_time_s: float | None = None  # the slowest local rank's median step time (last window)
    steps_per_s: float | None = None
    goodput: float | None = None
    restarts: int | None = None
    stragglers: tuple[int, ...] = ()  # flagged local ranks
    failing: tuple[str, ...] = ()  # "check: reason" of each failing /livez or /readyz check


_RATIOS = ((Signal.STEP_TIME, "elastic_rt_step_time_ratio"), (Signal.COMPUTE, "elastic_rt_compute_time_ratio"))


@dataclass(frozen=True, kw_only=True)
class Straggler:
    node: str
    local_rank: int
    ratio: float | None  # the larger of its step-time and compute-time ratios to the job's medians
    signal: Signal | None = None  # which of the two that is


@dataclass(frozen=True, kw_only=True)
class LastFailure:
    at: float  # Unix time (the agents' clocks)
    age_s: float
    reason: str  # what happened (REASON_ORDER's first among the nodes' reasons)
    seen_by: tuple[str, ...]  # nodes that restarted for it
    failed_node: str | None  # whose worker failed (worker_failure, hang)
    cause: str | None  # that worker's failure cause (docs/failures.md)
    lost: tuple[str, ...]  # nodes etcd shows as lost now


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    run_id: str
    generated_at: float
    etcd_revision: int
    round: int | None
    formed: bool
    finished: bool
    world_size: int | None
    members: tuple[str, ...]
    nnodes: tuple[int, int] | None  # --nnodes MIN:MAX, as the live agents advertise it
    alive: int  # nodes with a lease
    nodes: tuple[NodeStatus, ...]
    answering: int  # agents that answered
    goodput: float | None  # (productive + uncommitted) / wall time, node-seconds of the answering agents
    checkpoint_step: int | None
    checkpoint_age_s: float | None
    restarts: dict[str, int]  # by reason, at the busiest node
    last_failure: LastFailure | None
    stragglers: tuple[Straggler, ...]
    problems: tuple[str, ...]


def node_state(rec: NodeRecord, run: RunState, reading: AgentReading | None) -> NodeState:
    if not rec.alive:
        return NodeState.FINISHED if run.closed_by is not None else NodeState.LOST
    if rec.problem:
        return NodeState.UNKNOWN
    if run.formed and rec.node in run.members:
        standby = reading.value("elastic_rt_standby") if reading is not None and reading.answered else None
        return NodeState.RESTARTING if standby == 1 else NodeState.TRAINING
    if not run.formed:
        return NodeState.JOINING
    if rec.nnodes is not None and len(run.members) >= rec.nnodes[1]:
        return NodeState.SPARE
    return NodeState.WAITING if rec.waiting else NodeState.JOINING


def _gone(rec: NodeRecord, run: RunState) -> str:
    if run.closed_by is not None:
        return "left: the run is finished"
    rnd = run.members_round if rec.node in run.members else run.earlier_round
    return f"its lease is gone (the agent died, stopped or lost etcd); was a member of round {rnd}"


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _sum(reading: AgentReading, name: str, **match: str) -> float | None:
    found = [v for _, v in reading.values(name, **match)]
    return sum(found) if found else None


def _node(rec: NodeRecord, run: RunState, reading: AgentReading | None) -> NodeStatus:
    state = node_state(rec, run, reading)
    rank = run.members.index(rec.node) if run.formed and rec.node in run.members else None
    if reading is None or not reading.answered:
        if reading is not None:
            address, error = reading.address, f"not answering: {reading.error}"
        else:
            address, error = rec.metrics, rec.problem or (None if not rec.alive else (
                "no /metrics address in its alive/ key (--metrics-port 0, or an agent older than elastic-rt status)"))
        return NodeStatus(node=rec.node, state=state, rank=rank, address=address, error=error,
                          activity=None if rec.alive else _gone(rec, run))
    step_time = reading.value("elastic_rt_step_time_seconds")
    monitor = next((c for c in reading.liveness if c.name == "monitor"), None)
    workers = {labels.get("local_rank") for labels, _ in reading.values("elastic_rt_worker_state")}
    flagged = sorted(int(labels["local_rank"]) for labels, v in reading.values("elastic_rt_straggler")
                     if v == 1 and labels.get("local_rank", "").isdigit())
    return NodeStatus(
        node=rec.node, state=state, rank=rank, address=reading.address, answered=True, error=None,
        activity=monitor.reason if monitor else None, workers=len(workers) or None,
        step=_int(reading.value("elastic_rt_worker_last_step")), step_time_s=step_time,
        steps_per_s=1.0 / step_time if step_time else None, goodput=reading.value("elastic_rt_goodput_ratio"),
        restarts=_int(_sum(reading, "elastic_rt_restarts_total")), stragglers=tuple(flagged),
        failing=tuple(f"{c.name}: {c.reason}" for c in (*reading.liveness, *reading.readiness) if not c.ok))


def _last_failure(readings: Mapping[str, AgentReading], lost: tuple[str, ...], now: float) -> LastFailure | None:
    restarts = []  # each node's most recent restart: (time, reason, node)
    for node, r in readings.items():
        stamps = [(v, labels.get("reason", "?"))
                  for labels, v in r.values("elastic_rt_last_restart_timestamp_seconds")]
        if r.answered and stamps:
            restarts.append((*max(stamps), node))
    if not restarts:
        return None
    latest = max(t for t, _, _ in restarts)
    event = [(t, reason, node) for t, reason, node in restarts if t >= latest - SAME_EVENT_S]
    reasons = {reason for _, reason, _ in event}
    reason = str(next((r for r in REASON_ORDER if r in reasons), sorted(reasons)[0]))
    failed_node = cause = None
    if reason in LOCAL_REASONS:
        failed_node = max((t, node) for t, r, node in event if r == reason)[1]
        causes = readings[failed_node].values("elastic_rt_last_worker_failure_timestamp_seconds")
        if causes:
            cause = max(causes, key=lambda item: item[1])[0].get("cause")
    return LastFailure(at=latest, age_s=max(0.0, now - latest), reason=reason,
                       seen_by=tuple(sorted({node for _, _, node in event})), failed_node=failed_node, cause=cause,
                       lost=lost)


def _straggler(node: str, rank: int, reading: AgentReading) -> Straggler:
    """A flagged rank with the ratio that flagged it: in a lock-step job every rank's step time is the
    slowest one's, so a slow rank stands out only by its compute time."""
    ratios = {signal: v for signal, name in _RATIOS
              if (v := reading.value(name, local_rank=str(rank))) is not None}
    if not ratios:
        return Straggler(node=node, local_rank=rank, ratio=None)
    signal = max(ratios, key=ratios.get)
    return Straggler(node=node, local_rank=rank, ratio=ratios[signal], signal=signal)


def _goodput(readings: list[AgentReading]) -> float | None:
    held = wall = 0.0
    for r in readings:
        total = _sum(r, "elastic_rt_goodput_seconds_total")
        if total is None:
            continue
        uncommitted = r.value("elastic_rt_goodput_uncommitted_seconds") or 0.0
        held += (r.value("elastic_rt_goodput_seconds_total", category="productive") or 0.0) + uncommitted
        wall += total + uncommitted
    return held / wall if wall > 0 else None


def build(run: RunState, readings: Mapping[str, AgentReading], *, now: float) -> JobStatus:
    """The job as `elastic-rt status` shows it; `now` is the Unix time the ages are computed against."""
    nodes = tuple(_node(rec, run, readings.get(rec.node)) for rec in run.nodes.values())
    answered = {n: r for n, r in readings.items() if r.answered}
    members = [answered[n] for n in run.members if n in answered]
    world = [r.value("elastic_rt_world_size") for r in members
             if run.members_round is not None and r.value("elastic_rt_rendezvous_round") == run.members_round]
    commit_times = [t for r in answered.values()
                    if (t := r.value("elastic_rt_checkpoint_last_commit_timestamp_seconds"))]
    steps = [s for r in answered.values() if (s := r.value("elastic_rt_checkpoint_last_committed_step")) is not None]
    busiest: dict[str, int] = {}
    for r in answered.values():
        by_reason = {labels.get("reason", "?"): int(v) for labels, v in r.values("elastic_rt_restarts_total") if v}
        if sum(by_reason.values()) > sum(busiest.values()):
            busiest = by_reason
    stragglers = tuple(_straggler(n.node, rank, answered[n.node]) for n in nodes for rank in n.stragglers)
    lost = tuple(n.node for n in nodes if n.state is NodeState.LOST)
    advertised = [rec.nnodes for rec in run.nodes.values() if rec.alive and rec.nnodes]
    return JobStatus(
        run_id=run.run_id, generated_at=now, etcd_revision=run.revision, round=run.round, formed=run.formed,
        finished=run.closed_by is not None, world_size=_int(max((w for w in world if w is not None), default=None)),
        members=run.members, nnodes=max(set(advertised), key=advertised.count) if advertised else None,
        alive=sum(rec.alive for rec in run.nodes.values()), nodes=nodes, answering=len(answered),
        goodput=_goodput(list(answered.values())),
        checkpoint_step=_int(max(steps, default=None)),
        checkpoint_age_s=max(0.0, now - max(commit_times)) if commit_times else None,
        restarts=dict(sorted(busiest.items(), key=lambda kv: -kv[1])), last_failure=_last_failure(answered, lost, now),
        stragglers=stragglers,
        problems=run.problems + tuple(f"node {rec.node}: {rec.problem}" for rec in run.nodes.values() if rec.problem))
