"""The agent observer records checkpoint figures from workers; the restart policy acts on probe failures."""

from __future__ import annotations

import os

from elastic_rt.agent.policy import HealthPolicy
from elastic_rt.metrics.metrics_observer import MetricsObserver
from elastic_rt.worker_reports.checkpoint import CheckpointReportReader, report_checkpoint
from elastic_rt.worker_reports.inbox import WorkerReports
from elastic_rt.worker_env import ENV_HEARTBEAT_FILE


def test_report_reaches_agent_metrics(tmp_path):
    env = {ENV_HEARTBEAT_FILE: str(tmp_path / "worker-0")}
    obs = MetricsObserver(run_id="r", node="n", reports=WorkerReports(str(tmp_path)), sysfs_root=None)
    labels = {"run_id": "r", "node": "n"}
    obs.on_tick()
    assert obs.registry.get_sample_value("elastic_rt_checkpoint_last_committed_step", labels) in (None, 0.0)
    report_checkpoint(step=120, save_duration_s=1.5, blocked_s=0.05, env=env)
    obs.on_tick()
    assert obs.registry.get_sample_value("elastic_rt_checkpoint_last_committed_step", labels) == 120
    assert obs.registry.get_sample_value("elastic_rt_checkpoint_blocked_seconds_sum", labels) == 0.05


def test_reader_ignores_garbage_and_unchanged_files(tmp_path):
    reader = CheckpointReportReader(str(tmp_path))
    assert reader.read_new() is None
    (tmp_path / "checkpoint.json").write_text("{not json")
    assert reader.read_new() is None
    report_checkpoint(step=7, save_duration_s=1.0, blocked_s=0.1, env={ENV_HEARTBEAT_FILE: str(tmp_path / "w")})
    assert reader.read_new().step == 7
    assert reader.read_new() is None  # once per change
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_no_agent_no_report(tmp_path):
    report_checkpoint(step=1, save_duration_s=1.0, blocked_s=0.1, env={})
    assert not list(tmp_path.iterdir())


def test_failed_probe_asks_to_leave_only_when_configured():
    failure: list[str | None] = [None]
    for action, expected in (("report", None), ("leave", "probe_failure")):
        policy = HealthPolicy(heartbeats=dict, probe_failure=lambda: failure[0], probe_failure_action=action)
        failure[0] = "all-reduce timed out"  # the current round's probe failed
        assert policy.check() == expected
        failure[0] = None  # no failure in the current round (an outdated round's never counts)
        assert policy.check() is None
