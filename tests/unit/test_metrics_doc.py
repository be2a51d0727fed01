"""docs/metrics.md's tables are generated from the MetricSpecs and the decision enums, and a metric fed by an
event the agent already reports needs nothing but its spec.

    python -m tests.support.metrics_docs --write docs/metrics.md
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from elastic_rt.decisions import FailureCause, RestartReason
from elastic_rt.metric_spec import WALL_CLOCK, Feed, Kind, MetricSpec, SpecMetrics, table
from elastic_rt.metrics import definitions
from elastic_rt.metrics.definitions import AgentMetrics
from tests.support import metrics_docs

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
REGENERATE = f"run `{metrics_docs.COMMAND}`"
BASE = {"run_id": "job", "node": "a"}


def test_the_generated_tables_of_docs_metrics_md_are_current():
    text = DOC.read_text()
    wanted, missing = metrics_docs.regenerate(text)
    assert not missing, f"docs/metrics.md lost the markers of table(s) {missing}; {REGENERATE}"
    stale = [name for name in metrics_docs.TABLES
             if text[slice(*metrics_docs.span(text, name))] != metrics_docs.render(name)]
    assert not stale, f"docs/metrics.md's table(s) {stale} differ from the definitions; {REGENERATE}"


def test_check_fails_on_a_hand_edited_table_and_write_restores_it(tmp_path):
    doc = tmp_path / "metrics.md"
    doc.write_text(DOC.read_text().replace("| `oom` |", "| `out_of_memory` |", 1))
    assert metrics_docs.main(["--check", str(doc)]) == 1
    assert metrics_docs.main(["--write", str(doc)]) == 0
    assert doc.read_text() == DOC.read_text()


def test_a_missing_marker_is_named(tmp_path, capsys):
    doc = tmp_path / "metrics.md"
    doc.write_text(DOC.read_text().replace(metrics_docs.end("probe"), ""))
    assert metrics_docs.main(["--check", str(doc)]) == 1
    assert "no generated table probe" in capsys.readouterr().err


def test_every_restart_reason_and_failure_cause_has_a_row():
    text = DOC.read_text()
    for member in (*RestartReason, *FailureCause):
        assert f"| `{member}` | " in text and member.meaning in text, member


def test_a_spec_row_says_its_type_labels_meaning_and_buckets():
    spec = MetricSpec(name="elastic_rt_x_seconds", kind=Kind.HISTOGRAM, labels=("local_rank",), help="h.",
                      doc="Meaning.", buckets=(0.5, 1, 2.5))
    assert table([spec]).splitlines()[-1] == (
        "| `elastic_rt_x_seconds` | histogram | run_id, node, local_rank | Meaning. Buckets: 0.5, 1, 2.5. |")


def test_a_new_metric_on_an_existing_event_needs_only_its_spec():
    specs = (
        MetricSpec(name="elastic_rt_test_nodes", kind=Kind.GAUGE, help="h",
                   fed_by=(Feed(event="rendezvous", value="nodes"),)),
        MetricSpec(name="elastic_rt_test_rounds_total", kind=Kind.COUNTER, help="h", zeros=((),),
                   fed_by=(Feed(event="rendezvous"),)),
        MetricSpec(name="elastic_rt_test_restart_timestamp_seconds", kind=Kind.GAUGE, help="h", labels=("reason",),
                   fed_by=(Feed(event="restart", value=WALL_CLOCK),)),
        MetricSpec(name="elastic_rt_test_bandwidth", kind=Kind.HISTOGRAM, help="h", buckets=(1, 10),
                   fed_by=(Feed(event="probe", value="bw"),)),
    )
    reg = CollectorRegistry()
    metrics = SpecMetrics(specs, registry=reg, run_id="job", node="a", wall_clock=lambda: 42.0)
    assert reg.get_sample_value("elastic_rt_test_rounds_total", BASE) == 0  # exported before the first event
    metrics.emit("rendezvous", nodes=3)
    metrics.emit("rendezvous", nodes=2)
    metrics.emit("restart", reason=RestartReason.HANG)
    metrics.emit("probe", bw=None)  # a value that is None leaves the metric alone
    metrics.emit("probe", bw=5)
    assert reg.get_sample_value("elastic_rt_test_nodes", BASE) == 2
    assert reg.get_sample_value("elastic_rt_test_rounds_total", BASE) == 2
    assert reg.get_sample_value("elastic_rt_test_restart_timestamp_seconds", {**BASE, "reason": "hang"}) == 42.0
    assert reg.get_sample_value("elastic_rt_test_bandwidth_count", BASE) == 1
    assert metrics.events() == {"rendezvous", "restart", "probe"}


@pytest.mark.parametrize("spec", [s for s in (*definitions.RENDEZVOUS, *definitions.RECOVERY,
                                               *definitions.CHECKPOINTS, *definitions.PROBE) if s.fed_by],
                         ids=lambda s: s.name)
def test_every_feed_names_an_event_of_agent_metrics_and_one_of_its_arguments(spec):
    for feed in spec.fed_by:
        assert feed.event in definitions.EVENTS
        method = getattr(AgentMetrics, f"on_{feed.event}")
        params = set(inspect.signature(method).parameters) - {"self"}
        if isinstance(feed.value, str):
            assert feed.value in params, f"{spec.name}: on_{feed.event}() has no argument {feed.value!r}"
        assert set(spec.labels) <= params, f"{spec.name}: on_{feed.event}() does not give {spec.labels}"


def test_agent_metrics_refuses_a_spec_fed_by_an_event_it_does_not_have(monkeypatch):
    typo = MetricSpec(name="elastic_rt_typo", kind=Kind.GAUGE, help="h", fed_by=(Feed(event="rendevous"),))
    monkeypatch.setattr(definitions, "PROBE", (*definitions.PROBE, typo))
    with pytest.raises(ValueError, match="rendevous"):
        AgentMetrics(registry=CollectorRegistry(), run_id="job", node="a", sysfs_root=None, timex_reader=None)


def test_every_metric_an_agent_exports_has_a_generated_row():
    """Not only named somewhere in docs/metrics.md: its row comes from its spec, so it cannot go stale."""
    from elastic_rt.collectors.timex import TimexStatus
    from elastic_rt.diagnostics.failure_metrics import FailureMetrics
    from elastic_rt.doctor.preflight_metrics import PreflightMetrics
    from elastic_rt.goodput.goodput_metrics import GoodputMetrics
    from elastic_rt.metrics.definitions import HealthCollector

    timex = TimexStatus(synchronized=True, unsync_flag=False, offset_s=0.0, estimated_error_s=0.0, max_error_s=0.0,
                        frequency_adjustment_ratio=1.0, tick_s=0.01, status=0, state=0)
    reg = CollectorRegistry()
    sysfs = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
    AgentMetrics(registry=reg, run_id="job", node="a", sysfs_root=str(sysfs), timex_reader=lambda: timex)
    GoodputMetrics(registry=reg, run_id="job", node="a")
    FailureMetrics(registry=reg, run_id="job", node="a")
    PreflightMetrics(registry=reg, run_id="job", node="a")
    reg.register(HealthCollector(run_id="job", node="a", results=lambda: [("liveness", "monitor", True)],
                                 last_tick_age_s=lambda: 0.1))
    generated = "\n".join(metrics_docs.render(name) for name in metrics_docs.TABLES)
    names = {family.name for family in reg.collect()}
    assert len(names) > 80  # every kind of metric is in the registry: RDMA and timex included
    assert sorted(n for n in names if f"| `{n}" not in generated) == []
