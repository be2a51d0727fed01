"""c10d Store contract: every case of torch's store tests, in our words, against TCPStore and EtcdStore.

The cases follow torch 2.13's own store suite (test/distributed/test_store.py: the store test
base, the TCPStore cases that hold for any store, the Python-store trampoline checks, the
multi-threaded wait) plus the methods torch 2.13's Store has beyond it (list_keys, barrier,
timeout). TCPStore is the reference: a case that fails on it is a wrong case, and a torch
that changes a contract shows up here as a failure on one side.
"""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig
from elastic_rt.rendezvous.store import EtcdStore

TIMEOUT = timedelta(seconds=10)
SHORT = timedelta(milliseconds=300)


@dataclass
class Stores:
    a: dist.Store  # one client
    b: dist.Store  # a second client of the same store, as another process would have
    internal_keys: int  # keys num_keys counts that nobody set (TCPStore: its worker-count key)


@pytest.fixture(params=["tcp", "etcd"])
def stores(request, etcd_client, run_id) -> Stores:
    if request.param == "tcp":
        a = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=TIMEOUT, wait_for_workers=False)
        b = dist.TCPStore("127.0.0.1", a.port, 2, False, timeout=TIMEOUT)
        return Stores(a, b, internal_keys=1)
    prefix = f"/elastic-rt/{run_id}/store/"
    return Stores(EtcdStore(etcd_client, prefix, TIMEOUT), EtcdStore(etcd_client, prefix, TIMEOUT), 0)


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def _blocks_until(other, blocking):
    """Run `other` in another thread while this one blocks in `blocking`; return what it returned."""
    t = _in_thread(other)
    try:
        return blocking()
    finally:
        t.join(10)


# ---- torch's store test base ----------------------------------------------------------------

def test_set_add_get_check_and_count(stores):
    s = stores.a
    for amount in (1, 2, 3):
        s.add("key", amount)
    s.set("key0", "value0")
    s.add("key3", 1)
    s.set("key1", "value1")
    s.add("key3", 2)
    s.set("key2", "value2")
    for amount in (3, 4, 5, 6):
        s.add("key3", amount)
    assert s.num_keys() == 5 + stores.internal_keys
    assert [s.get(k) for k in ("key", "key0", "key1", "key2", "key3")] == [b"6", b"value0", b"value1", b"value2", b"21"]
    assert s.check(["key3"]) and not s.check(["Randomkey3"])
    s.set("-key3", "7")
    assert s.get("-key3") == b"7"
    s.delete_key("-key3")
    assert s.num_keys() == 5 + stores.internal_keys


def test_compare_set(stores):
    s = stores.a
    assert s.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"  # missing: not set
    assert not s.check(["cs_key0"])
    s.set("cs_key0", "value0")
    assert s.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert s.get("cs_key0") == b"value0"
    assert s.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert s.get("cs_key0") == b"new_value0"
    assert s.compare_set("cs_key1", "", "new_value1") == b"new_value1"  # missing + empty expected: set
    assert s.get("cs_key1") == b"new_value1"
    assert s.compare_set("cs_key1", "", "other") == b"new_value1"  # present + empty expected: not set


def test_wait_times_out_then_sees_a_key(stores):
    s = stores.a
    with pytest.raises(dist.DistStoreError, match="[t -i]imeout"):
        s.wait(["bad_key"], timedelta(seconds=0.25))
    s.add("good_key", 1)
    s.wait(["good_key"])


def test_append_creates_and_extends(stores):
    s = stores.a
    assert s.has_extended_api()
    s.set("foo", "po")
    s.append("foo", "tato")
    s.append("bar", "po")
    s.append("bar", b"tato")
    assert (s.get("foo"), s.get("bar")) == (b"potato", b"potato")


def test_queues_fifo_check_wait_len(stores):
    s = stores.a
    assert not s.check(["foo"]) and s.queue_len("foo") == 0
    s.queue_push("foo", "1")
    s.queue_push("foo", b"2")
    assert s.check(["foo"]) and s.queue_len("foo") == 2
    s.wait(["foo"])
    assert [s.queue_pop("foo"), s.queue_pop("foo")] == [b"1", b"2"]
    assert not s.check(["foo"]) and s.queue_len("foo") == 0


def test_queue_pop_nonblocking(stores):
    s = stores.a
    with pytest.raises(dist.QueueEmptyError, match="empty"):
        s.queue_pop("foo", block=False)
    s.queue_push("foo", "a")
    assert s.queue_pop("foo", block=False) == b"a"


def test_queues_bidirectional_between_threads_with_clones(stores):
    s = stores.a

    def worker_a():
        local = s.clone()
        local.queue_push("a", "a1")
        assert local.queue_pop("b") == b"b1"

    def worker_b():
        local = s.clone()
        assert local.queue_pop("a") == b"a1"
        local.queue_push("b", "b1")

    with ThreadPoolExecutor(max_workers=2) as pool:
        for fut in [pool.submit(worker_a), pool.submit(worker_b)]:
            fut.result(timeout=60)


def test_queue_pop_honours_the_store_timeout(stores):
    s = stores.a
    s.set_timeout(timedelta(seconds=0.01))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        s.queue_pop("non_existant")


def test_multi_set(stores):
    s = stores.a
    s.multi_set(["foo", "bar"], ["po", "tato"])
    assert (s.get("foo"), s.get("bar")) == (b"po", b"tato")


def test_multi_get(stores):
    s = stores.a
    s.set("foo", "po")
    s.set("bar", "tato")
    assert s.multi_get(["foo", "bar"]) == [b"po", b"tato"]


def test_clone_sees_the_same_keys(stores):
    twin = stores.a.clone()
    assert isinstance(twin, dist.Store)
    stores.a.set("foo", "bar")
    assert twin.get("foo") == b"bar"


# ---- torch's TCPStore cases that hold for any store -------------------------------------------

def test_num_keys_follows_sets_and_deletes(stores):
    s = stores.a
    base = stores.internal_keys
    assert s.num_keys() == base
    for amount in (1, 2, 3):
        s.add("key", amount)
    s.set("key0", "value0")
    s.add("key3", 1)
    s.set("key1", "value1")
    assert s.num_keys() == base + 4
    assert s.delete_key("key") is True
    assert s.num_keys() == base + 3
    s.set_timeout(SHORT)
    with pytest.raises(dist.DistStoreError):
        s.get("key")
    s.delete_key("key0")
    s.delete_key("key3")
    assert s.num_keys() == base + 1
    s.set("key4", "value2")
    assert s.num_keys() == base + 2
    assert (s.get("key1"), s.get("key4")) == (b"value1", b"value2")


def test_second_client_reads_and_compare_sets(stores):
    stores.a.set("key", "value")
    assert stores.b.get("key") == b"value"
    stores.b.set("new_key0", "new_value0")
    assert stores.b.compare_set("new_key0", "new_value0", "next_value0") == b"next_value0"


def test_timeout_set_later_is_honoured_and_store_still_works(stores):
    s = stores.a
    s.set_timeout(timedelta(seconds=0.1))
    assert s.timeout == timedelta(seconds=0.1)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout after 100ms"):
        s.get("the_key")
    assert time.monotonic() - t0 >= 0.09
    s.set("the_key", "x")
    assert s.get("the_key") == b"x"


# ---- torch's Python-store and trampoline cases --------------------------------------------------

def test_cpp_trampoline_check(stores):
    """torch's own C++ check (set/add/get through C++, then clone): pure virtuals fail it."""
    dist._test_python_store(stores.a)


def test_extended_api_through_prefix_store(stores):
    p = dist.PrefixStore("p", stores.a)
    assert p.has_extended_api()
    p.append("foo", b"po")
    p.append("foo", b"tato")
    p.multi_set(["a", "b"], [b"c", b"d"])
    assert p.multi_get(["a", "b", "foo"]) == [b"c", b"d", b"potato"]
    assert stores.a.get("p/foo") == b"potato"


def test_clone_through_prefix_store_outlives_the_python_reference(stores):
    p = dist.PrefixStore("p", stores.a).clone()
    gc.collect()
    p.set("x", "1")
    assert stores.b.get("p/x") == b"1"


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "prefix"])
def test_wait_in_one_thread_released_by_set_in_another(stores, wrap):
    waiter, setter = stores.a, stores.b
    if wrap:
        waiter, setter = dist.PrefixStore("pre", waiter), dist.PrefixStore("pre", setter)
    waiter.set_timeout(TIMEOUT)
    _blocks_until(lambda: setter.set("key1", "value1"), lambda: waiter.wait(["key1"]))
    assert waiter.get("key1") == b"value1"


# ---- torch 2.13's Store methods beyond its test suite ------------------------------------------

def test_list_keys_lists_set_keys_only(stores):
    s = stores.a
    s.set("a", "1")
    s.add("c", 2)
    s.append("ap", "x")
    s.queue_push("q", "1")
    assert sorted(s.list_keys()) == ["a", "ap", "c"]


def test_barrier_releases_all_or_times_out(stores):
    stores.a.barrier("solo", 1)
    done = []
    _blocks_until(lambda: done.append(stores.b.barrier("pair", 2, TIMEOUT)),
                  lambda: stores.a.barrier("pair", 2, TIMEOUT))
    assert done == [None]
    with pytest.raises(dist.DistStoreError, match="timeout"):
        stores.a.barrier("alone", 2, SHORT)


def test_delete_key_reports_whether_it_deleted(stores):
    a, b = stores.a, stores.b
    a.set("d", "1")
    b.wait(["d"])  # TCPStore's set does not wait for the server: order across clients via wait
    assert b.delete_key("d") is True
    assert b.delete_key("d") is False
    assert not a.check(["d"])


def test_clone_has_its_own_timeout(stores):
    stores.a.set_timeout(timedelta(seconds=3))
    twin = stores.a.clone()
    assert twin.timeout == timedelta(seconds=3)
    stores.a.set_timeout(timedelta(seconds=7))
    assert twin.timeout == timedelta(seconds=3)


# ---- what elastic-rt relies on beyond torch's cases ---------------------------------------------

def test_binary_values_and_empty_values(stores):
    a, b = stores.a, stores.b
    a.set("bin", bytes([0, 255, 1]))
    a.set("empty", "")
    assert b.get("bin") == bytes([0, 255, 1])
    assert b.get("empty") == b"" and b.check(["empty"])
    assert a.check([]) is True
    a.wait([])


def test_get_waits_for_a_key_set_later(stores):
    assert _blocks_until(lambda: stores.a.set("late", "x"), lambda: stores.b.get("late")) == b"x"


def test_get_and_multi_get_of_missing_keys_time_out(stores):
    s = stores.a
    s.set("here", "1")
    s.set_timeout(SHORT)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout"):
        s.get("never")
    assert time.monotonic() - t0 >= 0.25
    with pytest.raises(dist.DistStoreError, match="timeout"):
        s.multi_get(["here", "never"])
    assert s.multi_get([]) == []


def test_add_is_atomic_across_clients(stores):
    a, b = stores.a, stores.b
    assert a.add("c", 1) == 1
    assert b.add("c", 5) == 6
    assert a.add("c", -2) == 4
    assert a.add("zero", 0) == 0 and a.check(["zero"])
    errors = []

    def bump(s):
        try:
            for _ in range(20):
                s.add("n", 1)
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [_in_thread(lambda s=s: bump(s)) for s in (a, b)]
    for t in threads:
        t.join(60)
    assert not errors
    assert int(a.get("n")) == 40


def test_multi_set_with_mismatched_lengths_is_refused(stores):
    with pytest.raises(dist.DistStoreError):
        stores.a.multi_set(["x"], [])
    stores.a.multi_set([], [])


def test_wait_is_released_by_a_queue_push(stores):
    _blocks_until(lambda: stores.b.queue_push("wq", "v"), lambda: stores.a.wait(["wq"]))
    assert stores.a.queue_len("wq") == 1


def test_blocking_pop_is_released_by_a_push_from_another_client(stores):
    assert _blocks_until(lambda: stores.b.queue_push("job", "x"), lambda: stores.a.queue_pop("job")) == b"x"


def test_each_queued_item_is_popped_exactly_once(stores):
    n = 30
    for i in range(n):
        stores.a.queue_push("work", str(i))
    got: list[bytes] = []
    lock = threading.Lock()

    def drain(s):
        while True:
            try:
                item = s.queue_pop("work", block=False)
            except dist.QueueEmptyError:
                return
            with lock:
                got.append(item)

    threads = [_in_thread(lambda s=s: drain(s.clone())) for s in (stores.a, stores.b, stores.a)]
    for t in threads:
        t.join(60)
    assert sorted(int(x) for x in got) == list(range(n))


def test_usable_through_prefix_store_and_elastic_barrier(stores):
    """What torch's agent does with the store: PrefixStore, multi_get and the exit barrier."""
    from torch.distributed.elastic.utils import store as store_util

    pa, pb = dist.PrefixStore("round1", stores.a), dist.PrefixStore("round1", stores.b)
    pa.set("x", "1")
    assert pb.get("x") == b"1"
    done = []
    _blocks_until(lambda: done.append(store_util.barrier(pb, 2, key_prefix="bar", barrier_timeout=10)),
                  lambda: store_util.barrier(pa, 2, key_prefix="bar", barrier_timeout=10))
    assert done == [None]


def test_gloo_process_group_bootstraps_through_the_store(stores):
    import torch

    dist.init_process_group("gloo", store=dist.PrefixStore("pg", stores.a), rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.all_reduce(t, group=dist.new_group([0]))
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


# ---- EtcdStore only --------------------------------------------------------------------------

def test_etcd_add_to_a_non_integer_is_a_clear_store_error(etcd_client, run_id):
    s = EtcdStore(etcd_client, f"/elastic-rt/{run_id}/store/", TIMEOUT)
    s.set("str", "abc")
    with pytest.raises(dist.DistStoreError, match=r"add\('str'\).*not an integer"):
        s.add("str", 1)


def test_etcd_values_are_str_or_bytes(etcd_client, run_id):
    s = EtcdStore(etcd_client, f"/elastic-rt/{run_id}/store/", TIMEOUT)
    with pytest.raises(TypeError):
        s.set("k", 5)  # not five zero bytes
    s.set("k", bytearray(b"ab"))
    assert s.get("k") == b"ab"


def test_etcd_queues_and_keys_do_not_share_names(etcd_client, run_id):
    s = EtcdStore(etcd_client, f"/elastic-rt/{run_id}/store/", TIMEOUT)
    s.queue_push("a", "1")
    s.queue_push("a/b", "2")
    assert (s.queue_len("a"), s.queue_len("a/b")) == (1, 1)
    assert s.num_keys() == 0 and s.list_keys() == []
    assert s.delete_key("a") is False and s.queue_len("a") == 1


def test_etcd_prefix_store_forwards_what_torch_trampoline_forwards(etcd_client, run_id):
    """torch 2.13's trampoline for Python stores does not forward these to Python: through a C++
    wrapper they fail (docs/rendezvous.md). When this test fails, torch forwards them: update the doc."""
    p = dist.PrefixStore("p", EtcdStore(etcd_client, f"/elastic-rt/{run_id}/store/", TIMEOUT))
    for call in (lambda: p.delete_key("k"), p.num_keys):
        with pytest.raises(RuntimeError, match="pure virtual"):
            call()
    for call in (p.list_keys, lambda: p.queue_push("q", "v"), lambda: p.queue_len("q")):
        with pytest.raises(NotImplementedError):
            call()


def test_etcd_unreachable_is_a_store_error(etcd_server):
    from etcd_testbed.server import free_port

    client = EtcdClient(EtcdConfig(endpoints=(("127.0.0.1", free_port()),), request_timeout_s=0.5))
    try:
        s = EtcdStore(client, "/nowhere/", SHORT)
        for call in (lambda: s.set("k", "v"), lambda: s.get("k"), lambda: s.queue_push("q", "v"),
                     lambda: s.list_keys()):
            with pytest.raises(dist.DistStoreError, match="not reachable"):
                call()
    finally:
        client.close()
