"""Who reads an etcd connection's socket (connection.py), against a real etcd.

A caller with a deadline reads its own reply; the connection's reader thread is not woken for it. While one
caller reads, another caller's reply is read for it and handed over; an item another thread gives the
reading caller (here a cancel) wakes it at once, not at its deadline.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from pyetcd import etcdrpc

from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig
from elastic_rt.rendezvous.wire import CallError

LONG_S = 60.0  # a deadline no wait in these tests should reach


def _switches(thread: threading.Thread) -> int:
    """Context switches of one thread so far (the kernel's count: each wake-up from a sleep is one)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        return sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)


@pytest.fixture
def client(etcd_server):
    m = etcd_server.members[0]
    c = EtcdClient(EtcdConfig(endpoints=((m.host, m.client_port),), request_timeout_s=LONG_S))
    c.put("/conn-test/k", b"v")
    yield c
    c.close()


def _park(conn):
    """A thread that waits (60 s) on a Watch stream with no watcher, which etcd never answers: it reads the
    socket until it is told otherwise. Returns (the stream, the thread, where its outcome goes)."""
    parked = conn.open("/etcdserverpb.Watch/Watch")
    outcome: list = []
    reader = threading.Thread(target=lambda: outcome.append(_next(parked)), daemon=True)
    reader.start()
    _wait_until(lambda: conn._owner is parked)
    return parked, reader, outcome


def test_a_caller_reads_its_own_reply_without_waking_the_reader_thread(client):
    conn = client._endpoints[0].connection(LONG_S)
    before = _switches(conn._reader)
    for _ in range(50):
        kv, _rev = client.get("/conn-test/k")
        assert kv.value == b"v"
    woken = _switches(conn._reader) - before
    # through the reader thread, each reply wakes it at least once (50 or more)
    assert woken < 10, f"the reader thread woke {woken} times for 50 replies its callers read themselves"


def test_a_reply_is_handed_to_its_caller_while_another_caller_reads_the_socket(client):
    conn = client._endpoints[0].connection(LONG_S)
    parked, reader, outcome = _park(conn)
    for i in range(20):  # these callers wait on their queues; the parked caller reads their replies
        client.put("/conn-test/k", b"v%d" % i)
        assert client.get("/conn-test/k")[0].value == b"v%d" % i
    assert conn._owner is parked and reader.is_alive(), "the parked caller stopped reading"
    parked.cancel()
    reader.join(10)
    assert outcome and isinstance(outcome[0], CallError) and outcome[0].code() == grpc.StatusCode.CANCELLED


def test_a_reading_caller_is_woken_by_an_item_another_thread_gives_it(client):
    conn = client._endpoints[0].connection(LONG_S)
    parked, reader, outcome = _park(conn)
    parked.cancel()  # from this thread: the reading caller sleeps in poll() with 60 s to go
    reader.join(10)
    assert not reader.is_alive(), "the reading caller slept on after its stream was cancelled"
    assert isinstance(outcome[0], CallError) and outcome[0].code() == grpc.StatusCode.CANCELLED
    # the reader thread has the socket back: a watch event reaches a caller that waits with no deadline
    stream = conn.open("/etcdserverpb.Watch/Watch")
    stream.send(etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(key=b"/conn-test/k"))
                .SerializeToString())
    created = etcdrpc.WatchResponse.FromString(stream.next(None))
    assert created.created
    client.put("/conn-test/k", b"after")
    event = etcdrpc.WatchResponse.FromString(stream.next(None))
    assert event.events[0].kv.value == b"after"
    stream.cancel()


def _next(stream):
    try:
        return stream.next(LONG_S)
    except CallError as exc:
        return exc


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition not reached within %g s" % timeout_s)
