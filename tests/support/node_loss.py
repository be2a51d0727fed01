"""A node-loss run watched by a Prometheus with the shipped rules and scrape config unchanged: two nodes die, a
replacement comes late, a worker crashes; when each alert goes pending and firing, and `elastic-rt status` at
each step. benchmarks/alert_latency.py records it; tests/integration/test_prometheus_e2e.py's long variant
checks it.

The run: three agents of the monitored local-SGD job (--nnodes 2:3, node b slow: a straggler), then
  1. node c is killed (SIGKILL to its agent and workers: a node that loses power): a and b re-form;
  2. node b is killed: a is alone, below MIN (2), and waits;
  3. replace_after_s later a replacement node d starts: a's recovery took longer than 120 s;
  4. node a's worker crashes `crashes` times: with the two node losses, more than 5 restarts in 15 min.
Expected: ElasticRTAgentDown for c and for b (for: 5m), ElasticRTRecoverySlow (a recovery over 120 s, no
for:), ElasticRTRestartStorm (for: 1m).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from etcd_testbed.server import EtcdCluster
from elastic_rt.status.agents import read_agent
from elastic_rt.status.command import StatusOptions, snapshot
from elastic_rt.status.render import render_text
from tests.support.monitoring import AGENT_JOB, MonitoredJob, monitored_job, shipped_rules
from tests.support.prometheus import PrometheusServer, wait_until

# on_done(prometheus, run_id, started, ended, events) -> the titles of the panels that drew nothing
OnDone = Callable[[PrometheusServer, str, float, float, list], list]


@dataclass(frozen=True, kw_only=True)
class NodeLossSettings:
    interval_s: int = 15  # scrape and rule evaluation: the shipped config's
    baseline_s: float = 60.0  # steady training before the faults
    second_loss_after_s: float = 45.0
    replace_after_s: float = 130.0  # how long a stays below MIN
    crashes: int = 4
    max_wait_s: float = 600.0  # after the crashes, for the alerts that did not fire yet


class AlertWatch:
    """Polls /api/v1/alerts every second in a thread, for the whole run. Each alert (name and key labels) has
    episodes: from Prometheus's activeAt (pending, or firing at once without for:) to the first poll that saw
    it firing. (A target that is not up yet when the agents start is a short episode of its own.)"""

    KEYS = ("alertname", "instance", "run_id", "node")

    def __init__(self, prom: PrometheusServer) -> None:
        self.prom = prom
        self.episodes: dict[tuple, dict[float, float | None]] = {}  # key -> activeAt -> first seen firing
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="alert-watch", daemon=True)

    def __enter__(self) -> "AlertWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                alerts = self.prom.alerts()
            except (OSError, RuntimeError):
                continue  # one missed poll; the next second tries again
            now = time.time()
            with self._lock:
                for a in alerts:
                    key = tuple((k, a["labels"][k]) for k in self.KEYS if k in a["labels"])
                    episode = self.episodes.setdefault(key, {})
                    active = _unix(a["activeAt"])
                    episode.setdefault(active, None)
                    if a["state"] == "firing" and episode[active] is None:
                        episode[active] = now

    def after(self, since: float, alertname: str, **labels: str) -> tuple[float | None, float | None]:
        """(activeAt, first seen firing) of the first episode of the alert that began at or after `since`."""
        with self._lock:
            found = [(active, firing) for key, episode in self.episodes.items()
                     if (d := dict(key))["alertname"] == alertname and all(d.get(k) == v for k, v in labels.items())
                     for active, firing in episode.items() if active >= since - 1.0]
        return min(found) if found else (None, None)

    def firing(self) -> set[str]:
        with self._lock:
            return {dict(k)["alertname"] for k, e in self.episodes.items() if any(v is not None for v in e.values())}


def _unix(rfc3339: str) -> float:
    """Prometheus's activeAt (2026-12-01T18:23:46.123456789Z) as Unix time."""
    head, _, frac = rfc3339.rstrip("Z").partition(".")
    base = datetime.datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def status_text(job: MonitoredJob, *, settled: bool = False, timeout_s: float = 120) -> str:
    """`elastic-rt status`; settled: once every member trains and reports a step (after a restart)."""
    opts = StatusOptions(endpoint=job.endpoint, run_id=job.run_id, timeout_s=10)
    deadline = time.time() + timeout_s
    while True:
        status = snapshot(opts)
        members = [n for n in status.nodes if n.node in status.members]
        if not settled or time.time() > deadline or all(n.state.value == "training" and n.step is not None
                                                        for n in members):
            out = io.StringIO()
            print(render_text(status), file=out)
            return out.getvalue()
        time.sleep(1)


def run_node_loss(settings: NodeLossSettings, tmp: Path, on_done: OnDone,
                  log: Callable[[str], None] = print) -> dict:
    """The run described above; the alerts' times, the status screens, on_done's verdict on the panels."""
    s = settings
    events: list[tuple[float, str]] = []
    statuses: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(EtcdCluster(1))
        job = monitored_job(stack, etcd_endpoint=etcd.endpoints, tmp=tmp, rule_sets={"prometheus": shipped_rules()},
                            interval_s=s.interval_s, prefix="alerts")
        prom, sel = job.servers["prometheus"], f'run_id="{job.run_id}"'
        job.targets("abc")
        for name in "abc":
            job.start(name, 0.3 if name == "b" else 0.05)
        watch = stack.enter_context(AlertWatch(prom))
        wait_until("three agents scraped", lambda: len(prom.query(f'up{{job="{AGENT_JOB}"}} == 1')) == 3, 300,
                   detail=job.logs)
        wait_until("b flagged as a straggler", lambda: prom.query(f'elastic_rt_straggler{{{sel},node="b"}} == 1'), 300,
                   detail=job.logs)
        wait_until("two checkpoints", lambda: prom.query(f"elastic_rt_checkpoint_last_committed_step{{{sel}}} >= 40"),
                   300, detail=job.logs)
        time.sleep(s.baseline_s)
        statuses["training"] = status_text(job)

        def mark(label: str) -> float:
            at = time.time()
            events.append((at, label))
            log(f"[{at - job.started:6.0f}s] {label}")
            return at

        a = job.nodes["a"]
        since = time.monotonic()
        c_killed = mark("node c killed")
        job.nodes["c"].kill_node()
        a.wait_for(r"node a round \d+: rank \d of 2 nodes", 120, after=since)
        statuses["c lost"] = status_text(job, settled=True)
        time.sleep(max(0.0, c_killed + s.second_loss_after_s - time.time()))
        b_killed = mark("node b killed")
        job.nodes["b"].kill_node()

        time.sleep(15)
        statuses["b lost, a waiting"] = status_text(job)
        time.sleep(max(0.0, b_killed + s.replace_after_s - time.time()))
        d_started = mark("node d started")
        since = time.monotonic()
        job.start("d", 0.05)
        a.wait_for(r"node a round \d+: rank \d of 2 nodes", 300, after=since)
        recovered = mark("a and d train")
        restarts = lambda: read_agent(f"127.0.0.1:{job.ports['a']}", timeout_s=10).value(  # noqa: E731
            "elastic_rt_restarts_total", reason="worker_failure") or 0
        crash_times = []
        for crash in range(1, s.crashes + 1):
            pid = a.worker_pid(0, timeout_s=120)
            crash_times.append(mark(f"a's worker crash {crash}") if crash in (1, s.crashes) else time.time())
            os.kill(pid, signal.SIGKILL)
            wait_until(f"a restarted after crash {crash}", lambda: restarts() == crash and a.worker_pid(0) != pid, 120)
        statuses["after the crashes"] = status_text(job, settled=True)
        expected = {
            "ElasticRTAgentDown c": ("ElasticRTAgentDown", {"instance": f"127.0.0.1:{job.ports['c']}"}, c_killed,
                                     "node c killed"),
            "ElasticRTAgentDown b": ("ElasticRTAgentDown", {"instance": f"127.0.0.1:{job.ports['b']}"}, b_killed,
                                     "node b killed"),
            "ElasticRTRecoverySlow": ("ElasticRTRecoverySlow", {"run_id": job.run_id}, b_killed,
                                      f"node b killed; below MIN until a replacement started {s.replace_after_s:g} s "
                                      "later"),
            "ElasticRTRestartStorm": ("ElasticRTRestartStorm", {"run_id": job.run_id}, crash_times[0],
                                      f"a's worker crashes {s.crashes} times (from the first): with the two losses, "
                                      f"{s.crashes + 2} restarts"),
        }
        deadline = time.time() + s.max_wait_s
        while time.time() < deadline and not all(watch.after(t, n, **lb)[1] for n, lb, t, _ in expected.values()):
            time.sleep(1)
        ended = time.time()
        empty = on_done(prom, job.run_id, job.started, ended, events)
        alerts = {}
        for key, (name, labels, fault_at, fault) in expected.items():
            pending, firing = watch.after(fault_at, name, **labels)
            alerts[key] = {"fault": fault, "fault_at": fault_at, "active_at": pending, "firing_at": firing,
                           "fault_to_active_s": None if pending is None else round(pending - fault_at, 1),
                           "fault_to_firing_s": None if firing is None else round(firing - fault_at, 1)}
        others = sorted(watch.firing() - {v[0] for v in expected.values()})
        return {"run_id": job.run_id, "started": job.started, "ended": ended, "events": events, "alerts": alerts,
                "other_alerts_firing": others, "recovery_after_second_loss_s": round(recovered - b_killed, 1),
                "replacement_started_after_s": round(d_started - b_killed, 1), "panels_without_data": empty,
                "status": statuses}
