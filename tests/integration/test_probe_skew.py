"""Collective probe and store-based clock skew against a real etcd store, several parties in threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from elastic_rt.errors import HealthCheckError
from elastic_rt.collectors.probe import run_allreduce_probe, spawn_probe
from elastic_rt.collectors.skew import measure_skew_via_store, serve_skew
from elastic_rt.rendezvous.store import EtcdStore


def _in_threads(fn, n):
    results, errors = [None] * n, []

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return results, errors


def test_gloo_probe_over_etcd_store(etcd_client, run_id):
    store = EtcdStore(etcd_client, f"/elastic-rt/{run_id}/rounds/0000000001/store/")
    results, errors = _in_threads(
        lambda r: run_allreduce_probe(dist.PrefixStore("probe", store), r, 2, nbytes=1 << 20, timeout_s=30,
                                      backend="gloo"), 2)
    assert not errors, errors
    for res in results:
        assert res.backend == "gloo" and res.world_size == 2 and res.nbytes == 1 << 20
        assert res.latency_s > 0
        assert res.busbw_bytes_per_s == pytest.approx(res.algbw_bytes_per_s)  # 2(n-1)/n = 1 for n = 2


def test_probe_with_a_missing_peer_fails_within_timeout(etcd_client, run_id):
    store = EtcdStore(etcd_client, f"/elastic-rt/{run_id}/store/")
    t0 = time.monotonic()
    with pytest.raises(HealthCheckError, match="collective probe"):
        run_allreduce_probe(dist.PrefixStore("probe", store), 0, 2, nbytes=1024, timeout_s=2, backend="gloo")
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("shift_s", [0.75, -2.5])
def test_skew_between_two_agents_with_shifted_clock(etcd_client, run_id, shift_s):
    store = EtcdStore(etcd_client, f"/elastic-rt/{run_id}/skew/")
    serve_skew(store, [1], samples=6, clock=time.time)
    est = measure_skew_via_store(store, 1, samples=6, clock=lambda: time.time() + shift_s)
    # rank 0 minus this node: the node runs ahead by shift_s
    assert est.offset_s == pytest.approx(-shift_s, abs=max(0.02, est.error_bound_s))
    assert 0 < est.round_trip_s < 1.0


def test_probe_in_child_processes_meeting_on_a_tcp_store():
    from torch.distributed.elastic.utils.distributed import get_free_port

    port = get_free_port()
    results, errors = _in_threads(
        lambda r: spawn_probe(master_addr="127.0.0.1", master_port=port, rank=r, world_size=2,
                              nbytes=1 << 16, timeout_s=20, backend="gloo"), 2)
    assert not errors, errors
    assert all(r.world_size == 2 and r.latency_s > 0 for r in results)


def test_probe_child_alone_fails_with_one_line():
    from torch.distributed.elastic.utils.distributed import get_free_port

    with pytest.raises(HealthCheckError, match="collective probe"):
        spawn_probe(master_addr="127.0.0.1", master_port=get_free_port(), rank=0, world_size=2,
                    nbytes=1024, timeout_s=3, backend="gloo")
