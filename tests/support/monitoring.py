"""The shipped monitoring (k8s/monitoring) made runnable by a test Prometheus, and the job it watches: the rule
file a plain Prometheus loads, the scrape config rendered for test ports and intervals (and what may differ),
the dashboard's panels as PromQL, the agents of a local-SGD job scraped by real Prometheus servers. Used by
tests/integration/test_prometheus_e2e.py, tests/support/node_loss.py and benchmarks/alert_latency.py."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from benchmarks.dashboard_queries import dashboard_panels, grafana_expand
from etcd_testbed.server import free_port
from tests.chaos.harness import Node
from tests.support.prometheus import PrometheusServer
from tests.unit.test_collectors_clock import LoopbackNtpServer

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "k8s" / "monitoring"
RULES = MONITORING / "prometheusrule.yaml"
SCRAPE_CONFIG = MONITORING / "prometheus" / "prometheus.yml"
LOCAL_SGD = REPO / "tests" / "chaos" / "scripts" / "goodput_local_sgd.py"
SYSFS_FIXTURE = REPO / "tests" / "fixtures" / "sysfs"
AGENT_JOB, ETCD_JOB = "elastic-rt-agent", "elastic-rt-etcd"


# ---- rules ------------------------------------------------------------------------------------------
def shipped_rules() -> dict:
    """The rule file of a Prometheus without the Operator: the PrometheusRule's spec, unchanged."""
    return copy.deepcopy(yaml.safe_load(RULES.read_text())["spec"])


def with_short_for(rules: dict, for_s: str) -> dict:
    """The same rules with every `for:` set to `for_s` (nothing else changes)."""
    out = copy.deepcopy(rules)
    for group in out["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = for_s
    return out


def rule_differences(a: dict, b: dict) -> list[str]:
    """'group/rule: key' for every key whose value differs between two rule files of the same rules."""
    def index(rules: dict) -> dict[str, dict]:
        return {f"{g['name']}/{r.get('alert') or r['record']}": r for g in rules["groups"] for r in g["rules"]}

    ia, ib = index(a), index(b)
    out = [f"{name}: only in one" for name in sorted(set(ia) ^ set(ib))]
    for name in sorted(set(ia) & set(ib)):
        out += [f"{name}: {key}" for key in sorted(set(ia[name]) | set(ib[name]))
                if ia[name].get(key) != ib[name].get(key)]
    return out


# ---- scrape config ----------------------------------------------------------------------------------
# The keys the test may change in k8s/monitoring/prometheus/prometheus.yml: intervals, and where the files are.
TEST_CHANGES = frozenset({"scrape_interval", "evaluation_interval", "scrape_timeout", "rule_files", "files",
                          "refresh_interval"})


def rendered_config(*, interval_s: int, rule_file: str, sd_dir: Path) -> dict:
    """The shipped scrape config with `interval_s` for scrapes and rule evaluation, the rule file and the
    file_sd files under sd_dir (each named as in the shipped pattern, without its glob)."""
    cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
    every = f"{interval_s}s"
    cfg["global"].update(scrape_interval=every, evaluation_interval=every)
    cfg["rule_files"] = [rule_file]
    for job in cfg["scrape_configs"]:
        job.update(scrape_interval=every, scrape_timeout=every)
        for sd in job["file_sd_configs"]:
            sd["files"] = [str(sd_dir / Path(f).name.replace("*", "")) for f in sd["files"]]
            sd["refresh_interval"] = every
    return cfg


def config_differences(rendered: dict) -> list[str]:
    """The shipped config and `rendered` (as JSON) when they differ in more than TEST_CHANGES, else []."""
    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in TEST_CHANGES}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    a, b = strip(yaml.safe_load(SCRAPE_CONFIG.read_text())), strip(rendered)
    return [] if a == b else [json.dumps(a, sort_keys=True), json.dumps(b, sort_keys=True)]


def write_targets(path: Path, targets: list[str]) -> None:
    """A file_sd file, in the format of k8s/monitoring/prometheus/elastic-rt-agents.example.json."""
    path.write_text(json.dumps([{"targets": targets, "labels": {"cluster": "test"}}]))


# ---- dashboard --------------------------------------------------------------------------------------
def empty_panels(prom: PrometheusServer, *, run_id: str, start: float, end: float) -> list[str]:
    """'title: query' of every dashboard expression that has no finite value between start and end, as Grafana
    would query it for this run."""
    empty = []
    for panel in dashboard_panels():
        for expr in panel.exprs:
            query = grafana_expand(expr, run_id=run_id, range_s=end - start)
            series = prom.query_range(query, start, end, max(1.0, (end - start) / 500))
            if not any(math.isfinite(float(v)) for s in series for _, v in s["values"]):
                empty.append(f"{panel.title!r}: {query}")
    return empty


# ---- the job ----------------------------------------------------------------------------------------
def healthy_sysfs(dest: Path) -> Path:
    """The RDMA sysfs fixture with its healthy port only (an agent refuses to join with a port down)."""
    shutil.copytree(SYSFS_FIXTURE, dest, ignore=lambda d, names: [n for n in names if n == "mlx5_1"])
    return dest


def agent_args(*, endpoint: str, run_id: str, node: str, metrics_port: int, nnodes: str, checkpoint_url: str,
               sysfs_root: Path, ntp_server: str, log_dir: Path,
               straggler_window_s: float = 2.0) -> list[str]:
    """`elastic-rt launch` arguments of one node of the monitored local-SGD job (runs until killed); the node's
    step time goes through its environment (step_env): every node of a job runs the same command line."""
    return [
        "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--node-id", node, "--local-addr", "127.0.0.1", "--metrics-port", str(metrics_port),
        "--tee", "3", "--max-restarts", "100", "--rdzv-conf", "last_call_timeout=2",
        "--straggler-window", f"{straggler_window_s:g}", "--checkpoint-url", checkpoint_url,
        "--sysfs-root", str(sysfs_root), "--ntp-server", ntp_server, "--log-dir", str(log_dir),
        # the restart storm kills a worker before its first step again and again: that is the crash-loop
        # verdict's pattern, turned off here so the alert sees the storm
        "--crash-loop-repeats", "0", "--crash-loop-no-step", "0",
        str(LOCAL_SGD), "--steps", "100000000", "--sync-every", "5", "--save-every", "20",
    ]


def step_env(step_sleep_s: float) -> dict[str, str]:
    """The environment that sets a node's seconds per step in goodput_local_sgd.py."""
    return {"GOODPUT_STEP_SLEEP": f"{step_sleep_s:g}"}


RULE_FILE = "elastic-rt-rules.yml"


@dataclass
class MonitoredJob:
    """Agents of the monitored job on real etcd, and Prometheus servers scraping them through file_sd."""

    run_id: str
    endpoint: str
    tmp: Path
    servers: dict[str, PrometheusServer]
    ntp_addr: str
    sysfs: Path
    ports: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def targets(self, names: str) -> None:
        """Scrape the agents of these nodes (their metrics ports are chosen here)."""
        for name in names:
            self.ports.setdefault(name, free_port())
        write_targets(self.tmp / "sd" / "elastic-rt-agents.json",
                      [f"127.0.0.1:{self.ports[n]}" for n in sorted(self.ports)])

    def start(self, name: str, step_sleep_s: float) -> Node:
        self.targets(name)
        self.nodes[name] = Node(agent_args(
            endpoint=self.endpoint, run_id=self.run_id, node=name, metrics_port=self.ports[name], nnodes="2:3",
            checkpoint_url=f"file://{self.tmp}/ck", sysfs_root=self.sysfs, ntp_server=self.ntp_addr,
            log_dir=self.tmp / f"log-{name}"), name=name, env=step_env(step_sleep_s))
        return self.nodes[name]

    def logs(self) -> str:
        return "\n".join(f"--- {n.name}\n{n.output[-1500:]}" for n in self.nodes.values())


def monitored_job(stack: contextlib.ExitStack, *, etcd_endpoint: str, tmp: Path, rule_sets: dict[str, dict],
                  interval_s: int, prefix: str = "mon") -> MonitoredJob:
    """One Prometheus per rule set (name -> rule file), each with the shipped scrape config rendered for
    interval_s (checked: nothing else differs), scraping the agents and etcd; an SNTP server and a sysfs with
    a healthy RDMA port for the agents. Nodes are started with MonitoredJob.start(); all of it is stopped
    when `stack` closes."""
    sd = tmp / "sd"
    sd.mkdir()
    write_targets(sd / "elastic-rt-agents.json", [])
    write_targets(sd / "elastic-rt-etcd.json", etcd_endpoint.split(","))
    servers = {}
    for name, rules in rule_sets.items():
        cfg = rendered_config(interval_s=interval_s, rule_file=RULE_FILE, sd_dir=sd)
        differences = config_differences(cfg)
        if differences:
            raise AssertionError(f"the rendered scrape config differs from the shipped one: {differences}")
        servers[name] = stack.enter_context(PrometheusServer(config=cfg, rule_files={RULE_FILE: rules},
                                                             workdir=tmp / name))
    ntp = stack.enter_context(LoopbackNtpServer(shift_s=0.02))
    job = MonitoredJob(run_id=f"{prefix}-{uuid.uuid4().hex[:8]}", endpoint=etcd_endpoint, tmp=tmp, servers=servers,
                       ntp_addr=ntp.addr, sysfs=healthy_sysfs(tmp / "sysfs"))
    stack.callback(lambda: [n.cleanup() for n in job.nodes.values()])
    return job
