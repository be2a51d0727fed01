"""Time from a fault to each shipped alert `firing` in a real Prometheus, with the shipped rules and scrape
config unchanged (production `for:` and intervals), and a picture of the dashboard during the node loss.

The run: a real etcd; a Prometheus with k8s/monitoring/prometheus/prometheus.yml (only the file paths
changed) and the rule file of k8s/monitoring/prometheusrule.yaml; three agents of a local-SGD job
(--nnodes 2:3, node b slow: a straggler). Then:
  1. node c is killed (SIGKILL to its agent and workers: a node that loses power): a and b re-form;
  2. node b is killed: a is alone, below MIN (2), and waits;
  3. --replace-after-s later a replacement node d starts: a's recovery took longer than 120 s;
  4. node a's worker crashes --crashes times: with the two node losses, more than 5 restarts in 15 min.
Expected: ElasticRTAgentDown for c and for b (for: 5m), ElasticRTRecoverySlow (no for:, a recovery over
120 s), ElasticRTRestartStorm (for: 1m). Each alert's first `pending` and `firing` are polled from
/api/v1/alerts every second; the results file holds the times from its fault, `elastic-rt status` at each
step, and the PNG (benchmarks/dashboard_png.py) is drawn from the run.

    python benchmarks/alert_latency.py [--png docs/img/dashboard-node-loss.png]   # ~10 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from dashboard_png import render  # noqa: E402 - benchmarks/ is sys.path[0]
from provenance import provenance  # noqa: E402
from results_file import write_results  # noqa: E402

from elastic_rt.chaos.etcd_server import EtcdCluster, free_port  # noqa: E402
from elastic_rt.status.agents import read_agent  # noqa: E402
from elastic_rt.status.command import StatusOptions, show, snapshot  # noqa: E402
from elastic_rt.status.render import render_text  # noqa: E402
from tests.chaos.harness import Node  # noqa: E402
from tests.support.monitoring import (  # noqa: E402
    AGENT_JOB, agent_args, config_differences, healthy_sysfs, rendered_config, shipped_rules, write_targets)
from tests.support.prometheus import PrometheusServer, wait_until  # noqa: E402
from tests.unit.test_collectors_clock import LoopbackNtpServer  # noqa: E402

RULE_FILE = "elastic-rt-rules.yml"


class AlertWatch:
    """First time each alert (name and key labels) was seen pending and firing in /api/v1/alerts."""

    KEYS = ("alertname", "instance", "run_id", "node")

    def __init__(self, prom: PrometheusServer) -> None:
        self.prom = prom
        self.seen: dict[tuple, dict[str, float]] = {}

    def poll(self) -> None:
        now = time.time()
        for a in self.prom.alerts():
            key = tuple((k, a["labels"][k]) for k in self.KEYS if k in a["labels"])
            self.seen.setdefault(key, {}).setdefault(a["state"], now)
            self.seen[key].setdefault("active_at", a["activeAt"])

    def first(self, alertname: str, state: str, **labels: str) -> float | None:
        for key, states in self.seen.items():
            d = dict(key)
            if d["alertname"] == alertname and all(d.get(k) == v for k, v in labels.items()) and state in states:
                return states[state]
        return None


def status_text(endpoint: str, run_id: str) -> str:
    out = io.StringIO()
    show(StatusOptions(endpoint=endpoint, run_id=run_id, timeout_s=10), out=out)
    return out.getvalue()


def settled_status(endpoint: str, run_id: str, timeout_s: float = 120) -> str:
    """The status text once every member trains and reports a step again (after a restart), or at timeout_s."""
    out = io.StringIO()
    opts = StatusOptions(endpoint=endpoint, run_id=run_id, timeout_s=10)
    deadline = time.time() + timeout_s
    while True:
        status = snapshot(opts)
        members = [n for n in status.nodes if n.node in status.members]
        if time.time() > deadline or all(n.state.value == "training" and n.step is not None for n in members):
            break
        time.sleep(1)
    print(render_text(status), file=out)
    return out.getvalue()


def run(args: argparse.Namespace, tmp: Path) -> dict:
    events: list[tuple[float, str]] = []
    statuses: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(EtcdCluster(1))
        run_id = "alerts-" + uuid.uuid4().hex[:6]
        ports = {n: free_port() for n in "abcd"}
        sd = tmp / "sd"
        sd.mkdir()
        targets = [f"127.0.0.1:{ports[n]}" for n in "abc"]
        write_targets(sd / "elastic-rt-agents.json", targets)
        write_targets(sd / "elastic-rt-etcd.json", etcd.endpoints.split(","))
        cfg = rendered_config(interval_s=args.interval_s, rule_file=RULE_FILE, sd_dir=sd)
        assert config_differences(cfg) == []  # file paths and intervals only (15 s: the shipped ones)
        prom = stack.enter_context(PrometheusServer(config=cfg, rule_files={RULE_FILE: shipped_rules()},
                                                    workdir=tmp / "prometheus"))
        ntp = stack.enter_context(LoopbackNtpServer(shift_s=0.02))
        sysfs = healthy_sysfs(tmp / "sysfs")
        nodes: dict[str, Node] = {}
        stack.callback(lambda: [n.cleanup() for n in nodes.values()])

        def start(name: str, step_sleep_s: float) -> None:
            nodes[name] = Node(agent_args(
                endpoint=etcd.endpoints, run_id=run_id, node=name, metrics_port=ports[name], nnodes="2:3",
                checkpoint_url=f"file://{tmp}/ck", sysfs_root=sysfs, ntp_server=ntp.addr, log_dir=tmp / f"log-{name}",
                step_sleep_s=step_sleep_s), name=name)

        started = time.time()
        for name in "abc":
            start(name, 0.3 if name == "b" else 0.05)
        watch = AlertWatch(prom)
        sel = f'run_id="{run_id}"'
        wait_until("three agents scraped", lambda: len(prom.query(f'up{{job="{AGENT_JOB}"}} == 1')) == 3, 300)
        wait_until("b flagged as a straggler", lambda: prom.query(f'elastic_rt_straggler{{{sel},node="b"}} == 1'), 300)
        wait_until("two checkpoints", lambda: prom.query(f"elastic_rt_checkpoint_last_committed_step{{{sel}}} >= 40"),
                   300)
        settle = time.time() + args.baseline_s
        while time.time() < settle:
            watch.poll()
            time.sleep(1)
        statuses["training"] = status_text(etcd.endpoints, run_id)

        def mark(label: str) -> float:
            at = time.time()
            events.append((at, label))
            print(f"[{at - started:6.0f}s] {label}", file=sys.stderr, flush=True)
            return at

        a = nodes["a"]
        since = time.monotonic()
        c_killed = mark("node c killed")
        nodes["c"].kill_node()
        a.wait_for(r"node a round \d+: rank \d of 2 nodes", 120, after=since)
        statuses["c lost"] = settled_status(etcd.endpoints, run_id)
        deadline = time.time() + args.second_loss_after_s
        while time.time() < deadline:
            watch.poll()
            time.sleep(1)
        b_killed = mark("node b killed")
        nodes["b"].kill_node()
        deadline = time.time() + args.replace_after_s
        while time.time() < deadline:
            watch.poll()
            time.sleep(1)
            if "b lost, a waiting" not in statuses and time.time() > b_killed + 15:
                statuses["b lost, a waiting"] = status_text(etcd.endpoints, run_id)
        write_targets(sd / "elastic-rt-agents.json", targets + [f"127.0.0.1:{ports['d']}"])
        d_started = mark("node d started")
        since = time.monotonic()
        start("d", 0.05)
        a.wait_for(r"node a round \d+: rank \d of 2 nodes", 300, after=since)
        recovered = mark("a and d train")
        restarts = lambda: read_agent(f"127.0.0.1:{ports['a']}", timeout_s=10).value(  # noqa: E731
            "elastic_rt_restarts_total", reason="worker_failure") or 0
        crash_times = []
        for crash in range(1, args.crashes + 1):
            pid = a.worker_pid(0, timeout_s=120)
            crash_times.append(mark(f"a's worker crash {crash}") if crash in (1, args.crashes) else time.time())
            os.kill(pid, signal.SIGKILL)
            wait_until(f"a restarted after crash {crash}", lambda: restarts() == crash and a.worker_pid(0) != pid, 120)
            watch.poll()
        statuses["after the crashes"] = settled_status(etcd.endpoints, run_id)
        expected = {
            "ElasticRTAgentDown c": ("ElasticRTAgentDown", {"instance": f"127.0.0.1:{ports['c']}"}, c_killed,
                                     "node c killed"),
            "ElasticRTAgentDown b": ("ElasticRTAgentDown", {"instance": f"127.0.0.1:{ports['b']}"}, b_killed,
                                     "node b killed"),
            "ElasticRTRecoverySlow": ("ElasticRTRecoverySlow", {"run_id": run_id}, b_killed,
                                      f"node b killed, below MIN until a replacement started {args.replace_after_s:g} s later"),
            "ElasticRTRestartStorm": ("ElasticRTRestartStorm", {"run_id": run_id}, crash_times[-1],
                                      f"a's worker crash {args.crashes}, the restart that made more than 5 in 15 min"),
        }
        deadline = time.time() + args.max_wait_s
        while time.time() < deadline and not all(watch.first(n, "firing", **lb) for n, lb, _, _ in expected.values()):
            watch.poll()
            time.sleep(1)
        ended = time.time()
        empty = render(prom.url, run_id=run_id, start=started, end=ended, out=args.png, marks=events,
                       title=f"The shipped elastic-rt dashboard during a node-loss run (minutes since the agents "
                             f"started; scrape every {args.interval_s} s)")
        alerts = {}
        for key, (name, labels, fault_at, fault) in expected.items():
            pending, firing = watch.first(name, "pending", **labels), watch.first(name, "firing", **labels)
            alerts[key] = {"fault": fault, "fault_at": fault_at, "pending_at": pending, "firing_at": firing,
                           "fault_to_pending_s": None if pending is None else round(pending - fault_at, 1),
                           "fault_to_firing_s": None if firing is None else round(firing - fault_at, 1)}
        others = sorted({dict(k)["alertname"] for k, v in watch.seen.items() if "firing" in v} -
                        {v[0] for v in expected.values()})
        return {"run_id": run_id, "started": started, "ended": ended, "events": events, "alerts": alerts,
                "other_alerts_firing": others, "recovery_after_second_loss_s": round(recovered - b_killed, 1),
                "replacement_started_after_s": round(d_started - b_killed, 1), "panels_without_data": empty,
                "status": statuses, "png": os.path.relpath(args.png, REPO)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval-s", type=int, default=15, help="scrape and evaluation interval (shipped: 15)")
    p.add_argument("--baseline-s", type=float, default=60.0, help="seconds of steady training before the faults")
    p.add_argument("--second-loss-after-s", type=float, default=45.0)
    p.add_argument("--replace-after-s", type=float, default=130.0, help="seconds a stays below MIN")
    p.add_argument("--crashes", type=int, default=4)
    p.add_argument("--max-wait-s", type=float, default=600.0, help="give up on alerts that did not fire by then")
    p.add_argument("--png", default=os.path.join(REPO, "docs", "img", "dashboard-node-loss.png"))
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args(argv)
    git = provenance(args.allow_dirty)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="elastic-rt-alerts-") as tmp:
        result = run(args, Path(tmp))
    stamp = datetime.date.today().isoformat()
    payload = {"benchmark": "alert_latency", "date": stamp, "provenance": git,
               "host": {"cpus": os.cpu_count(), "loadavg_at_start": list(load_start),
                        "loadavg_at_end": list(os.getloadavg())},
               "settings": {k: v for k, v in vars(args).items() if k not in ("out", "allow_dirty")}, **result}
    lines = [f"alert latency {stamp}: code {git['commit']}{' (dirty)' if git['dirty'] else ''}, shipped rules and "
             f"scrape config, scrape and evaluation every {args.interval_s} s; load average "
             f"{load_start[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs)", "",
             f"{'alert':<24} {'fault':<70} {'to pending':>11} {'to firing':>10}"]
    for key, a in result["alerts"].items():
        fmt = lambda v: "-" if v is None else f"{v:.1f} s"  # noqa: E731
        lines.append(f"{key:<24} {a['fault']:<70} {fmt(a['fault_to_pending_s']):>11} {fmt(a['fault_to_firing_s']):>10}")
    lines += ["", f"recovery after the second node loss: {result['recovery_after_second_loss_s']} s "
              f"(replacement started after {result['replacement_started_after_s']} s)",
              f"other alerts that fired: {', '.join(result['other_alerts_firing']) or 'none'}",
              f"panels without data: {', '.join(result['panels_without_data']) or 'none'}; picture: {result['png']}"]
    write_results(args.out, "alert-latency", stamp, payload, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
