"""An idle agent's rendezvous threads sleep until something happens: the liveness listener and peer watch
never wake by themselves, the membership watch at most once a second (gRPC's wait slice), and a stop, a new
peer, a retry that falls due or a watch event still wakes them at once. That is an agent's idle CPU, and
what lets one process hold hundreds of simulated agents (benchmarks/rendezvous_scale.py). Real sockets,
real etcd, real threads; wake-ups counted by the kernel (a thread's voluntary context switches in /proc)."""

from __future__ import annotations

import socket
import threading
import time

from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.liveness import LivenessListener, Peer, PeerWatch
from elastic_rt.rendezvous.view import MembershipView
from tests.support.net import refuses
from tests.integration.test_handler import _poll


def _switches(thread: threading.Thread) -> int:
    """How many times the kernel put this thread to sleep at its own request (each select() that blocked)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


def _hosted(listener: LivenessListener) -> threading.Thread:
    """A thread that serves the listener until it is closed, waiting without a timeout (as the lease thread does
    between its beats, with the time to its next beat)."""
    def serve() -> None:
        while listener.serve(None):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_idle_listener_and_peer_watch_do_not_wake_until_something_happens():
    listener = LivenessListener("127.0.0.1")
    host = _hosted(listener)
    watch = PeerWatch(lambda p: None, retry_s=0.2)
    try:
        watch.watch([Peer("a", "127.0.0.1", listener.port, 1)])
        assert _poll(lambda: listener._held == 1)  # noqa: SLF001 - the connection the watch holds
        time.sleep(0.3)  # let both threads settle into select()
        before = _switches(host), _switches(watch._thread)  # noqa: SLF001
        time.sleep(2.0)  # a 0.2 s poll would wake each thread ~10 times here
        after = _switches(host), _switches(watch._thread)  # noqa: SLF001
        assert after[0] - before[0] <= 1, ("listener", before, after)
        assert after[1] - before[1] <= 1, ("peer watch", before, after)
    finally:
        watch.stop()
        listener.close()
    host.join(5)
    watch._thread.join(5)  # noqa: SLF001
    assert not host.is_alive() and not watch._thread.is_alive()  # noqa: SLF001 - woken by stop


def test_a_peer_that_refused_at_first_is_retried_when_its_retry_falls_due():
    """The retry of a peer that did not answer yet is the select()'s timeout, not a poll."""
    dead: list[str] = []
    watch = PeerWatch(lambda p: dead.append(p.node), retry_s=0.2)
    server = socket.socket()
    try:
        server.bind(("127.0.0.1", 0))  # bound, not listening yet: the first connection is refused
        peer = Peer("late", "127.0.0.1", server.getsockname()[1], 7)
        watch.watch([peer])
        server.listen(1)
        server.settimeout(10)
        conn, _ = server.accept()  # the retry came (within 10 s; it is due 0.2 s after the refusal)
        assert not watch.dead("late")
        conn.close()
        server.close()  # the agent dies: the held connection closes and the port refuses
        assert _poll(lambda: watch.dead("late"))
        assert dead == ["late"]
    finally:
        watch.stop()
        server.close()


def test_an_idle_membership_watch_wakes_at_most_once_a_second_and_at_once_for_an_event(etcd_client, run_id):
    keys = RunKeys(run_id)
    view = MembershipView(etcd_client, keys, node_id="m")
    view.start()
    try:
        assert view.wait_for(lambda: view.connected, 10)
        time.sleep(0.3)
        reader = etcd_client._endpoints[etcd_client._current]._conn._reader  # noqa: SLF001 - it applies the events
        before = _switches(reader)
        time.sleep(2.0)  # gRPC's own 0.1 s wait slice would wake the reading thread ~20 times here
        woke = _switches(reader) - before
        assert woke <= 5, woke
        etcd_client.put(keys.alive("b"), b"{}")
        assert view.wait_for(lambda: "b" in view.alive, 10)
    finally:
        view.stop()


def test_the_lease_thread_serves_the_liveness_listener_and_stop_closes_its_connections(etcd_server, run_id):
    """No thread of the listener's own: the node's lease thread accepts a peer's connection between its beats (within a
    beat of a second at the default TTL), and the lease's stop() closes it and the port (the peer's evidence)."""
    from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig
    from elastic_rt.rendezvous.etcd_reachability import EtcdHealth
    from elastic_rt.rendezvous.lease import NodeLease

    m = etcd_server.members[0]
    client = EtcdClient(EtcdConfig(endpoints=((m.host, m.client_port),)))
    lease = NodeLease(client, RunKeys(run_id), "n0", ttl_s=3.0, info={"addr": "127.0.0.1"},
                      health=EtcdHealth(node_id="n0"), local_addr="127.0.0.1")
    try:
        lease.start()
        assert not [t for t in threading.enumerate() if t.name == "elastic-rt-liveness"]
        listener = lease._listener  # noqa: SLF001
        peer = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        assert _poll(lambda: listener._held == 1, 10)  # noqa: SLF001 - accepted by the lease thread
        lease.stop(revoke=True)
        peer.settimeout(5)
        assert peer.recv(1) == b""
        peer.close()
        assert refuses("127.0.0.1", listener.port)  # the port is closed
    finally:
        lease.stop(revoke=False)
        client.close()


def test_a_callers_own_answer_does_not_wake_the_connections_reader_thread(etcd_client, run_id):
    """The thread that waits for an answer reads it itself, and switches the reader thread's interest in the socket
    off before its request goes out (Connection.claim): switched off after the write, a fast answer (a keep-alive's
    comes in a fraction of a millisecond) had often woken the reader already, which then queued for the GIL and the
    read token to find nothing. Keep-alives a lease's beat sends and unary calls: the reader thread sleeps through
    all of them."""
    lease = etcd_client.grant_lease(5.0)
    etcd_client.keep_alive(lease, every_s=1.0, silent_s=1.5)  # the keep-alive stream is open
    reader = etcd_client._endpoints[etcd_client._current]._conn._reader  # noqa: SLF001 - the connection's reader
    time.sleep(0.3)
    before = _switches(reader)
    for i in range(60):
        renewal = etcd_client.keep_alive(lease, every_s=1.0, silent_s=1.5)
        assert renewal is not None and renewal.own and renewal.ttl > 0
        etcd_client.put(f"/{run_id}/k{i % 4}", b"x")
        time.sleep(0.01)  # as between beats: the reader thread settles into its wait
    woke = _switches(reader) - before
    assert woke <= 2, woke  # before claim(): woken for a third of the keep-alives or more
    etcd_client.revoke_lease(lease)
