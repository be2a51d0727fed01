"""The goodput observer on real heartbeat and checkpoint files, an injected clock and its own registry;
the observer/policy fan-out."""

from __future__ import annotations

import json
import time

import pytest
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from elastic_rt.agent.fanout import ObserverGroup, PolicyGroup
from elastic_rt.goodput.goodput_observer import GoodputObserver, StragglerPolicy
from elastic_rt.goodput.stragglers import Signal, Straggler, StragglerSettings, Verdict
from elastic_rt.worker_reports.checkpoint import report_checkpoint
from elastic_rt.worker_reports.heartbeat import HeartbeatWriter
from elastic_rt.worker_reports.inbox import WorkerReports
from elastic_rt.worker_env import ENV_HEARTBEAT_FILE
from tests.support.clock import FakeClock as Clock


def _journal(tmp_path) -> list[dict]:
    (path,) = tmp_path.glob("goodput-*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def rig(tmp_path):
    clock = Clock(1000.0)
    reports = WorkerReports(str(tmp_path / "heartbeat"))
    registry = CollectorRegistry()
    settings = StragglerSettings(threshold=1.5, windows=2, window_s=1.0, action="leave")
    obs = GoodputObserver(run_id="job", node="n1", reports=reports, log_dir=str(tmp_path), settings=settings,
                          registry=registry, started_at=990.0, clock=clock, wall_clock=lambda: 1.7e9 + clock.now)
    yield clock, reports, registry, obs, settings
    obs.close()


def _start(reports, obs, clock, ranks=(0, 1)):
    reports.start(ranks)
    obs.on_workers_started({r: 100 + r for r in ranks})
    return {r: HeartbeatWriter(reports.heartbeat_path(r), clock_ns=lambda: int(clock.now * 1e9)) for r in ranks}


def _value(registry, name, **labels):
    return registry.get_sample_value(name, {"run_id": "job", "node": "n1", **labels})


def test_a_slow_local_rank_is_flagged_and_the_policy_leaves(rig, tmp_path):
    clock, reports, registry, obs, settings = rig
    obs.on_rendezvous(round=0, world_size=2, nodes=1, duration_s=0.5)
    writers = _start(reports, obs, clock)
    policy = StragglerPolicy(obs)
    steps = {0: 0, 1: 0}
    for tick in range(1, 41):  # 4 s: rank 0 steps every 0.1 s, rank 1 every 0.3 s
        clock.now += 0.1
        for rank, every in ((0, 1), (1, 3)):
            if tick % every == 0:
                steps[rank] += 1
                writers[rank].report(steps[rank])
        obs.on_tick()
    assert set(obs.flagged) == {1}
    assert policy.check() is None  # one node (no store round): nobody to re-form without it, so report only
    assert _value(registry, "elastic_rt_straggler", local_rank="1") == 1.0
    assert _value(registry, "elastic_rt_straggler", local_rank="0") == 0.0
    assert _value(registry, "elastic_rt_step_time_seconds", local_rank="1") == pytest.approx(0.3)
    assert _value(registry, "elastic_rt_step_time_ratio", local_rank="1") == pytest.approx(3.0)
    assert _value(registry, "elastic_rt_step_duration_seconds_count", local_rank="0") == steps[0] - 1
    flagged = [e for e in _journal(tmp_path) if e["event"] == "straggler"]
    assert [(e["local_rank"], e["action"]) for e in flagged] == [(1, "report")]


def test_a_verdict_from_rank_0_flags_this_node_and_the_policy_leaves(tmp_path):
    clock = Clock(50.0)
    reports = WorkerReports(str(tmp_path / "heartbeat"))
    settings = StragglerSettings(threshold=1.5, windows=3, window_s=0.05, action="leave")
    obs = GoodputObserver(run_id="job", node="n1", reports=reports, log_dir=str(tmp_path), settings=settings,
                          registry=CollectorRegistry(), clock=clock)
    try:
        store = dist.HashStore()
        slow = Straggler(node="n1", local_rank=0, signal=Signal.STEP_TIME, value_s=0.3, median_s=0.1, ratio=3.0,
                         windows=3)
        other = Straggler(node="n2", local_rank=0, signal=Signal.COMPUTE, value_s=0.3, median_s=0.1, ratio=3.0,
                          windows=3)
        store.set("elastic-rt/speed/verdict",
                  Verdict(seq=4, medians={Signal.STEP_TIME: 0.1}, fastest_s=0.1, ranks=4,
                          stragglers=(slow, other)).to_json())
        obs.exchange.on_round(round=2, store=store, group_rank=1, group_world_size=2)
        writers = _start(reports, obs, clock, ranks=(0,))
        policy = StragglerPolicy(obs)
        deadline = time.monotonic() + 30
        step = 0
        while not obs.flagged and time.monotonic() < deadline:  # windows of this node until it reads the verdict
            step += 1
            clock.now += 0.1
            writers[0].report(step)
            obs.on_tick()
            time.sleep(0.01)
        assert obs.flagged == {0: 3.0} and policy.check() == "straggler"
        assert json.loads(store.get("elastic-rt/speed/node/1"))["node"] == "n1"  # it published its medians
        obs.exchange.on_round(round=3, store=store, group_rank=1, group_world_size=2)  # a new round forgets
        assert obs.flagged == {} and policy.check() is None
    finally:
        obs.close()


def test_goodput_journal_and_counters_through_a_failure(rig, tmp_path):
    clock, reports, registry, obs, _ = rig
    writers = _start(reports, obs, clock, ranks=(0,))
    clock.now += 2.0  # startup: 990 .. 1002 (+0.1 to the first step)
    for step in range(1, 31):
        clock.now += 0.1
        writers[0].report(step)
        obs.on_tick()
        if step == 20:
            report_checkpoint(step=20, save_duration_s=0.0, blocked_s=0.0,
                              env={ENV_HEARTBEAT_FILE: reports.heartbeat_path(0)})
    obs.on_restart("worker_failure")
    clock.now += 1.0
    writers = _start(reports, obs, clock, ranks=(0,))
    clock.now += 0.5
    writers[0].report(21)
    obs.on_tick()
    clock.now += 0.2
    obs.on_workers_finished("succeeded")
    obs.close()

    events = _journal(tmp_path)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "exit"
    assert events[0]["time"] == pytest.approx(1.7e9 + 990.0)
    (lost,) = [e for e in events if e["event"] == "lost"]
    assert lost["steps"] == 10 and lost["committed_step"] == 20 and lost["seconds"] == pytest.approx(1.0)
    assert [e["step"] for e in events if e["event"] == "first_step"] == [1, 21]
    exit_line = events[-1]
    assert sum(exit_line["totals"].values()) == pytest.approx(exit_line["elapsed_s"])
    assert exit_line["elapsed_s"] == pytest.approx(clock.now - 990.0)
    for category, seconds in exit_line["totals"].items():
        assert _value(registry, "elastic_rt_goodput_seconds_total", category=category) == pytest.approx(seconds)
    assert exit_line["totals"]["restart"] == pytest.approx(1.0)
    assert exit_line["totals"]["restore"] == pytest.approx(0.5)
    assert _value(registry, "elastic_rt_goodput_lost_steps_total") == 10


def test_observer_group_forwards_and_survives_a_broken_observer():
    calls = []

    class Recorder:
        def __getattr__(self, name):
            return lambda *a, **k: calls.append((name, a, k))

    class Broken:
        def on_restart(self, reason):
            raise RuntimeError("bug")

    group = ObserverGroup(Broken(), None, Recorder())
    group.on_rendezvous(round=1, world_size=2, nodes=1, duration_s=0.1)
    group.on_restart("hang")
    group.on_tick()
    group.close()
    assert [c[0] for c in calls] == ["on_rendezvous", "on_restart", "on_tick", "close"]
    assert calls[1][1] == ("hang",)


def test_policy_group_first_reason_wins():
    class P:
        def __init__(self, reason):
            self.reason, self.started = reason, None

        def on_workers_started(self, ranks):
            self.started = tuple(ranks)

        def check(self):
            return self.reason

    a, b, c = P(None), P("straggler"), P("hang")
    group = PolicyGroup(a, None, b, c)
    group.on_workers_started(iter([0, 1]))
    assert group.check() == "straggler"
    assert a.started == b.started == c.started == (0, 1)
    assert PolicyGroup(P(None)).check() is None
