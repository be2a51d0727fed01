"""What a run's etcd keys say, read in one transaction: the round, its members, each live node's alive/ value."""

from __future__ import annotations

import json
from dataclasses import dataclass

from elastic_rt.errors import ConfigError, ElasticRTError, RunNotFoundError
from elastic_rt.rendezvous.etcd_client import EtcdClient, KeyValue
from elastic_rt.rendezvous.keys import RunKeys


@dataclass(frozen=True, kw_only=True)
class NodeRecord:
    """One node as etcd knows it. `problem` says what of its keys could not be read."""

    node: str
    alive: bool = False
    addr: str | None = None
    metrics: str | None = None  # host:port of its agent's /metrics (absent: an older agent, or port 0)
    nnodes: tuple[int, int] | None = None  # its --nnodes MIN:MAX
    incarnation: str | None = None
    waiting: bool = False  # waiting/ key: it found a round running without it and waits for the next
    joined: bool = False  # join key of the current round
    problem: str | None = None


@dataclass(frozen=True, kw_only=True)
class RunState:
    """The run at one etcd revision."""

    run_id: str
    revision: int
    round: int | None  # None: no round key (nobody joined yet)
    formed: bool  # the current round has its final
    members: tuple[str, ...]  # of the current round if formed, else of the last round that formed
    members_round: int | None
    earlier_members: tuple[str, ...]  # of the round that formed before members_round (etcd keeps two)
    earlier_round: int | None
    closed_by: str | None  # the node that marked the run finished, "" if unknown; None while it runs
    nodes: dict[str, NodeRecord]
    problems: tuple[str, ...] = ()  # keys of the run that could not be read


def _json_object(kv: KeyValue) -> dict:
    value = json.loads(kv.value.decode())
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _alive_record(node: str, kv: KeyValue) -> NodeRecord:
    try:
        data = _json_object(kv)
        nnodes = data.get("nnodes")
        metrics = data.get("metrics")
        inc = data.get("incarnation")
        return NodeRecord(
            node=node, alive=True, addr=str(data["addr"]),
            metrics=metrics if isinstance(metrics, str) and metrics else None,
            nnodes=(int(nnodes[0]), int(nnodes[1])) if isinstance(nnodes, list) and len(nnodes) == 2 else None,
            incarnation=inc if isinstance(inc, str) else None)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        return NodeRecord(node=node, alive=True,
                          problem=f"its key {kv.key} holds {len(kv.value)} bytes status cannot read ({exc})")


def read_run_state(client: EtcdClient, run_id: str) -> RunState:
    """Every membership key of the run (not the worker stores), at one revision.

    Raises RunNotFoundError when the run has no key, ConfigError for a run of the etcd-v3-torch
    backend (its state is one pickled blob, which status does not unpickle), EtcdUnavailableError."""
    k = RunKeys(run_id)
    (rnd_kv, closed_kv, torch_state), (alive, waiting, finals, joins), revision = client.read_many(
        [k.round, k.closed, k.state], [k.alive_prefix, k.waiting_prefix, k.rounds_prefix, k.joins_prefix])
    if rnd_kv is None and torch_state is not None:
        raise ConfigError(f"run {run_id} uses --rdzv-backend etcd-v3-torch: its state is a pickled blob that "
                          "status does not read; status reads runs of the etcd-v3 backend")
    if rnd_kv is None and closed_kv is None and not (alive or waiting or finals or joins):
        raise RunNotFoundError(f"no run {run_id!r} in etcd (nothing under {k.base}); check --rdzv-id and "
                               "--rdzv-endpoint")
    problems: list[str] = []
    rnd: int | None = None
    if rnd_kv is not None:
        try:
            rnd = RunKeys.decode_round(rnd_kv)
        except ElasticRTError as exc:
            problems.append(str(exc))
    formed_rounds: dict[int, tuple[str, ...]] = {}
    for kv in finals:
        kind, number, _ = k.parse(kv.key)
        if kind != "final" or number is None:
            continue
        try:
            nodes = _json_object(kv).get("nodes")
            if not isinstance(nodes, list):
                raise ValueError("no list of nodes")
            formed_rounds[number] = tuple(str(n) for n in nodes)
        except (UnicodeDecodeError, ValueError) as exc:
            problems.append(f"the membership of round {number} ({kv.key}) cannot be read: {exc}")
    numbers = sorted(formed_rounds, reverse=True)
    formed = rnd is not None and rnd in formed_rounds
    members_round = numbers[0] if numbers else None
    earlier_round = numbers[1] if len(numbers) > 1 else None
    earlier = formed_rounds[earlier_round] if earlier_round is not None else ()
    records: dict[str, NodeRecord] = {}
    for kv in alive:
        _, _, node = k.parse(kv.key)
        if node:
            records[node] = _alive_record(node, kv)
    waiting_nodes = {n for kv in waiting if (n := k.parse(kv.key)[2])}
    joined = {node for kv in joins if (parsed := k.parse(kv.key))[0] == "join" and parsed[1] == rnd
              and (node := parsed[2])}
    known = set(records) | waiting_nodes | joined | set(formed_rounds.get(members_round, ())) | set(earlier)
    for node in sorted(known):
        base = records.get(node) or NodeRecord(node=node)
        records[node] = NodeRecord(**{**base.__dict__, "waiting": node in waiting_nodes, "joined": node in joined})
    closed_by = None
    if closed_kv is not None:
        try:
            closed_by = str(_json_object(closed_kv).get("by", ""))
        except (UnicodeDecodeError, ValueError):
            closed_by = ""
    return RunState(run_id=run_id, revision=revision, round=rnd, formed=formed,
                    members=formed_rounds.get(members_round, ()), members_round=members_round,
                    earlier_members=earlier, earlier_round=earlier_round, closed_by=closed_by,
                    nodes=dict(sorted(records.items())),
                    problems=tuple(problems))
