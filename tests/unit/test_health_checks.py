"""The health-check registry, the monitor-loop liveness rule (injected clock), the readiness checks on
their injected data sources, and the observer that feeds them and exports them as metrics."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from elastic_rt.collectors.clock import SkewEstimate
from elastic_rt.collectors.rdma import RdmaCollector
from elastic_rt.collectors.timex import TimexStatus
from elastic_rt.errors import HealthCheckError
from elastic_rt.metrics import health_endpoints as health
from elastic_rt.checks.model import CheckResult
from elastic_rt.metrics.health_endpoints import (
    LIVENESS,
    READINESS,
    HealthChecks,
    MonitorLiveness,
    liveness_threshold_s,
    render,
)
from elastic_rt.metrics.metrics_observer import MetricsObserver
from elastic_rt.metrics.readiness import EtcdReachability, clock_check, etcd_check, probe_check, rdma_check
from elastic_rt.worker_reports.inbox import WorkerReports
from tests.support.clock import FakeClock

FIXTURE_SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"


# ---- registry and answers -----------------------------------------------------------------
def test_registry_runs_checks_in_order_and_validates_names():
    checks = HealthChecks(READINESS, [("b", lambda: (True, "fine")), ("a", lambda: CheckResult.of(False, "x\n  y"))])
    assert checks.endpoint == "readyz" and checks.names() == ["b", "a"]
    fine, xy = CheckResult.of(True, "fine", name="b"), CheckResult.of(False, "x y", name="a")
    assert checks.run() == [("b", fine), ("a", xy)]
    assert checks.run(only="a") == [("a", xy)]
    assert checks.run(exclude=["b", "unknown"]) == [("a", xy)]
    with pytest.raises(ValueError, match="already registered"):
        checks.add("a", lambda: (True, ""))
    for bad in ("Probe", "rdma port", "", "1x", "a/b"):
        with pytest.raises(ValueError, match="lower case"):
            checks.add(bad, lambda: (True, ""))
    with pytest.raises(ValueError, match="kind"):
        HealthChecks("startup")


def test_a_raising_check_fails_alone_with_a_one_line_bounded_reason():
    def boom():
        raise OSError("line one\nline two " + "x" * 1000)

    results = dict(HealthChecks(LIVENESS, [("boom", boom), ("ok", lambda: (True, "ok"))]).run())
    assert not results["boom"].ok and results["ok"].ok
    assert results["boom"].detail.startswith("check raised OSError: line one line two x")
    assert "\n" not in results["boom"].detail and len(results["boom"].detail) <= health.REASON_MAX_CHARS


def test_render_formats():
    ok, bad = CheckResult.of(True, "fine"), CheckResult.of(False, "probe timed out")
    assert render("readyz", [("a", ok)], verbose=False) == (200, "ok\n")
    assert render("readyz", [], verbose=False) == (200, "ok\n")
    assert render("readyz", [("a", ok), ("b", bad), ("c", bad)], verbose=False) == (
        503, "b failed: probe timed out; c failed: probe timed out\n")
    assert render("livez", [("a", ok), ("b", bad)], verbose=True) == (
        503, "[+]a ok: fine\n[-]b failed: probe timed out\nlivez check failed\n")
    assert render("livez", [("a", ok)], verbose=True) == (200, "[+]a ok: fine\nlivez check passed\n")


# ---- liveness: the monitor loop -----------------------------------------------------------
def test_liveness_threshold_rule():
    assert liveness_threshold_s(0.1) == 30.0  # the default --monitor-interval
    assert liveness_threshold_s(1.0) == 50.0
    assert liveness_threshold_s(5.0) == 250.0


def test_monitor_liveness_fails_only_while_running_without_ticks():
    clock = FakeClock(1000.0)
    m = MonitorLiveness(threshold_s=30.0, clock=clock)
    # joining a rendezvous that waits for nodes is not a wedged agent, however long it takes
    clock.now += 600
    r = m.check()
    assert r.ok and r.detail == "joining the rendezvous for 600 s"
    assert m.last_tick_age_s() is None
    m.on_workers_started()
    clock.now += 10
    assert m.check() == CheckResult.of(True, "workers started 10.0 s ago")
    m.on_tick()
    clock.now += 0.1
    assert m.check() == CheckResult.of(True, "monitor loop ticked 0.1 s ago")
    clock.now += 29.9
    assert m.check().ok  # exactly at the threshold: still alive
    clock.now += 0.2
    r = m.check()
    assert not r.ok
    assert r.detail == "monitor loop last ticked 30.2 s ago (limit 30 s): the agent is wedged"
    assert m.last_tick_age_s() == pytest.approx(30.2)
    m.on_tick()  # the loop comes back
    assert m.check().ok


def test_monitor_liveness_during_restart_and_exit_barrier():
    clock = FakeClock(1000.0)
    m = MonitorLiveness(threshold_s=30.0, clock=clock)
    m.on_workers_started()
    m.on_tick()
    m.on_restart("peer_lost")
    clock.now += 120  # stopping the workers and a new rendezvous: no ticks, not wedged
    assert m.check() == CheckResult.of(True, "restarting the workers (peer lost) for 120 s")
    m.on_workers_started()  # the deadline counts from the restart, not from the old last tick
    clock.now += 29
    assert m.check() == CheckResult.of(True, "workers started 29.0 s ago")
    clock.now += 2
    r = m.check()
    assert not r.ok and "has not ticked since the workers started, 31.0 s ago" in r.detail
    m.on_tick()
    m.on_workers_finished("succeeded")
    clock.now += 200
    assert m.check() == CheckResult.of(True, "workers succeeded; waiting for the other nodes for 200 s")
    with pytest.raises(ValueError):
        MonitorLiveness(threshold_s=0)


# ---- readiness checks -----------------------------------------------------------------------
def test_probe_check_names_the_round_and_the_error():
    src = SimpleNamespace(round=3, last_probe=None, failure=None)
    src.probe_failure = lambda: src.failure
    check = probe_check(src)
    assert check() == CheckResult.of(True, "no probe yet (it runs after each rendezvous of 2 or more nodes)")
    src.last_probe = SimpleNamespace(backend="gloo", nbytes=4096, world_size=2, latency_s=0.00125)
    assert check() == CheckResult.of(True, "gloo all-reduce of 4096 bytes over 2 nodes in 1.25 ms")
    src.failure = "collective probe failed: timed out after 0.01 s"
    assert check() == CheckResult.of(False, "round 3: collective probe failed: timed out after 0.01 s")
    assert probe_check(src, enabled=False)() == CheckResult.of(True, "off (--probe-bytes 0)")


def test_rdma_check_on_the_fixture_sysfs(tmp_path):
    check = rdma_check(RdmaCollector(sysfs_root=str(FIXTURE_SYSFS)).read_ports, {})
    r = check()
    assert not r.ok
    assert r.detail == "mlx5_1 port 1 is DOWN (state 1), physical Polling (1 of 2 ports not active)"
    assert rdma_check(RdmaCollector(sysfs_root=str(tmp_path)).read_ports, {})() == CheckResult.of(
        True, "no RDMA devices on this node")
    active = [p for p in RdmaCollector(sysfs_root=str(FIXTURE_SYSFS)).read_ports() if p.device == "mlx5_0"]
    assert rdma_check(lambda: active, {})() == CheckResult.of(True, "1 port(s) active")


@pytest.mark.parametrize("env, ok, words", [
    ({}, False, "mlx5_1 port 1 is DOWN"),
    ({"NCCL_IB_HCA": "mlx5_0"}, True, "1 port(s) active (1 not selected by NCCL_IB_HCA)"),
    ({"NCCL_IB_HCA": "^mlx5_1"}, True, "1 not selected by NCCL_IB_HCA"),
    ({"NCCL_IB_HCA": "=mlx5_1:1"}, False, "(1 of 1 ports not active; 1 not selected by NCCL_IB_HCA)"),
    ({"NCCL_IB_DISABLE": "1"}, True, "unused: NCCL_IB_DISABLE=1"),
    ({"NCCL_IB_HCA": "mlx4"}, True, "NCCL_IB_HCA=mlx4 selects none of the 2 ports"),
])
def test_readyz_rdma_honours_nccl_ib_hca_on_an_injected_sysfs(monkeypatch, env, ok, words):
    """/readyz's rdma check as the launcher registers it (its sysfs root injected, the agent's environment read
    by the composition root) judges only the ports NCCL would use, and agrees with doctor's rdma row."""
    from elastic_rt.metrics.readiness import add_readiness_checks
    from elastic_rt.doctor.net import check_rdma

    for var in ("NCCL_IB_HCA", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    readiness = HealthChecks(READINESS)
    add_readiness_checks(readiness, SimpleNamespace(round=0, last_probe=None, last_skew=None, probe_failure=lambda: None),
                         sysfs_root=str(FIXTURE_SYSFS), probe_enabled=False)
    [(_, result)] = readiness.run(only="rdma")
    assert result.ok is ok and words in result.detail
    status, body = render("readyz", readiness.run(only="rdma"), verbose=False)
    assert status == (200 if ok else 503)
    ports = RdmaCollector(sysfs_root=str(FIXTURE_SYSFS)).read_ports()
    assert check_rdma(ports, env).failed is not ok


def _timex(synchronized: bool) -> TimexStatus:
    return TimexStatus(synchronized=synchronized, unsync_flag=not synchronized, offset_s=0.0,
                       estimated_error_s=0.0, max_error_s=16.0, frequency_adjustment_ratio=1.0, tick_s=0.01,
                       status=0, state=0)


def test_clock_check_fails_on_skew_and_only_reports_the_kernel_state():
    skew = {"est": None}
    timex = {"st": _timex(False)}
    check = clock_check(lambda: skew["est"], lambda: timex["st"])
    r = check()
    assert r.ok and "no skew measured" in r.detail and "kernel clock not synchronized (max error 16 s)" in r.detail
    skew["est"] = SkewEstimate(offset_s=0.004, round_trip_s=0.001, error_bound_s=0.0005, samples=8)
    timex["st"] = _timex(True)
    assert check() == CheckResult.of(True, "skew vs rank 0 +4.0 ms; kernel clock synchronized")
    skew["est"] = SkewEstimate(offset_s=-9.0, round_trip_s=0.001, error_bound_s=0.0005, samples=8)
    r = check()
    assert not r.ok and r.detail.startswith("clock skew vs rank 0 is -9.000 s, 60% of the 15 s tolerance")

    def denied() -> TimexStatus:
        raise HealthCheckError("adjtimex: operation not permitted")

    skew["est"] = None
    r = clock_check(lambda: skew["est"], denied)()
    assert r.ok and "kernel state unreadable (adjtimex: operation not permitted)" in r.detail


def test_etcd_reachability_from_on_etcd_reports():
    clock = FakeClock(1000.0)
    etcd = EtcdReachability(clock=clock)
    check = etcd_check(etcd.status)
    assert check() == CheckResult.of(True, "no report from the rendezvous yet")
    etcd.on_etcd(False)
    clock.now += 12
    etcd.on_etcd(False)  # repeated reports do not reset the duration
    r = check()
    assert not r.ok and r.detail.startswith("unreachable for 12 s; training goes on")
    etcd.on_etcd(True)
    clock.now += 3
    assert check() == CheckResult.of(True, "reachable for 3 s")


# ---- the observer feeds them and exports them -------------------------------------------------
def test_observer_events_drive_liveness_and_the_health_metrics(tmp_path):
    clock = FakeClock(1000.0)
    obs = MetricsObserver(run_id="r", node="n", reports=WorkerReports(str(tmp_path)), sysfs_root=None,
                          liveness_threshold_s=30.0, clock=clock)
    obs.readiness.add("probe", lambda: (False, "round 1: timed out"))
    labels = {"run_id": "r", "node": "n"}

    def gauge(kind: str, check: str) -> float | None:
        return obs.registry.get_sample_value("elastic_rt_health_check", {**labels, "kind": kind, "check": check})

    assert obs.liveness.names() == ["monitor"] and obs.readiness.names() == ["etcd", "probe"]
    assert gauge("liveness", "monitor") == 1.0
    assert gauge("readiness", "etcd") == 1.0 and gauge("readiness", "probe") == 0.0
    assert obs.registry.get_sample_value("elastic_rt_agent_last_tick_age_seconds", labels) is None
    obs.on_workers_started({0: 111})
    obs.on_tick()
    clock.now += 5
    assert obs.registry.get_sample_value("elastic_rt_agent_last_tick_age_seconds", labels) == 5.0
    clock.now += 26
    assert gauge("liveness", "monitor") == 0.0
    obs.on_restart("worker_failure")
    assert gauge("liveness", "monitor") == 1.0
    obs.on_etcd(False)
    assert gauge("readiness", "etcd") == 0.0
    obs.on_etcd(True)
    assert gauge("readiness", "etcd") == 1.0
