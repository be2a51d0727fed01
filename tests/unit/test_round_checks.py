"""RoundChecks: a probe failure counts for the round it happened in, and only until a probe succeeds."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry

from elastic_rt.collectors.schedule import RoundChecks
from elastic_rt.metrics.definitions import AgentMetrics


class _FailingStore:
    def set(self, key, value):
        raise RuntimeError("store gone")

    def get(self, key):
        raise RuntimeError("store gone")


def _checks() -> tuple[RoundChecks, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry=registry, run_id="r", node="n", sysfs_root=None, timex_reader=None)
    return RoundChecks(node="n", metrics=metrics, stop=threading.Event()), registry


def test_failure_of_the_current_round_is_reported_with_its_reason():
    checks, registry = _checks()
    checks.on_round(round=4, store=None, group_rank=0, group_world_size=1)  # one node: no probe
    assert checks.probe_failure() is None
    checks._probe_once(4, _FailingStore(), 0, 2, "127.0.0.1", 0)
    assert "store gone" in checks.probe_failure()
    assert registry.get_sample_value("elastic_rt_probe_failures_total", {"run_id": "r", "node": "n"}) == 1


def test_failure_of_an_outdated_round_says_nothing():
    checks, registry = _checks()
    checks.on_round(round=5, store=None, group_rank=0, group_world_size=1)
    checks._probe_once(4, _FailingStore(), 0, 2, "127.0.0.1", 0)
    assert checks.probe_failure() is None
    assert registry.get_sample_value("elastic_rt_probe_failures_total", {"run_id": "r", "node": "n"}) == 0
    checks.round = 6  # a failure recorded in round 5 no longer counts once round 6 runs
    checks.probe_failed_round = 5
    assert checks.probe_failure() is None
