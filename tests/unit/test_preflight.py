"""The pre-flight node test's verdict (pure), its exchange through a real c10d store between threads
standing in for nodes, `doctor --bench` rows, and the matmul itself on this CPU."""

from __future__ import annotations

import argparse
import threading

import pytest
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from elastic_rt.doctor import bench
from elastic_rt.doctor.command import DoctorOptions, DoctorSources, bench_rows, options_from_args
from elastic_rt.checks.model import Status
from elastic_rt.doctor.preflight import (
    Finding,
    NodeReport,
    Preflight,
    PreflightMode,
    PreflightSettings,
    PreflightVerdict,
    judge,
)
from elastic_rt.errors import HealthCheckError, NodeExcludedError, RoundRejectedError
from elastic_rt.doctor.preflight_metrics import PreflightMetrics


def _report(node: str, compute: dict[int, float], link: float | None = 0.01, error: str = "") -> NodeReport:
    return NodeReport(node=node, compute_s=compute, link_s=link, error=error)


def test_a_slow_device_names_its_node_and_only_it():
    reports = [_report("a", {0: 0.010, 1: 0.011}), _report("b", {0: 0.010, 1: 0.031}), _report("c", {0: 0.012})]
    v = judge(reports, ["a", "b", "c"], threshold=1.5, min_nodes=1, exclude=True)
    assert [(x.node, x.finding) for x in v.named] == [("b", Finding.COMPUTE)]
    assert "local rank 1" in v.named[0].detail and "2.82x" in v.named[0].detail
    assert v.excluded == ("b",) and v.kept == ""
    assert PreflightVerdict.from_json(v.to_json()) == v


def test_a_slow_link_is_named_only_when_both_its_ring_links_are_slow():
    # b's NIC is slow: the links a->b (measured at b) and b->c (at c) are slow; a and c have one fast link each
    reports = [_report("a", {0: 0.01}, 0.010), _report("b", {0: 0.01}, 0.050), _report("c", {0: 0.01}, 0.052),
               _report("d", {0: 0.01}, 0.011)]
    v = judge(reports, ["a", "b", "c", "d"], threshold=1.5, min_nodes=1, exclude=False)
    assert [(x.node, x.finding) for x in v.named] == [("b", Finding.LINK)] and v.excluded == ()
    # two nodes: one pair of links, no telling which end is slow: nobody is named for it
    two = judge([_report("a", {0: 0.01}, 0.010), _report("b", {0: 0.01}, 0.050)], ["a", "b"], threshold=1.5,
                min_nodes=1, exclude=True)
    assert two.named == ()


def test_failed_and_missing_nodes_are_named_and_exclusion_keeps_min_nodes():
    reports = [_report("a", {0: 0.01}), None, _report("c", {}, None, error="compute test failed: cuda:0: Xid 79"),
               _report("d", {0: 0.05})]
    v = judge(reports, ["a", "group rank 1", "c", "d"], threshold=1.5, min_nodes=2, exclude=True)
    assert {(x.node, x.finding) for x in v.named} == {("group rank 1", Finding.MISSING), ("c", Finding.FAILED),
                                                        ("d", Finding.COMPUTE)}
    assert len(v.excluded) == 2 and "d" not in v.excluded  # the broken ones first; d kept for MIN
    assert "d kept" in v.kept and "(2)" in v.kept


def test_a_healthy_job_names_nobody():
    reports = [_report(n, {0: 0.010 + i * 0.001, 1: 0.011}, 0.01 + i * 0.001) for i, n in enumerate("abcd")]
    v = judge(reports, list("abcd"), threshold=1.5, min_nodes=1, exclude=True)
    assert v.named == () and v.excluded == ()


class _Nodes:
    """Threads standing in for nodes: each runs Preflight.on_round on one shared store."""

    def __init__(self, compute: dict[str, float], *, mode=PreflightMode.EXCLUDE, timeout_s=30.0, link=None):
        self.store = dist.HashStore()
        self.names = list(compute)
        self.outcome: dict[str, object] = {}
        self.registry = CollectorRegistry()
        self.flights = {}
        for name, seconds in compute.items():
            metrics = PreflightMetrics(registry=self.registry, run_id="job", node=name) if name == "b" else None
            self.flights[name] = Preflight(
                node=name, settings=PreflightSettings(mode=mode, timeout_s=timeout_s), nproc=1, metrics=metrics,
                compute_runner=lambda devices, seconds=0.0, timeout_s=0.0, s=seconds: {
                    0: bench.ComputeResult(device="cpu", size=8, dtype="float32", iters=5, seconds=s)},
                link_runner=link or (lambda **kw: 0.01))
            self.flights[name].run_compute(["cpu"])

    def run(self) -> None:
        def one(rank: int, name: str) -> None:
            try:
                self.flights[name].on_round(round=0, store=self.store, group_rank=rank,
                                            group_world_size=len(self.names), master_addr="127.0.0.1")
                self.outcome[name] = None
            except Exception as exc:  # noqa: BLE001 - the outcome under test
                self.outcome[name] = exc

        threads = [threading.Thread(target=one, args=(r, n)) for r, n in enumerate(self.names)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)


def test_exclude_the_slow_node_leaves_and_the_others_meet_again():
    nodes = _Nodes({"a": 0.01, "b": 0.05, "c": 0.011})
    nodes.run()
    assert isinstance(nodes.outcome["b"], NodeExcludedError) and nodes.outcome["b"].exit_code == 4
    assert "compute" in str(nodes.outcome["b"]) and "4.55x" in str(nodes.outcome["b"])
    for name in "ac":
        assert isinstance(nodes.outcome[name], RoundRejectedError) and nodes.outcome[name].nodes == ("b",)
    assert nodes.registry.get_sample_value("elastic_rt_preflight_slow", {"run_id": "job", "node": "b"}) == 1.0
    assert nodes.registry.get_sample_value("elastic_rt_preflight_compute_ratio",
                                           {"run_id": "job", "node": "b", "local_rank": "0"}) == pytest.approx(0.05 / 0.011)
    # a re-formation is not tested again (--preflight-rounds first)
    nodes.flights["a"].on_round(round=1, store=None, group_rank=0, group_world_size=2)


def test_report_names_without_stopping_anyone():
    nodes = _Nodes({"a": 0.01, "b": 0.05}, mode=PreflightMode.REPORT)
    nodes.run()
    assert nodes.outcome == {"a": None, "b": None}
    assert [x.node for x in nodes.flights["a"].verdict.named] == ["b"]


def test_a_ring_test_that_fails_names_the_node_and_a_missing_verdict_is_skipped():
    def link(**kw):
        if kw["rank"] == 1:
            raise HealthCheckError("ring test (gloo, 2 nodes, 8388608 bytes) failed: Connection reset by peer")
        return 0.01

    nodes = _Nodes({"a": 0.01, "b": 0.01}, link=link, mode=PreflightMode.REPORT)
    nodes.run()
    (named,) = nodes.flights["a"].verdict.named
    assert (named.node, named.finding) == ("b", Finding.FAILED) and "Connection reset" in named.detail
    lone = Preflight(node="x", settings=PreflightSettings(mode=PreflightMode.EXCLUDE, timeout_s=0.5), nproc=1,
                     compute_runner=lambda *a, **k: {}, link_runner=lambda **kw: 0.01)
    lone.on_round(round=0, store=dist.HashStore(), group_rank=1, group_world_size=2)  # rank 0 never answers
    assert lone.verdict is None


def test_doctor_bench_rows_fail_the_slow_device():
    results = {i: bench.ComputeResult(device=f"cuda:{i}", size=8192, dtype="bfloat16", iters=50, seconds=s)
               for i, s in enumerate((0.0016, 0.0017, 0.0016, 0.0040))}
    sources = DoctorSources(env={}, compute_bench=lambda devices, **kw: results, devices=lambda: list("0123"))
    rows = bench_rows(DoctorOptions(bench_s=1.0), sources)
    assert [(r.name, r.status) for r in rows] == [("compute cuda:0", Status.OK), ("compute cuda:1", Status.OK),
                                                    ("compute cuda:2", Status.OK), ("compute cuda:3", Status.FAIL)]
    assert "TFLOP/s" in rows[0].detail and "2.50x the node's median" in rows[3].detail

    def broken(devices, **kw):
        raise HealthCheckError("compute test failed: local rank 0 (cuda:0): RuntimeError: CUDA error")

    (row,) = bench_rows(DoctorOptions(bench_s=1.0), DoctorSources(env={}, compute_bench=broken, devices=lambda: ["x"]))
    assert row.status is Status.FAIL and "CUDA error" in row.detail


def test_doctor_bench_flags():
    args = argparse.Namespace(timeout=3.0, rdzv_endpoint="", rdzv_conf="", ntp_server=[], min_free_gb=1.0,
                              checkpoint_url="file://x", max_clock_offset=0.5, sysfs_root="/sys", bench=True,
                              bench_seconds=0.5)
    assert options_from_args(args).bench_s == 0.5
    assert options_from_args(argparse.Namespace(**{**vars(args), "bench": False})).bench_s == 0.0


def test_matmul_on_this_cpu():
    r = bench.run_matmul("cpu", 0.01, size=64)
    assert r.windows >= bench.MIN_WINDOWS and r.iters >= r.windows and r.seconds > 0 and r.dtype == "float32"
    assert f"(median of {r.windows} windows, {r.iters} matmuls)" in r.describe()
    assert bench.local_devices(3, cuda_count=0) == ["cpu"] * 3
    assert bench.local_devices(2, cuda_count=8) == ["cuda:0", "cuda:1"]


class _Throttled:
    """A clock and an op as a CPU quota of 0.1 CPU makes them: 1 ms ops, 10 in a row, then a 90 ms stall."""

    def __init__(self) -> None:
        self.now, self.ops = 0.0, 0

    def clock(self) -> float:
        return self.now

    def op(self) -> None:
        self.ops += 1
        self.now += 0.001 + (0.090 if self.ops % 10 == 0 else 0.0)


def test_a_quota_that_stalls_between_fast_ops_shows_in_the_windows():
    t = _Throttled()
    windows, ops = bench.per_op_seconds(t.op, 2.0, clock=t.clock)
    assert len(windows) >= 7 and ops == t.ops
    median = sorted(windows)[len(windows) // 2]
    assert 0.008 <= median <= 0.012, windows  # 10 ms per op, as the process sees it; one by one: 1 ms


def test_windows_are_shortened_to_fit_the_minimum_count_into_a_short_run():
    t = _Throttled()
    windows, _ = bench.per_op_seconds(t.op, 0.01, clock=t.clock)
    assert len(windows) == bench.MIN_WINDOWS  # 2 ms windows: 2 ops each, the stall inside one of them
