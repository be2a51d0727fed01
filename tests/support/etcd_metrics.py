"""What an etcd member says it served, from its own /metrics: gRPC messages received and streams started, by method,
and watch events sent. Used by the tests that count a rendezvous's requests at etcd."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class GrpcCounts:
    received: dict[str, float] = field(default_factory=dict)  # grpc_server_msg_received_total by method
    started: dict[str, float] = field(default_factory=dict)  # grpc_server_started_total by method (a stream: one)
    events: float = 0.0  # etcd_debugging_mvcc_events_total: watch events sent
    watchers: float = 0.0  # etcd_debugging_mvcc_watcher_total (a gauge): the watchers etcd holds now


def grpc_counts(member) -> GrpcCounts:
    """The member's counters now (an EtcdCluster member: its client endpoint serves /metrics)."""
    with urllib.request.urlopen(f"http://{member.endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = GrpcCounts()
    for fam in text_string_to_metric_families(text):
        by_method = {"grpc_server_msg_received": out.received, "grpc_server_started": out.started}.get(fam.name)
        for s in fam.samples:
            if s.name == "etcd_debugging_mvcc_watcher_total":
                out.watchers = s.value
            if not s.name.endswith("_total"):
                continue
            if by_method is not None:
                method = s.labels["grpc_method"]
                by_method[method] = by_method.get(method, 0.0) + s.value
            elif fam.name == "etcd_debugging_mvcc_events":
                out.events += s.value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What changed between two counter maps (the keys that moved)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
