"""etcd reachability bookkeeping, the retry backoff, and the etcd metrics: pure logic, an injected clock."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from elastic_rt.metrics.definitions import EtcdMetrics
from elastic_rt.rendezvous.etcd_reachability import Backoff, EtcdHealth


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_backoff_doubles_to_its_cap_with_jitter_in_the_upper_half():
    lo = Backoff(base_s=0.1, cap_s=2.0, rng=lambda: 0.0)
    assert [round(lo.next(), 3) for _ in range(7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    hi = Backoff(base_s=0.1, cap_s=2.0, rng=lambda: 1.0)
    assert [round(hi.next(), 3) for _ in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    hi.reset()
    assert hi.next() == 0.1


def test_health_transitions_are_reported_once_each_and_outages_remembered(caplog):
    clock, seen = Clock(), []
    h = EtcdHealth(node_id="n", clock=clock)
    h.add_listener(seen.append)
    assert seen == [True] and h.up
    h.success()
    clock.t = 110.0
    h.failure("no answer within 1 s")
    h.failure("no answer within 1 s")
    assert seen == [True, False] and not h.up
    clock.t = 117.5
    assert h.down_for_s() == 7.5
    assert h.unreachable_since(50.0) and h.last_recovery() is None
    h.success()
    assert seen == [True, False, True] and h.up
    assert h.last_recovery() == 117.5
    assert h.unreachable_since(117.0) and not h.unreachable_since(118.0)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("etcd unreachable" in m for m in lines) == 1
    assert any("etcd reachable again after 7.5 s" in m for m in lines)


def test_etcd_metrics_count_seconds_while_down_at_scrape_time():
    clock, reg = Clock(), CollectorRegistry()
    m = EtcdMetrics(registry=reg, run_id="r", node="n", clock=clock)
    labels = {"run_id": "r", "node": "n"}
    assert reg.get_sample_value("elastic_rt_etcd_up", labels) == 1.0
    assert reg.get_sample_value("elastic_rt_etcd_unreachable_seconds_total", labels) == 0.0
    m.on_etcd(False)
    clock.t += 4.0
    assert reg.get_sample_value("elastic_rt_etcd_up", labels) == 0.0
    assert reg.get_sample_value("elastic_rt_etcd_unreachable_seconds_total", labels) == 4.0
    clock.t += 1.0
    m.on_etcd(True)
    clock.t += 10.0
    assert reg.get_sample_value("elastic_rt_etcd_unreachable_seconds_total", labels) == 5.0
    assert reg.get_sample_value("elastic_rt_etcd_up", labels) == 1.0
