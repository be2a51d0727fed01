"""benchmarks/scale_model.py: calibration from results rows, the simulation's limits, its command line."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import scale_model as model  # noqa: E402


def _row(n: int, *, clients_s: float, etcd_s: float, reform_clients_s: float) -> dict:
    return {
        "kind": "etcd-v3", "n": n, "meet_s": 1.0, "reform_s": 0.5,
        "req_per_node_round": 11.0, "reform_req_per_node": 2.0, "idle_req_per_node_s": 1.0,
        "idle_client_cpu_ms_per_node_s": 0.2,
        "meet_cpu_s": {"clients": clients_s, "etcd": etcd_s, "wall": 1.0},
        "reform_cpu_s": {"clients": reform_clients_s, "etcd": 0.0, "wall": 0.5},
        "round": {"requests": {"Range": 6.0 * n, "Txn": 3.0 * n, "Put": 1.0 * n, "LeaseGrant": 1.0 * n}},
        "reform_round": {"requests": {"Txn": 2.0 * (n - 1)}},
    }


def _costs(**kw) -> model.Costs:
    base = dict(req_per_round=11, req_per_reform=2, client_cpu_s_per_round=0.002, client_cpu_s_per_reform=0.001,
                etcd_cpu_s_per_request=0.0002, write_share=0.5, keepalive_client_cpu_s=0.0, keepalive_etcd_cpu_s=0.0)
    return model.Costs(**{**base, **kw})


def test_calibration_takes_per_node_costs_from_the_rows():
    rows = [_row(256, clients_s=0.768, etcd_s=0.2, reform_clients_s=0.255),
            _row(1024, clients_s=3.072, etcd_s=0.9, reform_clients_s=1.023),
            {"kind": "etcd-v3", "n": 2048, "meet_s": None, "reform_s": None}]  # did not meet: not used
    costs = model.calibrate(rows)
    assert costs.client_cpu_s_per_round == pytest.approx(0.003)
    assert costs.client_cpu_s_per_reform == pytest.approx(0.001)
    assert costs.req_per_round == 11.0 and costs.req_per_reform == 2.0
    # etcd CPU over every request (round and re-form): the median of 0.2/(11*256+2*255) and 0.9/(11*1024+2*1023)
    assert costs.etcd_cpu_s_per_request == pytest.approx((0.2 / 3326 + 0.9 / 13310) / 2)
    assert costs.write_share == pytest.approx(5 / 11)
    assert costs.keepalive_client_cpu_s == pytest.approx(0.0002)


def test_calibration_without_a_usable_row_says_what_to_run():
    with pytest.raises(ValueError, match="run benchmarks/rendezvous_scale.py"):
        model.calibrate([{"kind": "etcd-v3", "n": 8, "meet_s": 1.0, "reform_s": 1.0}])  # no reform_cpu_s


def test_cpu_bound_shared_machine_takes_the_total_work_over_its_cores():
    costs = _costs()
    n = 1000
    work = n * (costs.client_cpu_s_per_round + costs.req_per_round * costs.etcd_cpu_s_per_request)
    meet = model.predict(n, costs, model.Machine(shared_cores=2, rtt_s=0.0))["meet_s"]
    assert work / 2 <= meet <= work / 2 * 1.05


def test_keepalives_take_their_share_of_a_shared_machine():
    quiet = model.predict(512, _costs(), model.Machine(shared_cores=2, rtt_s=0.0))["meet_s"]
    busy = model.predict(512, _costs(keepalive_client_cpu_s=0.001), model.Machine(shared_cores=2, rtt_s=0.0,
                                                                                 lease_ttl_s=3.0))["meet_s"]
    # 512 beats a second of 1 ms each: a quarter of the 2 cores
    assert busy == pytest.approx(quiet / 0.744, rel=0.01)


def test_one_agent_per_machine_is_bound_by_etcd_and_the_round_trips():
    costs = _costs(etcd_cpu_s_per_request=0.0)
    real = model.Machine(rtt_s=0.001, write_latency_s=0.0)
    meet = model.predict(64, costs, real)["meet_s"]
    # nothing queues: 11 requests one after another, each its client slice and a round trip
    assert meet == pytest.approx(11 * (0.002 / 11 + 0.001))
    # a write's quorum round trip and fsync add to the writes' latency, without queueing
    slow = model.predict(64, costs, model.Machine(rtt_s=0.001, write_latency_s=0.002))["meet_s"]
    assert meet + 0.002 <= slow <= meet + 11 * 0.002
    # etcd's capacity then bounds it: 3 members x 8 cores, each request's CPU spread over the members
    heavy = _costs(etcd_cpu_s_per_request=0.003, client_cpu_s_per_round=0.0)
    n = 1024
    serial_bound = n * 11 * heavy.write_share * 0.003 / real.members * real.serial_share  # one apply loop
    assert model.predict(n, heavy, real)["meet_s"] >= serial_bound


def test_the_round_waits_for_every_node_before_the_last_request():
    costs = _costs(req_per_round=2, client_cpu_s_per_round=0.0, etcd_cpu_s_per_request=0.001)
    one_core = model.Machine(shared_cores=1, rtt_s=0.0)
    # 10 first requests (10 ms), then 10 last ones: 20 ms, however the nodes are interleaved
    assert model.predict(10, costs, one_core)["meet_s"] == pytest.approx(0.020)


def test_command_line_reads_results_and_fails_in_one_line(tmp_path, capsys):
    assert model.main([str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.json" in err[0]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": [_row(256, clients_s=0.768, etcd_s=0.2, reform_clients_s=0.255)],
                                "settings": {"rdzv_conf": {}}, "etcd": {"version": "3.4.23", "members": 3}}))
    assert model.main([str(path), "--nodes", "512"]) == 0
    out = capsys.readouterr().out
    assert "| 256 | 1.00 |" in out and "| 512 |" in out
