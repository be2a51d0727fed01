"""A reply that reached this machine in time counts even when the process could not run to read it.

The etcd client's calls and keep-alives are judged by the time the request waited on the wire (the
deadline runs from the send, and before it fails the waiting thread reads what the kernel already holds
for the connection). Here the process is starved for real, end to end: once the request is on the wire,
the main thread holds the GIL inside one long C call (a sort), so no thread of the process runs while
etcd's answer arrives, for several times the call's deadline. Which thread then reads the answer first
(the connection's reader or the caller) is up to the GIL; either way the call must succeed.
"""

from __future__ import annotations

import random
import threading
import time

from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig

DEADLINE_S = 0.2


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
