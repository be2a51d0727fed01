"""AgentMetrics and the per-worker collector, each in its own CollectorRegistry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from elastic_rt.worker_reports.heartbeat import Heartbeat
from elastic_rt.metrics.definitions import RESTART_REASONS, WORKER_STATES, AgentMetrics
from elastic_rt.collectors.timex import read_timex
from elastic_rt.metrics.workers import WorkerCollector

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
BASE = {"run_id": "job7", "node": "node-a"}


def make(**kw) -> tuple[AgentMetrics, CollectorRegistry]:
    reg = CollectorRegistry()
    kw.setdefault("sysfs_root", None)
    kw.setdefault("timex_reader", None)
    return AgentMetrics(registry=reg, run_id="job7", node="node-a", **kw), reg


def test_rendezvous_metrics():
    m, reg = make()
    m.on_rendezvous(round=3, world_size=16, nodes=2, duration_s=1.7)
    m.on_rendezvous(round=4, world_size=8, nodes=1, duration_s=40.0)
    assert reg.get_sample_value("elastic_rt_world_size", BASE) == 8
    assert reg.get_sample_value("elastic_rt_nodes", BASE) == 1
    assert reg.get_sample_value("elastic_rt_rendezvous_round", BASE) == 4
    assert reg.get_sample_value("elastic_rt_rendezvous_rounds_total", BASE) == 2
    assert reg.get_sample_value("elastic_rt_rendezvous_duration_seconds_count", BASE) == 2
    assert reg.get_sample_value("elastic_rt_rendezvous_duration_seconds_sum", BASE) == pytest.approx(41.7)
    assert reg.get_sample_value("elastic_rt_rendezvous_duration_seconds_bucket", {**BASE, "le": "2.5"}) == 1


def test_restarts_by_reason_start_at_zero():
    m, reg = make()
    for reason in RESTART_REASONS:
        assert reg.get_sample_value("elastic_rt_restarts_total", {**BASE, "reason": reason}) == 0
    m.on_restart("peer_lost")
    m.on_restart("peer_lost")
    m.on_restart("hang")
    assert reg.get_sample_value("elastic_rt_restarts_total", {**BASE, "reason": "peer_lost"}) == 2
    assert reg.get_sample_value("elastic_rt_restarts_total", {**BASE, "reason": "hang"}) == 1
    with pytest.raises(ValueError, match="unknown restart reason"):
        m.on_restart("cosmic_ray")


def test_recovery_histogram_and_last_value():
    m, reg = make()
    m.on_recovered(12.5)
    m.on_recovered(3.0)
    assert reg.get_sample_value("elastic_rt_recovery_duration_seconds_count", BASE) == 2
    assert reg.get_sample_value("elastic_rt_recovery_duration_seconds_bucket", {**BASE, "le": "15.0"}) == 2
    assert reg.get_sample_value("elastic_rt_recovery_duration_seconds_bucket", {**BASE, "le": "10.0"}) == 1
    assert reg.get_sample_value("elastic_rt_last_recovery_duration_seconds", BASE) == 3.0


def test_worker_state_is_one_hot_and_shrinks_with_the_group():
    m, reg = make()
    m.set_worker_states({0: "HEALTHY", 1: "healthy", 2: "init"})
    m.on_worker_state(1, "failed")

    def state(rank: int, s: str) -> float | None:
        return reg.get_sample_value("elastic_rt_worker_state", {**BASE, "local_rank": str(rank), "state": s})

    assert state(0, "healthy") == 1 and state(0, "failed") == 0
    assert state(1, "failed") == 1 and state(1, "healthy") == 0
    assert sum(state(2, s) for s in WORKER_STATES) == 1
    m.set_worker_states({0: "healthy"})
    assert state(1, "failed") is None and state(2, "init") is None
    with pytest.raises(ValueError):
        m.on_worker_state(0, "sleepy")


def test_checkpoint_and_probe_metrics():
    m, reg = make(wall_clock=lambda: 1_700_000_000.0)
    m.on_checkpoint(step=500, save_duration_s=8.0, blocked_s=0.3)
    m.on_probe(latency_s=0.0004, bus_bandwidth_bytes_per_s=1.8e11)
    m.on_probe_failure()
    assert reg.get_sample_value("elastic_rt_checkpoint_last_committed_step", BASE) == 500
    assert reg.get_sample_value("elastic_rt_checkpoint_last_commit_timestamp_seconds", BASE) == 1.7e9
    assert reg.get_sample_value("elastic_rt_checkpoint_save_duration_seconds_sum", BASE) == 8.0
    assert reg.get_sample_value("elastic_rt_checkpoint_blocked_seconds_sum", BASE) == 0.3
    assert reg.get_sample_value("elastic_rt_probe_latency_seconds", BASE) == 0.0004
    assert reg.get_sample_value("elastic_rt_probe_bus_bandwidth_bytes_per_second", BASE) == 1.8e11
    assert reg.get_sample_value("elastic_rt_probe_failures_total", BASE) == 1


def test_worker_resources_and_heartbeats_read_at_scrape_time():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        pids = {0: os.getpid(), 1: child.pid, 2: 2**22 + 12345}  # rank 2: no such process
        beats = {0: Heartbeat(pid=1, seq=9, step=99, timestamp_s=1.0, age_s=2.5), 1: None}
        m, reg = make(worker_pids=lambda: pids, heartbeats=lambda: beats)
        r0 = {**BASE, "local_rank": "0"}
        r1 = {**BASE, "local_rank": "1"}
        rss0 = reg.get_sample_value("elastic_rt_worker_resident_memory_bytes", r0)
        assert rss0 is not None and rss0 > 10 * 2**20  # this pytest process (plus its child)
        assert reg.get_sample_value("elastic_rt_worker_resident_memory_bytes", r1) > 0
        assert reg.get_sample_value("elastic_rt_worker_cpu_seconds_total", r0) > 0
        assert reg.get_sample_value("elastic_rt_worker_resident_memory_bytes", {**BASE, "local_rank": "2"}) is None
        assert reg.get_sample_value("elastic_rt_worker_last_step", r0) == 99
        assert reg.get_sample_value("elastic_rt_worker_last_step_age_seconds", r0) == 2.5
        assert reg.get_sample_value("elastic_rt_worker_last_step", r1) is None
    finally:
        child.communicate(b"", timeout=30)


@pytest.mark.parametrize("children_files", [True, False], ids=["proc-children", "process-scan"])
def test_descendants_are_added_to_their_worker(tmp_path, children_files):
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout.readline() == b"ready\n"  # fully started: its RSS is settled
        pids = {0: os.getpid(), 1: child.pid}
        proc_root = "/proc" if children_files else str(tmp_path)  # no children files there: fallback
        with_kids = WorkerCollector(run_id="job7", node="node-a", pids=lambda: pids, proc_root=proc_root)
        alone = WorkerCollector(run_id="job7", node="node-a", pids=lambda: pids, include_descendants=False)
        assert with_kids._children_files is children_files
        reg, reg_alone = CollectorRegistry(), CollectorRegistry()
        reg.register(with_kids)
        reg_alone.register(alone)

        def rss(registry: CollectorRegistry, rank: int) -> float:
            labels = {**BASE, "local_rank": str(rank)}
            return registry.get_sample_value("elastic_rt_worker_resident_memory_bytes", labels)

        child_rss = rss(reg, 1)
        assert child_rss > 0
        # Rank 0 is this process; with descendants it also carries its child's RSS.
        assert rss(reg, 0) - rss(reg_alone, 0) >= 0.5 * child_rss
    finally:
        child.communicate(b"", timeout=30)


def test_scrape_survives_a_failing_pid_source():
    def broken() -> dict[int, int]:
        raise RuntimeError("agent is restarting")

    m, reg = make(worker_pids=broken)
    assert "elastic_rt_world_size" in generate_latest(reg).decode()


def test_rdma_and_timex_are_wired_and_global_registry_untouched():
    before = {m.name for m in prometheus_client.REGISTRY.collect()}
    m, reg = make(sysfs_root=str(FIXTURE), timex_reader=None)
    rdma_labels = {**BASE, "device": "mlx5_1", "port": "1"}
    assert reg.get_sample_value("elastic_rt_rdma_link_downed_total", rdma_labels) == 3
    m2, reg2 = make(sysfs_root=None, timex_reader=None)  # a second agent in the process: no clash
    after = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert before == after
    assert not any(name.startswith("elastic_rt") for name in after)


def test_every_metric_is_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    m, reg = make(sysfs_root=str(FIXTURE), timex_reader=read_timex)
    m.on_rendezvous(round=1, world_size=1, nodes=1, duration_s=1)
    names = {metric.name for metric in reg.collect()}
    missing = sorted(n for n in names if f"`{n}" not in doc)
    assert not missing, f"undocumented in docs/metrics.md: {missing}"


def test_failure_metrics_are_documented():
    from elastic_rt.diagnostics.failure_metrics import FailureMetrics

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    reg = CollectorRegistry()
    FailureMetrics(registry=reg, run_id="r", node="n")
    names = {metric.name for metric in reg.collect()}
    assert names and not sorted(n for n in names if f"`{n}" not in doc)
