"""A reply that reached this machine in time counts even when the process could not run to read it.

The etcd client's calls and keep-alives are judged by the time the request waited on the wire (the
deadline runs from the send, and before it fails the waiting thread reads what the kernel already holds
for the connection). Here the process is starved for real, end to end: once the request is on the wire,
the main thread holds the GIL inside one long C call (a sort), so no thread of the process runs while
etcd's answer arrives, for several times the call's deadline. Which thread then reads the answer first
(the connection's reader or the caller) is up to the GIL; either way the call must succeed.
"""

from __future__ import annotations

import fcntl
import random
import socket
import struct
import termios
import threading
import time

import grpc
import pytest

from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig
from elastic_rt.rendezvous.wire import CallError

DEADLINE_S = 0.2
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux


def _starve(values: list[float]) -> float:
    """Hold the GIL in one C call; returns how long it was held."""
    t0 = time.monotonic()
    sorted(values)
    return time.monotonic() - t0


STARVE_S = 6 * DEADLINE_S  # the aim; the tests require more than 3 deadlines


def _values_to_starve(seconds: float) -> list[float]:
    """Enough random values that sorting them holds the GIL for about `seconds` on this machine."""
    probe = [random.random() for _ in range(1_000_000)]
    per_value = _starve(probe) / len(probe)
    return [random.random() for _ in range(max(1_000_000, int(seconds / per_value)))]


def _starved_call(call, sent) -> tuple[object, float]:
    """Run call() in a thread; once its request is on the wire (sent() true), starve the process."""
    values = _values_to_starve(STARVE_S)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_outcome(call)), daemon=True)
    worker.start()
    deadline = time.monotonic() + 10
    while not sent() and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert sent(), "the request was not sent within 10 s"
    held = _starve(values)
    worker.join(10)
    assert result, "the call did not return within 10 s of the starvation's end"
    return result[0], held


def _outcome(call):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the test reports what failed
        return exc


def test_a_keep_alive_answered_while_the_process_was_starved_counts(etcd_server):
    m = etcd_server.members[0]
    client = EtcdClient(EtcdConfig(endpoints=((m.host, m.client_port),), request_timeout_s=5.0))
    try:
        lease = client.grant_lease(10)
        assert client.refresh_lease(lease, timeout_s=DEADLINE_S, attempts=1) > 0  # the stream is open
        ep = client._endpoints[0]
        before = ep.keepalive._stream.sent_at
        ttl, held = _starved_call(lambda: client.refresh_lease(lease, timeout_s=DEADLINE_S, attempts=1),
                                  lambda: ep.keepalive._stream.sent_at != before)
        assert held > 3 * DEADLINE_S, f"the starvation ({held:.2f} s) must outlast the deadline several times"
        assert not isinstance(ttl, Exception), f"a beat etcd answered in time failed: {ttl!r}"
        assert ttl > 0
    finally:
        client.close()


def test_a_unary_call_answered_while_the_process_was_starved_counts(etcd_server):
    m = etcd_server.members[0]
    client = EtcdClient(EtcdConfig(endpoints=((m.host, m.client_port),), request_timeout_s=DEADLINE_S))
    try:
        client.put("/starved/k", b"v")
        conn = client._endpoints[0].connection(1.0)
        first = conn._next_id
        got, held = _starved_call(lambda: client.get("/starved/k"), lambda: conn._next_id != first)
        assert held > 3 * DEADLINE_S, f"the starvation ({held:.2f} s) must outlast the deadline several times"
        assert not isinstance(got, Exception), f"a read etcd answered in time failed: {got!r}"
        assert got[0].value == b"v"
    finally:
        client.close()


def _kernel_holds(sock: socket.socket) -> int:
    """Bytes the kernel holds for `sock`, not yet read."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)))[0]


def test_a_reply_behind_a_backlog_larger_than_one_read_counts(etcd_server, run_id):
    """The reader thread is held (a push stream's receiver blocks it) while etcd sends the connection a watch
    backlog several times one read (256 KiB), and then the reply to a call: the caller, past its deadline, reads
    everything the kernel holds, not one read of it."""
    m = etcd_server.members[0]
    config = EtcdConfig(endpoints=((m.host, m.client_port),), request_timeout_s=DEADLINE_S)
    client, writer = EtcdClient(config), EtcdClient(EtcdConfig(endpoints=((m.host, m.client_port),)))
    held, release = threading.Event(), threading.Event()
    prefix = f"/{run_id}/"
    try:
        rev = writer.put(prefix + "k", b"v")
        sock = client._endpoints[0].connection(1.0)._sock
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)  # room for the backlog (root, as CI runs)

        def blocks(index, events, created):
            if events and not held.is_set():
                held.set()
                release.wait(30)

        ends: list = []
        streams = [client.open_watch([(prefix + "block", (prefix + "block\0").encode())], [rev + 1],
                                     on_event=blocks, on_end=ends.append),
                   client.open_watch([(prefix + "big/", (prefix + "big0").encode())], [rev + 1],
                                     on_event=lambda *_: None, on_end=ends.append)]
        writer.put(prefix + "block", b"x")
        assert held.wait(10), "the blocking receiver was not reached"
        value = b"v" * (100 << 10)
        for i in range(10):  # about 1 MiB of watch events, four times one read
            writer.put(f"{prefix}big/{i}", value)
        deadline = time.monotonic() + 10
        while _kernel_holds(sock) < 10 * len(value) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _kernel_holds(sock) >= 10 * len(value), f"the backlog did not arrive: {_kernel_holds(sock)} bytes"

        kv, _ = client.get(prefix + "k")  # its reply comes behind the backlog; the reader thread reads nothing
        assert kv is not None and kv.value == b"v"
        assert held.is_set() and not release.is_set() and not ends
    finally:
        release.set()
        client.close()
        writer.close()


def test_a_late_caller_on_a_socket_closed_under_it_gets_unavailable(etcd_server):
    """The connection's socket closed (its descriptor gone) while its error is not yet set: a caller past its deadline
    gets the connection's failure (UNAVAILABLE), not a ValueError from reading a closed descriptor."""
    m = etcd_server.members[0]
    client = EtcdClient(EtcdConfig(endpoints=((m.host, m.client_port),)))
    try:
        conn = client._endpoints[0].connection(1.0)
        stream = conn.open("/etcdserverpb.Lease/LeaseTimeToLive", timeout_s=5.0, first=())  # never answered
        kept, closed = conn._sock, socket.socket()
        closed.close()
        conn._sock = closed  # the caller's view of it; the reader thread still polls the one it had, which is quiet
        try:
            with pytest.raises(CallError) as err:
                stream.next(0.01)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            kept.close()
    finally:
        client.close()
