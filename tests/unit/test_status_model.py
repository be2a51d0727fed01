"""`elastic-rt status` logic without a network: node states, the last failure, goodput, rendering; and what the
agents publish for it (the metrics address in alive/, restart and failure timestamps, histograms from zero)."""

from __future__ import annotations

import argparse
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from elastic_rt.errors import ConfigError
from elastic_rt.diagnostics.failure_metrics import FailureMetrics
from elastic_rt.goodput.goodput_metrics import GoodputMetrics
from elastic_rt.metrics.definitions import AgentMetrics
from elastic_rt.checks.model import CheckResult
from elastic_rt.metrics.health_endpoints import render
from elastic_rt.rendezvous.handler import alive_info
from elastic_rt.rendezvous.registration import advertised_metrics_addr
from elastic_rt.rendezvous.rounds import RendezvousSettings
from elastic_rt.status.agents import AgentReading, parse_checks, parse_metrics
from elastic_rt.status.command import options_from_args
from elastic_rt.status.etcd_state import NodeRecord, RunState
from elastic_rt.status.model import NodeState, build, node_state
from elastic_rt.status.render import render_json, render_text

NOW = 1_800_000_000.0


def run_state(*, members=("a", "b"), formed=True, rnd=4, closed=False, **records: NodeRecord) -> RunState:
    return RunState(run_id="job42", revision=99, round=rnd, formed=formed, members=tuple(members),
                    members_round=rnd if formed else rnd - 1, earlier_members=(), earlier_round=None,
                    closed_by="a" if closed else None,
                    nodes=dict(sorted(records.items())))


def alive(node: str, **kw) -> NodeRecord:
    return NodeRecord(node=node, alive=True, addr="10.0.0.1", metrics=f"10.0.0.1:{9400 + ord(node[0])}",
                      nnodes=kw.pop("nnodes", (2, 3)), **kw)


def agent(node: str, *, clock: list[float], restarts=(), failures=(), standby: bool = False, step_time_s=0.1,
          straggler: bool = False, compute_ratio: float | None = None,
          checkpoint_step: int | None = None) -> AgentReading:
    """What a real AgentMetrics (and goodput/failure metrics) of `node` exports after these events."""
    reg = CollectorRegistry()
    m = AgentMetrics(registry=reg, run_id="job42", node=node, sysfs_root=None, timex_reader=None,
                     wall_clock=lambda: clock[0])
    f = FailureMetrics(registry=reg, run_id="job42", node=node, wall_clock=lambda: clock[0])
    g = GoodputMetrics(registry=reg, run_id="job42", node=node)
    m.on_rendezvous(round=4, world_size=2, nodes=2, duration_s=0.5)
    if standby:
        m.on_rendezvous_started()
    for at, reason in restarts:
        clock[0] = at
        m.on_restart(reason)
    for at, cause in failures:
        clock[0] = at
        f.on_failure(cause)
    if checkpoint_step is not None:
        clock[0] = NOW - 30
        m.on_checkpoint(step=checkpoint_step, save_duration_s=1.0, blocked_s=0.1)
    m.on_worker_state(0, "healthy")
    g.on_totals({"productive": 60.0, "restart": 20.0}, uncommitted_s=20.0, ratio=0.8)
    g.on_step_times({0: step_time_s}, job_median_s=0.1)
    if compute_ratio is not None:
        g.on_compute_times({0: compute_ratio * 0.01}, job_median_s=0.01)
    g.on_stragglers({0} if straggler else set(), {0})
    monitor = render("livez", [("monitor", CheckResult.of(True, "monitor loop ticked 0.1 s ago"))], verbose=True)[1]
    ready = render("readyz", [("etcd", CheckResult.of(True, "reachable")), ("rdma", CheckResult.of(False, "mlx5_1/1 DOWN"))],
                   verbose=True)[1]
    return AgentReading(address=f"10.0.0.1:{9400 + ord(node[0])}", samples=parse_metrics(generate_latest(reg).decode()),
                        liveness=parse_checks(monitor), readiness=parse_checks(ready))


@pytest.mark.parametrize(("record", "run", "standby", "state"), [
    (alive("a"), run_state(), False, NodeState.TRAINING),
    (alive("a"), run_state(), True, NodeState.RESTARTING),
    (alive("c"), run_state(formed=False), False, NodeState.JOINING),
    (alive("c", waiting=True), run_state(), False, NodeState.WAITING),  # 2 members of MAX 3: room
    (alive("c", waiting=True), run_state(members=("a", "b", "d")), False, NodeState.SPARE),
    (alive("c", nnodes=(1, 2)), run_state(), False, NodeState.SPARE),
    (NodeRecord(node="b"), run_state(), False, NodeState.LOST),
    (NodeRecord(node="b"), run_state(closed=True), False, NodeState.FINISHED),
    (NodeRecord(node="a", alive=True, problem="unreadable"), run_state(), False, NodeState.UNKNOWN),
])
def test_node_state(record, run, standby, state):
    reading = agent(record.node, clock=[NOW], standby=standby)
    assert node_state(record, run, reading) is state


def test_a_worker_crash_then_a_node_loss():
    clock = [NOW]
    crash, loss = NOW - 60, NOW - 20
    readings = {
        "a": agent("a", clock=clock, restarts=[(crash, "worker_failure"), (loss, "peer_lost")],
                   failures=[(crash - 100, "oom"), (crash, "killed")], checkpoint_step=400),
        "b": agent("b", clock=clock, restarts=[(crash + 0.4, "round_advanced"), (loss + 1.5, "peer_lost")],
                   step_time_s=0.3, straggler=True),
    }
    run = run_state(a=alive("a"), b=alive("b"), c=NodeRecord(node="c"))
    s = build(run, readings, now=NOW)
    assert [(n.node, n.state) for n in s.nodes] == [("a", NodeState.TRAINING), ("b", NodeState.TRAINING),
                                                    ("c", NodeState.LOST)]
    f = s.last_failure
    assert (f.reason, f.seen_by, f.lost, f.failed_node) == ("peer_lost", ("a", "b"), ("c",), None)
    assert f.age_s == pytest.approx(18.5)
    assert s.restarts == {"worker_failure": 1, "peer_lost": 1}  # the busiest node's
    assert s.world_size == 2 and s.checkpoint_step == 400 and s.checkpoint_age_s == pytest.approx(30)
    assert s.goodput == pytest.approx((2 * 80) / (2 * 100))  # (productive + uncommitted) / wall, both nodes
    assert [(x.node, x.local_rank, x.ratio, x.signal) for x in s.stragglers] == [
        ("b", 0, pytest.approx(3.0), "step_time")]
    b = s.nodes[1]
    assert b.steps_per_s == pytest.approx(1 / 0.3) and b.stragglers == (0,) and b.restarts == 2
    assert b.failing == ("rdma: mlx5_1/1 DOWN",) and b.activity == "monitor loop ticked 0.1 s ago"

    # Before the loss: the crash, told by the node whose worker failed, with the latest cause there.
    readings = {"a": agent("a", clock=[NOW], restarts=[(crash, "worker_failure")], failures=[(crash - 100, "oom"),
                                                                                            (crash, "killed")]),
                "b": agent("b", clock=[NOW], restarts=[(crash + 0.4, "round_advanced")])}
    f = build(run_state(a=alive("a"), b=alive("b")), readings, now=NOW).last_failure
    assert (f.reason, f.failed_node, f.cause, f.seen_by) == ("worker_failure", "a", "killed", ("a", "b"))


def test_agents_that_do_not_answer_or_cannot_be_read():
    run = run_state(a=alive("a"), b=alive("b"), d=NodeRecord(node="d", alive=True, problem="its key holds 3 bytes"),
                    e=NodeRecord(node="e", alive=True, addr="10.0.0.5"))
    readings = {"a": agent("a", clock=[NOW]), "b": AgentReading(address="10.0.0.1:9498", error="connection refused")}
    s = build(run, readings, now=NOW)
    rows = {n.node: n for n in s.nodes}
    assert rows["b"].state is NodeState.TRAINING and not rows["b"].answered
    assert rows["b"].error == "not answering: connection refused"
    assert rows["d"].error == "its key holds 3 bytes" and "node d: its key holds 3 bytes" in s.problems
    assert "no /metrics address" in rows["e"].error
    assert s.answering == 1 and s.last_failure is None
    text = render_text(s)
    assert "not answering: connection refused" in text and "problem: node d: its key holds 3 bytes" in text


def test_render_text_and_json():
    clock = [NOW]
    readings = {"a": agent("a", clock=clock, restarts=[(NOW - 5, "worker_failure")], failures=[(NOW - 5, "exception")],
                           checkpoint_step=40)}
    s = build(run_state(members=("a",), a=alive("a"), c=NodeRecord(node="c")), readings, now=NOW)
    text = render_text(s).splitlines()
    assert text[0].startswith("run job42: round 4 formed, 1 node(s) of --nnodes 2:3, world size 2; 1 of 2 agent(s) "
                              "answer")
    assert "checkpoint step 40, committed 30 s ago" in text[1] and "restarts 1 (worker failure 1)" in text[1]
    assert text[2] == "last failure 5 s ago: worker failure on a (cause: exception); restarted by a; lost now: c"
    header = next(i for i, line in enumerate(text) if line.startswith("NODE"))
    assert text[header + 1].split()[:3] == ["a", "training", "0"] and text[header + 2].split()[:2] == ["c", "lost"]
    forming = build(run_state(formed=False, members=("a", "c"), a=alive("a"), c=NodeRecord(node="c")), readings,
                    now=NOW)
    assert render_text(forming).startswith("run job42: round 4 forming, 1 node(s) alive of --nnodes 2:3;")
    assert "its lease is gone (the agent died, stopped or lost etcd); was a member of round 3" in render_text(forming)
    data = json.loads(render_json(s))
    assert data["version"] == 1 and data["nodes"][1]["state"] == "lost" and data["last_failure"]["cause"] == "exception"


def test_advertised_metrics_address():
    assert advertised_metrics_addr("10.1.2.3", "0.0.0.0", 9402) == "10.1.2.3:9402"
    assert advertised_metrics_addr("node-7.cluster", "::", "9402") == "node-7.cluster:9402"
    assert advertised_metrics_addr("10.1.2.3", "127.0.0.1", 9402) == "127.0.0.1:9402"
    assert advertised_metrics_addr("fd00::7", "", 9402) == "[fd00::7]:9402"
    assert advertised_metrics_addr("10.1.2.3", "0.0.0.0", 0) is None
    assert advertised_metrics_addr("10.1.2.3", None, None) is None
    settings = RendezvousSettings(run_id="j", node_id="a", local_addr="10.1.2.3", min_nodes=2, max_nodes=4,
                                  metrics_addr="10.1.2.3:9402")
    assert alive_info(settings) == {"addr": "10.1.2.3", "nnodes": [2, 4], "metrics": "10.1.2.3:9402"}
    assert "metrics" not in alive_info(RendezvousSettings(run_id="j", node_id="a", local_addr="h", min_nodes=1,
                                                          max_nodes=1))


def test_restart_and_failure_timestamps_and_histograms_from_zero():
    reg = CollectorRegistry()
    m = AgentMetrics(registry=reg, run_id="j", node="a", sysfs_root=None, timex_reader=None, wall_clock=lambda: 123.0)
    f = FailureMetrics(registry=reg, run_id="j", node="a", wall_clock=lambda: 456.0)
    base = {"run_id": "j", "node": "a"}
    for name in ("rendezvous_duration", "recovery_duration", "checkpoint_save_duration", "checkpoint_blocked"):
        assert reg.get_sample_value(f"elastic_rt_{name}_seconds_count", base) == 0, name
    assert reg.get_sample_value("elastic_rt_last_restart_timestamp_seconds", {**base, "reason": "peer_lost"}) is None
    m.on_restart("peer_lost")
    f.on_failure("oom")
    f.on_hang(1, "sleeping")
    assert reg.get_sample_value("elastic_rt_last_restart_timestamp_seconds", {**base, "reason": "peer_lost"}) == 123.0
    assert reg.get_sample_value("elastic_rt_last_worker_failure_timestamp_seconds", {**base, "cause": "oom"}) == 456.0
    assert reg.get_sample_value("elastic_rt_last_worker_failure_timestamp_seconds", {**base, "cause": "hang"}) == 456.0


def test_parse_checks_reads_the_verbose_answers():
    code, body = render("readyz", [("etcd", CheckResult.of(True, "reachable")),
                                   ("probe", CheckResult.of(False, "all-reduce timed out: 30 s"))], verbose=True)
    assert code == 503
    checks = parse_checks(body)
    assert [(c.name, c.ok, c.reason) for c in checks] == [("etcd", True, "reachable"),
                                                          ("probe", False, "all-reduce timed out: 30 s")]


@pytest.mark.parametrize(("argv", "message"), [
    ({"rdzv_id": "bad id"}, "invalid --rdzv-id"),
    ({"timeout": 0.0}, "--timeout 0: must be > 0"),
    ({"watch": -1.0}, "--watch -1: must be > 0"),
    ({"rdzv_conf": "user"}, "expected key=value"),
])
def test_bad_options_are_one_line_errors(argv, message):
    args = argparse.Namespace(**{**dict(rdzv_endpoint="h:2379", rdzv_id="job42", rdzv_conf="", timeout=2.0,
                                        watch=None, json=False), **argv})
    with pytest.raises(ConfigError, match=message):
        options_from_args(args)


def test_etcd_that_fails_at_once_is_asked_again_until_the_timeout(monkeypatch):
    from elastic_rt.errors import EtcdUnavailableError
    from elastic_rt.status import command

    answers: list = []

    def read(_client, run_id):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(command, "read_run_state", read)
    opts = command.StatusOptions(endpoint="h:2379", run_id="job42", timeout_s=2.0)
    refused = EtcdUnavailableError("etcd at h:2379 is not reachable (h:2379: unavailable)")
    for replies, expected in (([refused, refused, "state"], "state"), ([refused] * 100, None)):
        now = [0.0]
        answers[:] = replies
        clock, sleep = (lambda: now[0]), (lambda s: now.__setitem__(0, now[0] + s))
        if expected is None:
            with pytest.raises(EtcdUnavailableError):
                command.read_state(object(), opts, clock=clock, sleep=sleep)
            assert 1.0 <= now[0] <= 2.0  # it gave up within --timeout, having tried for most of it
        else:
            assert command.read_state(object(), opts, clock=clock, sleep=sleep) == expected and not answers


def test_a_lock_step_straggler_shows_the_compute_ratio_that_flagged_it():
    """In a lock-step job the slow rank's step time is everyone's (ratio 1): the compute time names it, and
    status shows that ratio, not the step time's."""
    clock = [NOW]
    readings = {"a": agent("a", clock=clock, compute_ratio=1.0),
                "b": agent("b", clock=clock, step_time_s=0.1, straggler=True, compute_ratio=6.0)}
    s = build(run_state(a=alive("a"), b=alive("b")), readings, now=NOW)
    assert [(x.node, x.local_rank, x.ratio, x.signal) for x in s.stragglers] == [
        ("b", 0, pytest.approx(6.0), "compute")]
    assert "stragglers: b local rank 0 at 6.00x the job median compute time" in render_text(s)
