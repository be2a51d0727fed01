"""A real Prometheus scraping the agents of a real job on real etcd, with the shipped scrape config and rules.

Three nodes train (node b slow: a straggler); node c is killed, then node a's worker crashes five times. The
alerts ElasticRTAgentDown and ElasticRTRestartStorm reach `firing`, the recording rules give values, every
expression of the shipped dashboard returns data, and `elastic-rt status` tells the same story at each step.

The shipped rules wait minutes before firing (`for: 5m` for a dead agent): production values, kept. A
Prometheus evaluates `for:` on its wall clock, which no flag speeds up, so two servers scrape the same agents:
one loads the rule file unchanged (its alerts must reach at least `pending`, i.e. their expressions match
what real agents and a real scrape give), the other a copy whose only difference is `for: 2s` (checked),
whose alerts must reach `firing`. benchmarks/alert_latency.py runs a longer node loss against the unchanged
rules only and records the time from each fault to `firing`.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from benchmarks.dashboard_queries import dashboard_variables
from elastic_rt.status.agents import read_agent
from elastic_rt.status.command import StatusOptions, show
from tests.chaos.harness import ROOT
from tests.support.monitoring import (
    AGENT_JOB,
    MonitoredJob,
    empty_panels,
    monitored_job,
    rule_differences,
    shipped_rules,
    with_short_for,
)
from tests.support.node_loss import NodeLossSettings, run_node_loss
from tests.support.prometheus import INSTALL_HINT, PrometheusServer, prometheus_binary, wait_until
from tests.support.tools import needs_tool

pytestmark = [pytest.mark.slow, needs_tool("prometheus", prometheus_binary() is not None, INSTALL_HINT)]

SHORT_FOR = "2s"
WORKER_CRASHES = 5  # with the node loss, 6 restarts at node a: more than ElasticRTRestartStorm's 5


@dataclass
class Live:
    job: MonitoredJob
    killed: float = 0.0  # Unix time node c was killed
    before: dict | None = None  # `elastic-rt status --json` while all three train, b flagged as a straggler
    after_loss: dict | None = None  # once a and b re-formed without c
    after_crashes: dict | None = None  # after a's worker crashed WORKER_CRASHES times

    @property
    def shipped(self) -> PrometheusServer:  # the rule file unchanged
        return self.job.servers["shipped"]

    @property
    def fast(self) -> PrometheusServer:  # the same rules with for: 2s
        return self.job.servers["fast"]

    @property
    def run_id(self) -> str:
        return self.job.run_id


def _metric(prom: PrometheusServer, expr: str) -> float | None:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else None


def status_json(live: Live) -> dict:
    """`elastic-rt status --json`, in this process (the CLI itself runs in the last test)."""
    out = io.StringIO()
    assert show(StatusOptions(endpoint=live.job.endpoint, run_id=live.run_id, as_json=True, timeout_s=10),
                out=out) == 0
    return json.loads(out.getvalue())


def _wait_training(live: Live) -> None:
    prom, sel, log = live.shipped, f'run_id="{live.run_id}"', live.job.logs
    wait_until("three agents scraped", lambda: _metric(prom, f'count(up{{job="{AGENT_JOB}"}} == 1)') == 3, 240,
               detail=log)
    wait_until("node b flagged as a straggler", lambda: _metric(prom, f'elastic_rt_straggler{{{sel},node="b"}}') == 1,
               240, detail=log)
    wait_until("two checkpoints committed",
               lambda: (_metric(prom, f"max(elastic_rt_checkpoint_last_committed_step{{{sel}}})") or 0) >= 40, 240,
               detail=log)
    live.before = wait_until("status shows node b as a straggler",
                             lambda: (st := status_json(live))["stragglers"] and st, 60)


def _faults(live: Live) -> None:
    """Node c dies (a and b re-form), then node a's worker is SIGKILLed WORKER_CRASHES times."""
    a = live.job.nodes["a"]
    since = time.monotonic()
    live.killed = time.time()
    live.job.nodes["c"].kill_node()
    a.wait_for(r"node a round \d+: rank \d of 2 nodes", 120, after=since)
    live.after_loss = _both_training(live, "again")
    restarts = lambda: read_agent(f"127.0.0.1:{live.job.ports['a']}", timeout_s=5).value(  # noqa: E731
        "elastic_rt_restarts_total", reason="worker_failure")
    for crash in range(1, WORKER_CRASHES + 1):
        pid = a.worker_pid(0, timeout_s=120)
        os.kill(pid, signal.SIGKILL)
        wait_until(f"node a restarted its workers after crash {crash}",
                   lambda: restarts() == crash and a.worker_pid(0, timeout_s=120) != pid, 120,
                   detail=lambda: a.output[-2000:])
    live.after_crashes = _both_training(live, "after the crashes")  # b restarts its workers too: not at once


def _both_training(live: Live, when: str) -> dict:
    """`elastic-rt status --json` once it shows nodes a and b training."""
    return wait_until(f"status shows a and b training {when}", lambda: (st := status_json(live)) and all(
        n["state"] == "training" for n in st["nodes"] if n["node"] in "ab") and st, 120)


@pytest.fixture(scope="module")
def live(etcd_server, tmp_path_factory):
    with contextlib.ExitStack() as stack:
        rules = shipped_rules()
        job = monitored_job(stack, etcd_endpoint=etcd_server.endpoints, tmp=tmp_path_factory.mktemp("prometheus-e2e"),
                            rule_sets={"shipped": rules, "fast": with_short_for(rules, SHORT_FOR)}, interval_s=1,
                            prefix="prom")
        job.targets("abc")
        for name in "abc":
            job.start(name, step_sleep_s=0.3 if name == "b" else 0.05)
        live = Live(job)
        _wait_training(live)
        _faults(live)
        yield live


def _rule(prom: PrometheusServer, alert: str) -> dict:
    (rule,) = [r for (_, name), r in prom.rule_states().items() if name == alert]
    return rule


def _active(rule: dict, **labels: str) -> list[dict]:
    return [a for a in rule.get("alerts", []) if all(a["labels"].get(k) == v for k, v in labels.items())]


def test_the_fast_copy_differs_from_the_shipped_rules_only_in_for():
    shipped = shipped_rules()
    diffs = rule_differences(shipped, with_short_for(shipped, SHORT_FOR))
    assert diffs and all(d.endswith(": for") for d in diffs), diffs


def test_agent_down_and_restart_storm_fire(live):
    c = f"127.0.0.1:{live.job.ports['c']}"
    storm = {"run_id": live.run_id}
    expected = (("ElasticRTAgentDown", {"instance": c}), ("ElasticRTRestartStorm", storm))

    def firing():
        states = {name: _active(_rule(live.fast, name), **labels) for name, labels in expected}
        return states if all(any(a["state"] == "firing" for a in v) for v in states.values()) else None

    wait_until("ElasticRTAgentDown and ElasticRTRestartStorm firing (for: 2s)", firing, 120,
               detail=lambda: json.dumps(live.fast.alerts())[-3000:])
    seen = time.time()
    listed = [a for a in live.fast.alerts() if a["state"] == "firing"]
    assert any(a["labels"]["alertname"] == "ElasticRTAgentDown" and a["labels"]["instance"] == c for a in listed)
    assert any(a["labels"]["alertname"] == "ElasticRTRestartStorm" for a in listed), listed
    down = [a for a in listed if a["labels"]["alertname"] == "ElasticRTAgentDown"]
    assert c in down[0]["annotations"]["summary"], down  # the plain-Prometheus branch of the summary
    for name, labels in expected:  # the unchanged rules: the same expressions, the production for:
        rule = _rule(live.shipped, name)
        assert rule["health"] == "ok", rule
        active = _active(rule, **labels)
        assert active and active[0]["state"] in ("pending", "firing"), (name, rule)
    pending_since = _active(_rule(live.shipped, "ElasticRTAgentDown"), instance=c)[0]["activeAt"]
    print(f"\nnode c killed -> ElasticRTAgentDown firing (for: {SHORT_FOR}) within {seen - live.killed:.1f} s; "
          f"the unchanged rule pending since {pending_since}")


RECORDED = ("worker:elastic_rt_steps_per_second:rate1m", "node:elastic_rt_steps_per_second:rate1m",
            "run_id:elastic_rt_steps_per_second:rate1m", "run_id:elastic_rt_goodput:ratio1h",
            "run_id:elastic_rt_goodput_ratio:avg")


def test_recording_rules_give_values(live):
    def values():  # the step rate is 0 while the crashed workers restart: wait for training to go on
        out = {name: [float(r["value"][1]) for r in live.shipped.query(f'{name}{{run_id="{live.run_id}"}}')]
               for name in RECORDED}
        ok = all(v and all(math.isfinite(x) for x in v) for v in out.values())
        return out if ok and all(v > 0 for v in out["run_id:elastic_rt_steps_per_second:rate1m"]) else None

    found = wait_until("every recording rule gives a value, a step rate above 0", values, 120)
    assert {len(found["node:elastic_rt_steps_per_second:rate1m"])} <= {2, 3}, found  # a and b (c while it lasts)
    for name in ("run_id:elastic_rt_goodput:ratio1h", "run_id:elastic_rt_goodput_ratio:avg"):
        assert all(0 < v <= 1 for v in found[name]), (name, found)


def test_every_dashboard_panel_draws(live):
    empty: list[str] = []

    def all_draw():
        empty[:] = empty_panels(live.shipped, run_id=live.run_id, start=live.job.started, end=time.time())
        return not empty

    with contextlib.suppress(TimeoutError):
        wait_until("every panel draws", all_draw, 30, poll_s=2)
    assert not empty, "panels that draw nothing:\n" + "\n".join(empty)


def test_the_run_variable_lists_this_run(live):
    """The dashboard's run selector (label_values); its namespace selector is empty outside Kubernetes,
    where Grafana's "All" (.*) stands for it."""
    selector, label = dashboard_variables()["run_id"]
    series = live.shipped.api("series", **{"match[]": selector.replace("$namespace", ".*"),
                                           "start": f"{live.job.started:.3f}", "end": f"{time.time():.3f}"})
    assert live.run_id in {s.get(label) for s in series}, series


def test_status_before_the_faults(live):
    s = live.before
    assert {n["node"]: n["state"] for n in s["nodes"]} == dict.fromkeys("abc", "training"), s["nodes"]
    assert s["formed"] and s["members"] == ["a", "b", "c"] and s["world_size"] == 3 and s["answering"] == 3, s
    nodes = {n["node"]: n for n in s["nodes"]}
    assert nodes["b"]["step_time_s"] >= 0.3 and all(n["steps_per_s"] > 0 for n in nodes.values()), nodes  # b sleeps
    assert [(x["node"], x["local_rank"]) for x in s["stragglers"]] == [("b", 0)] and s["stragglers"][0]["ratio"] > 1.5
    assert s["last_failure"] is None and s["restarts"] == {}, s
    assert s["checkpoint_step"] >= 40 and s["checkpoint_age_s"] is not None and 0 < s["goodput"] <= 1, s


def test_status_shows_the_node_loss(live):
    s = live.after_loss
    states = {n["node"]: n for n in s["nodes"]}
    assert {n: v["state"] for n, v in states.items()} == {"a": "training", "b": "training", "c": "lost"}, states
    assert s["formed"] and s["members"] == ["a", "b"] and s["world_size"] == 2 and s["answering"] == 2, s
    assert not states["c"]["answered"] and "lease is gone" in states["c"]["activity"], states["c"]
    failure = s["last_failure"]
    assert failure["reason"] == "peer_lost" and failure["lost"] == ["c"], failure
    assert set(failure["seen_by"]) == {"a", "b"}, failure
    assert s["restarts"] == {"peer_lost": 1}, s["restarts"]


def test_status_names_the_crashing_worker(live):
    s = live.after_crashes
    failure = s["last_failure"]
    assert failure["reason"] == "worker_failure" and failure["failed_node"] == "a", failure
    assert failure["cause"] == "killed" and set(failure["seen_by"]) == {"a", "b"}, failure
    assert s["restarts"] == {"worker_failure": WORKER_CRASHES, "peer_lost": 1}, s["restarts"]
    assert {n["node"]: n["state"] for n in s["nodes"] if n["node"] != "c"} == {"a": "training", "b": "training"}


def _interruptible() -> None:
    """Ctrl-C as in an operator's terminal: a test run in the background of a non-interactive shell (CI started
    with `&`) inherits SIGINT ignored, and Python raises no KeyboardInterrupt in a child that inherits that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_status_cli_watch_redraws_until_interrupted(live):
    """The command itself, as an operator runs it: text frames on a pipe, Ctrl-C ends it with exit code 0."""
    proc = subprocess.Popen([sys.executable, "-m", "elastic_rt.cli", "status", "--rdzv-endpoint", live.job.endpoint,
                             "--rdzv-id", live.run_id, "--watch", "0.5", "--timeout", "10"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(ROOT), preexec_fn=_interruptible)
    frames: list[list[str]] = []
    try:
        while len(frames) < 2:  # the second frame's first line ends the first frame
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            if line.startswith(f"run {live.run_id}: "):
                frames.append([])
            if frames and line.strip():
                frames[-1].append(line.rstrip("\n"))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    first = frames[0]
    assert first[0].startswith(f"run {live.run_id}: round "), first
    assert "formed, 2 node(s) of --nnodes 2:3, world size 2" in first[0], first
    assert any(line.startswith("last failure") and "worker failure on a (cause: killed)" in line for line in first)
    rows = {line.split()[0]: line.split() for line in first if line.split()[0] in ("a", "b")}
    assert rows["a"][1] == rows["b"][1] == "training", first


@pytest.mark.long
@pytest.mark.timeout(1500)
def test_the_unchanged_rules_fire_during_a_node_loss(tmp_path):
    """The shipped rules and scrape config as they are (for: 5m, 15 s intervals): two node losses, a replacement
    130 s late, four worker crashes (tests/support/node_loss.py). About 10 minutes; benchmarks/alert_latency.py
    runs the same and records the times."""
    def panels(prom, run_id, started, ended, _events):
        return empty_panels(prom, run_id=run_id, start=started, end=ended)

    result = run_node_loss(NodeLossSettings(), tmp_path, panels)
    not_firing = {key: a for key, a in result["alerts"].items() if a["firing_at"] is None}
    assert not not_firing, (not_firing, result["status"])
    assert result["panels_without_data"] == [], result["panels_without_data"]
    assert result["recovery_after_second_loss_s"] > 120, result
