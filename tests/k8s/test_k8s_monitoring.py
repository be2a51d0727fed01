"""k8s/monitoring: alert rules pass promtool (syntax and unit tests) where it is installed,
always pass a structural check, and every elastic_rt_* name in the rules and the
dashboard is one the agent exports and docs/metrics.md documents."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from k8s_support import K8S, REPO, load_docs
from tests.support.tools import needs_tool

RULES = K8S / "monitoring" / "prometheusrule.yaml"
DASHBOARD = K8S / "monitoring" / "dashboards" / "elastic-rt.json"
ALERTS_TEST = Path(__file__).parent / "data" / "alerts_test.yaml"
FIXTURE_SYSFS = REPO / "tests" / "fixtures" / "sysfs"
METRIC = re.compile(r"(?<![:\w])elastic_rt_[a-z0-9_]+")  # not the middle of a recorded name (level:metric:ops)
RECORDED = re.compile(r"\b[a-z_]+:elastic_rt_[a-z0-9_]+:[a-z0-9_]+\b")

NEED_PROMTOOL = needs_tool("promtool", shutil.which("promtool") is not None,
                           "apt-get install --no-install-recommends prometheus")

# What the issue asks the alerts to cover, by the metric each one reads.
REQUIRED_ALERTS = {
    "ElasticRTRestartStorm": "elastic_rt_restarts_total",
    "ElasticRTRecoverySlow": "elastic_rt_recovery_duration_seconds",
    "ElasticRTClockSkew": "elastic_rt_clock_skew_seconds",
    "ElasticRTRDMAPortDown": "elastic_rt_rdma_state_id",
    "ElasticRTCheckpointStale": "elastic_rt_checkpoint_last_commit_timestamp_seconds",
    # a failing readiness check alerts; a wedged agent (liveness) too, for bare metal
    "ElasticRTNodeNotReady": "elastic_rt_health_check",
    "ElasticRTAgentWedged": "elastic_rt_health_check",
}


def rule_groups() -> list[dict]:
    return load_docs(RULES)[0]["spec"]["groups"]


def alerts() -> list[dict]:
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


def recording_rules() -> list[dict]:
    return [r for g in rule_groups() for r in g["rules"] if "record" in r]


def write_rules(directory: Path, *, annotations: bool = True) -> Path:
    groups = json.loads(json.dumps(rule_groups()))
    if not annotations:
        for g in groups:
            for r in g["rules"]:
                r.pop("annotations", None)
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


# ---- structure (always) ----------------------------------------------------------
def test_required_alerts_exist():
    by_name = {a["alert"]: a for a in alerts()}
    for name, metric in REQUIRED_ALERTS.items():
        assert name in by_name, f"missing alert {name}"
        assert metric in by_name[name]["expr"], f"{name} does not read {metric}"


def test_alert_structure():
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names)), "alert names must be unique"
    for a in alerts():
        assert a["labels"]["severity"] in ("critical", "warning", "info"), a["alert"]
        assert {"summary", "description", "runbook"} <= set(a["annotations"]), a["alert"]
        expr = a["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), a["alert"]
        if "for" in a:
            assert re.fullmatch(r"\d+[smh]", a["for"]), a["alert"]
        for anchor in re.findall(r"docs/deploy\.md#([a-z0-9-]+)", a["annotations"]["runbook"]):
            assert f"\n## {anchor.replace('-', ' ')}".lower() in (REPO / "docs" / "deploy.md").read_text().lower(), \
                f"{a['alert']}: runbook anchor #{anchor} has no section in docs/deploy.md"


def exported_names(tmp: Path) -> set[str]:
    """Sample names a real AgentMetrics exposes once every kind of event happened."""
    from elastic_rt.collectors.clock import SkewEstimate
    from elastic_rt.worker_reports.heartbeat import Heartbeat
    from elastic_rt.metrics.definitions import AgentMetrics
    from elastic_rt.metrics.metrics_observer import MetricsObserver
    from elastic_rt.worker_reports.inbox import WorkerReports
    from elastic_rt.collectors.sntp import NtpResult
    from elastic_rt.collectors.timex import TimexStatus

    timex = TimexStatus(synchronized=True, unsync_flag=False, offset_s=0.0, estimated_error_s=0.0,
                        max_error_s=0.0, frequency_adjustment_ratio=1.0, tick_s=0.01, status=0, state=0)
    reg = CollectorRegistry()
    m = AgentMetrics(
        registry=reg, run_id="job", node="a",
        worker_pids=lambda: {0: os.getpid()},
        heartbeats=lambda: {0: Heartbeat(pid=os.getpid(), seq=1, step=5, timestamp_s=1.0, age_s=0.5)},
        sysfs_root=str(FIXTURE_SYSFS), timex_reader=lambda: timex,
    )
    m.on_rendezvous(round=1, world_size=2, nodes=2, duration_s=1.0)
    m.on_restart("peer_lost")
    m.on_recovered(3.0)
    m.on_worker_state(0, "healthy")
    m.on_checkpoint(step=10, save_duration_s=1.0, blocked_s=0.1)
    m.on_probe(latency_s=0.001, bus_bandwidth_bytes_per_s=1e9)
    m.on_probe_failure()
    m.clock.on_skew(SkewEstimate(offset_s=0.01, round_trip_s=0.002, error_bound_s=0.001, samples=3))
    m.clock.on_ntp(NtpResult(server="ntp", offset_s=0.001, round_trip_s=0.01, stratum=2, leap=0))
    m.clock.on_ntp_failure("ntp")
    # the health checks (/livez, /readyz), which the agent's observer registers beside AgentMetrics
    obs = MetricsObserver(run_id="job", node="a", reports=WorkerReports(str(tmp)), sysfs_root=None)
    obs.on_workers_started({0: os.getpid()})
    obs.on_tick()
    from elastic_rt.goodput.goodput_metrics import GoodputMetrics  # goodput and stragglers

    g = GoodputMetrics(registry=reg, run_id="job", node="a")
    g.on_totals({"productive": 1.0}, uncommitted_s=0.5, ratio=0.9)
    g.on_step_times({0: 0.1}, job_median_s=0.1)
    g.on_stragglers({0}, {0})
    g.step_histogram.observe(0, 0.1, 10)
    names = set()
    for fam in [*text_string_to_metric_families(generate_latest(reg).decode()),
                *text_string_to_metric_families(generate_latest(obs.registry).decode())]:
        names.add(fam.name)
        names |= {s.name for s in fam.samples}
    return names


def referenced_names() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a in alerts() + recording_rules():
        for n in METRIC.findall(a["expr"]):
            out.setdefault(n, set()).add(f"rule {a.get('alert') or a['record']}")
    dash = json.loads(DASHBOARD.read_text())
    for p in dash["panels"]:
        for t in p.get("targets", []):
            for n in METRIC.findall(t["expr"]):
                out.setdefault(n, set()).add(f"panel {p['title']!r}")
    for v in dash["templating"]["list"]:
        for n in METRIC.findall(json.dumps(v.get("query", ""))):
            out.setdefault(n, set()).add(f"variable {v['name']}")
    return out


def test_metric_names_are_exported_and_documented(tmp_path):
    exported = exported_names(tmp_path)
    doc = (REPO / "docs" / "metrics.md").read_text()
    refs = referenced_names()
    assert refs
    not_exported = {n: sorted(w) for n, w in refs.items() if n not in exported}
    assert not not_exported, f"the agent exports no such series: {not_exported}"
    undocumented = sorted(n for n in refs if re.sub(r"_(bucket|sum|count)$", "", n) not in doc)
    assert not undocumented, f"not in docs/metrics.md: {undocumented}"


def test_recorded_series_the_dashboard_reads_are_recorded():
    recorded = {r["record"] for r in recording_rules()}
    assert all(RECORDED.fullmatch(name) for name in recorded), sorted(recorded)
    used = {(m, p["title"]) for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])
            for m in RECORDED.findall(t["expr"])}
    assert used, "the dashboard reads no recorded series"
    missing = sorted((m, title) for m, title in used if m not in recorded)
    assert not missing, f"panels read series no rule records: {missing}"


def test_dashboard_is_shipped_by_the_monitoring_kustomization():
    k = load_docs(K8S / "monitoring" / "kustomization.yaml")[0]
    gens = k["configMapGenerator"]
    assert any("dashboards/elastic-rt.json" in g["files"] for g in gens)
    assert k["generatorOptions"]["labels"]["grafana_dashboard"] == "1"


# ---- promtool ------------------------------------------------------------------
@NEED_PROMTOOL
def test_promtool_check_rules(tmp_path):
    path = write_rules(tmp_path)
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alerts()) + len(recording_rules())} rules found" in proc.stdout, proc.stdout


@NEED_PROMTOOL
def test_promtool_unit_tests(tmp_path):
    write_rules(tmp_path, annotations=False)
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    proc = subprocess.run(["promtool", "test", "rules", ALERTS_TEST.name], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@NEED_PROMTOOL
def test_every_alert_has_a_promtool_test():
    tested = set(re.findall(r"alertname: (\w+)", ALERTS_TEST.read_text()))
    missing = {a["alert"] for a in alerts()} - tested
    assert not missing, f"alerts without a case in {ALERTS_TEST.name}: {sorted(missing)}"


# ---- a Prometheus without the Operator (k8s/monitoring/prometheus/) ------------------------------------
PLAIN = K8S / "monitoring" / "prometheus"


def test_plain_prometheus_config_scrapes_the_jobs_the_alerts_select():
    cfg = yaml.safe_load((PLAIN / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"elastic-rt-agent", "elastic-rt-etcd"}
    selectors = {a["alert"]: re.search(r'job=~"([^"]+)"', a["expr"]) for a in alerts()}
    for alert in ("ElasticRTAgentDown", "ElasticRTEtcdNoLeader", "ElasticRTEtcdMembersDown"):
        pattern = selectors[alert].group(1)
        assert any(re.fullmatch(pattern, name) for name in jobs), (alert, pattern)
        assert re.fullmatch(pattern, f"ml/{pattern.split('?')[-1]}"), (alert, pattern)  # the Operator's names
    example = json.loads((PLAIN / "elastic-rt-agents.example.json").read_text())
    assert all(set(group) <= {"targets", "labels"} and group["targets"] for group in example)


def test_the_test_scrape_config_may_change_intervals_and_paths_only(tmp_path):
    from tests.support.monitoring import config_differences, rendered_config

    cfg = rendered_config(interval_s=1, rule_file="rules.yml", sd_dir=tmp_path)
    assert config_differences(cfg) == []
    cfg["scrape_configs"][0]["job_name"] = "agents"
    assert config_differences(cfg) != []


@NEED_PROMTOOL
def test_promtool_check_plain_config(tmp_path):
    from tests.support.monitoring import rendered_config

    write_rules(tmp_path)
    cfg = rendered_config(interval_s=15, rule_file=str(tmp_path / "rules.yaml"), sd_dir=tmp_path)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
