"""c10d Store contract: the same cases against torch's TCPStore and elastic-rt's EtcdStore."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_rt.rendezvous.store import EtcdStore


@pytest.fixture(params=["tcp", "etcd"])
def store_pair(request, etcd_client, run_id):
    """Two clients of one store (so waits can be released by 'another process')."""
    if request.param == "tcp":
        a = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=5), wait_for_workers=False)
        b = dist.TCPStore("127.0.0.1", a.port, 2, False, timeout=timedelta(seconds=5))
    else:
        prefix = f"/elastic-rt/{run_id}/store/"
        a = EtcdStore(etcd_client, prefix, timedelta(seconds=5))
        b = EtcdStore(etcd_client, prefix, timedelta(seconds=5))
    return a, b


def test_set_get(store_pair):
    a, b = store_pair
    a.set("k", "v")
    assert b.get("k") == b"v"
    a.set("bin", bytes([0, 255, 1]))
    assert b.get("bin") == bytes([0, 255, 1])


def test_get_waits_for_key_set_later(store_pair):
    a, b = store_pair
    released = threading.Event()

    def setter():
        released.wait(5)
        a.set("late", "x")

    t = threading.Thread(target=setter)
    t.start()
    released.set()
    assert b.get("late") == b"x"
    t.join()


def test_get_missing_times_out(store_pair):
    a, _ = store_pair
    a.set_timeout(timedelta(milliseconds=300))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        a.get("never")
    assert time.monotonic() - t0 >= 0.25


def test_add_is_atomic_across_clients(store_pair):
    a, b = store_pair
    assert a.add("c", 1) == 1
    assert b.add("c", 5) == 6
    assert a.add("c", -2) == 4
    errors = []

    def bump(s):
        try:
            for _ in range(20):
                s.add("n", 1)
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    ts = [threading.Thread(target=bump, args=(s,)) for s in (a, b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert int(a.get("n")) == 40


def test_compare_set(store_pair):
    a, b = store_pair
    assert a.compare_set("cs", "", "v1") == b"v1"  # missing + empty expected: set
    assert b.compare_set("cs", "wrong", "v2") == b"v1"  # mismatch: current value
    assert b.compare_set("cs", "v1", "v2") == b"v2"
    assert a.get("cs") == b"v2"
    assert a.compare_set("absent", "x", "y") == b"x"  # missing + non-empty expected: not set
    assert not a.check(["absent"])


def test_wait_and_check(store_pair):
    a, b = store_pair
    assert not a.check(["w1"])
    threading.Timer(0.2, lambda: b.set("w1", "1")).start()
    a.wait(["w1"], timedelta(seconds=5))
    assert a.check(["w1"])
    with pytest.raises(dist.DistStoreError):
        a.wait(["w1", "w2"], timedelta(milliseconds=300))


def test_delete_key(store_pair):
    a, b = store_pair
    a.set("d", "1")
    b.wait(["d"])  # TCPStore's set does not wait for the server: order across clients via wait
    assert b.delete_key("d") is True
    assert b.delete_key("d") is False
    assert not a.check(["d"])


def test_num_keys_counts_sets(store_pair):
    a, _ = store_pair
    before = a.num_keys()
    a.set("n1", "1")
    a.set("n2", "2")
    assert a.num_keys() == before + 2


def test_multi_get_set(store_pair):
    a, b = store_pair
    a.multi_set(["m1", "m2"], ["x", "y"])
    assert b.multi_get(["m1", "m2"]) == [b"x", b"y"]


def test_usable_through_prefix_store_and_barrier(store_pair):
    """What torch's agent does with the store: PrefixStore, multi_get and the exit barrier."""
    from torch.distributed.elastic.utils import store as store_util

    a, b = store_pair
    pa, pb = dist.PrefixStore("round1", a), dist.PrefixStore("round1", b)
    pa.set("x", "1")
    assert pb.get("x") == b"1"
    done = []
    t = threading.Thread(target=lambda: done.append(
        store_util.barrier(pb, 2, key_prefix="bar", barrier_timeout=10)))
    t.start()
    store_util.barrier(pa, 2, key_prefix="bar", barrier_timeout=10)
    t.join(10)
    assert done == [None]
