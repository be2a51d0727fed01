"""The shipped monitoring (k8s/monitoring) made runnable by a test Prometheus, and the job it watches: the rule
file a plain Prometheus loads, the scrape config rendered for test ports and intervals (and what may differ),
the dashboard's panels as PromQL, the agents' command lines. Used by tests/integration/test_prometheus_e2e.py
and benchmarks/alert_latency.py."""

from __future__ import annotations

import copy
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "k8s" / "monitoring"
RULES = MONITORING / "prometheusrule.yaml"
SCRAPE_CONFIG = MONITORING / "prometheus" / "prometheus.yml"
DASHBOARD = MONITORING / "dashboards" / "elastic-rt.json"
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
        out += [f"{name}: {key}" for key in sorted(set(ia[name]) | set(ib[name])) if ia[name].get(key) != ib[name].get(key)]
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
@dataclass(frozen=True)
class Panel:
    id: int
    title: str
    type: str
    exprs: tuple[str, ...]
    legends: tuple[str, ...]


def dashboard_panels() -> list[Panel]:
    dash = json.loads(DASHBOARD.read_text())
    return [Panel(p["id"], p["title"], p["type"], tuple(t["expr"] for t in p["targets"]),
                  tuple(t.get("legendFormat", "") for t in p["targets"]))
            for p in dash["panels"] if p["type"] != "row"]


def grafana_expand(expr: str, *, run_id: str, range_s: float) -> str:
    """The query Grafana sends: $namespace All (.*), $run_id this run (regex-escaped, as Grafana does for
    a =~ matcher), $__range the dashboard's time range."""
    expr = expr.replace("$namespace", ".*").replace("$run_id", re.escape(run_id).replace("\\", "\\\\"))
    return expr.replace("$__range", f"{max(1, int(range_s))}s")


# ---- the job ----------------------------------------------------------------------------------------
def healthy_sysfs(dest: Path) -> Path:
    """The RDMA sysfs fixture with its healthy port only (an agent refuses to join with a port down)."""
    shutil.copytree(SYSFS_FIXTURE, dest, ignore=lambda d, names: [n for n in names if n == "mlx5_1"])
    return dest


def agent_args(*, endpoint: str, run_id: str, node: str, metrics_port: int, nnodes: str, checkpoint_url: str,
               sysfs_root: Path, ntp_server: str, log_dir: Path, step_sleep_s: float,
               straggler_window_s: float = 2.0) -> list[str]:
    """`elastic-rt launch` arguments of one node of the monitored local-SGD job (runs until killed)."""
    return [
        "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--node-id", node, "--local-addr", "127.0.0.1", "--metrics-port", str(metrics_port),
        "--tee", "3", "--max-restarts", "100", "--rdzv-conf", "last_call_timeout=2",
        "--straggler-window", f"{straggler_window_s:g}", "--checkpoint-url", checkpoint_url,
        "--sysfs-root", str(sysfs_root), "--ntp-server", ntp_server, "--log-dir", str(log_dir),
        str(LOCAL_SGD), "--steps", "100000000", "--sync-every", "5", "--save-every", "20",
        "--step-sleep", f"{step_sleep_s:g}",
    ]
