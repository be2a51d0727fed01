"""A node's lease against a busy etcd (answers late, or "request timed out") and against a silent member.

A busy etcd still receives every keep-alive on time and renews the lease; only its answers come late. The
lease thread must not take that for a dead member: no failed beat, no failover, no backoff, no new lease.
A member that sends nothing at all is still given up, soon enough for the next member to renew the lease. A
registration whose put is answered past the TTL keeps the lease it was granted.
"""

from __future__ import annotations

import threading
import time

from elastic_rt.chaos.proxy import TcpProxy
from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig
from elastic_rt.rendezvous.etcd_reachability import EtcdHealth
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.lease import NodeLease

TTL_S = 3.0  # the default lease_ttl: a beat every second
LATE_S = 1.2  # every answer at least this late: past a beat's second, well inside the TTL
LATE_PUT_S = 3.5  # a registration's put answered this late: past the TTL


class _Beats:
    """Counts the beats etcd confirmed and records every reachability transition the lease reported."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.confirmed = 0
        self.transitions: list[bool] = []

    def on_beat(self) -> None:
        with self.cond:
            self.confirmed += 1
            self.cond.notify_all()

    def on_health(self, up: bool) -> None:
        with self.cond:
            self.transitions.append(up)

    def wait_for(self, count: int, timeout_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.confirmed >= count, timeout_s)


def _lease(endpoints: tuple[tuple[str, int], ...], run_id: str, beats: _Beats,
           on_beat=lambda: None) -> tuple[NodeLease, EtcdClient]:
    """A node lease through `endpoints`; each confirmed beat calls `on_beat`, then counts in `beats`."""
    client = EtcdClient(EtcdConfig(endpoints=endpoints, request_timeout_s=10.0))
    health = EtcdHealth(node_id="n0")
    health.add_listener(beats.on_health)
    lease = NodeLease(client, RunKeys(run_id), "n0", ttl_s=TTL_S, info={"addr": "127.0.0.1"}, health=health,
                      local_addr="127.0.0.1", on_beat=lambda: (on_beat(), beats.on_beat()))
    return lease, client


def _hostport(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _kept(lease: NodeLease, lease_id: int, etcd_client, run_id: str, why: str) -> None:
    """The node lease is the one granted at the start, never found gone, and its alive key is still on it."""
    assert lease.lease_id == lease_id and lease.renewals_lost == 0, why
    kv, _ = etcd_client.get(RunKeys(run_id).alive("n0"))
    assert kv is not None and kv.lease == lease_id


def test_a_lease_survives_keep_alives_answered_late_by_a_busy_etcd(etcd_server, etcd_client, run_id):
    m = etcd_server.members[0]
    beats = _Beats()
    with TcpProxy(m.host, m.client_port) as proxy:
        proxy.delay(LATE_S, answers_only=True)
        lease, client = _lease((_hostport(proxy.endpoint),), run_id, beats)
        try:
            lease_id = lease.start()
            assert beats.wait_for(8, 60), f"{beats.confirmed} beats confirmed in 60 s; reachability {beats.transitions}"
            assert beats.transitions == [True], "a late answer was taken for an unreachable etcd"
            _kept(lease, lease_id, etcd_client, run_id, "the lease was granted anew")
        finally:
            lease.stop(revoke=True)
            client.close()


def test_a_silent_member_is_given_up_and_the_next_one_keeps_the_lease(etcd_server, etcd_client, run_id):
    m = etcd_server.members[0]
    beats = _Beats()
    with TcpProxy(m.host, m.client_port) as first, TcpProxy(m.host, m.client_port) as second:
        lease, client = _lease((_hostport(first.endpoint), _hostport(second.endpoint)), run_id, beats)
        try:
            lease_id = lease.start()
            assert beats.wait_for(2, 30)
            first.cut("blackhole")  # the member sends nothing any more, and takes nothing
            seen = beats.confirmed
            assert beats.wait_for(seen + 4, 30), f"reachability {beats.transitions}"
            assert client.current_endpoint == second.endpoint
            _kept(lease, lease_id, etcd_client, run_id, "the lease lapsed before the failover")
        finally:
            lease.stop(revoke=True)
            client.close()


def test_the_run_leases_keep_alive_never_holds_the_node_lease_back(etcd_server, etcd_client, run_id):
    """Rank 0 keeps the run's lease alive from the node lease's own thread (on_beat). Against an etcd that answers
    every keep-alive 4 s late, past the node's 3 s TTL (requests still arrive on time), a run-lease keep-alive that
    waited for its own answer held that thread for 4 s, the node lease's next beats went out too late, and the node
    lease ran out. Here a run-lease keep-alive is due at every beat (its TTL 3 s): the node lease must live on."""
    from elastic_rt.rendezvous.run_lease import RunLease

    m = etcd_server.members[0]
    beats = _Beats()
    with TcpProxy(m.host, m.client_port) as proxy:
        lease, client = _lease((_hostport(proxy.endpoint),), run_id, beats, on_beat=lambda: run_lease.beat())
        run_lease = RunLease(client, RunKeys(run_id), ttl_s=TTL_S, wait_s=TTL_S / 6)  # beats begin at start()
        try:
            assert run_lease.adopt(None, keeper=True) > 0
            lease_id = lease.start()
            proxy.delay(4.0, answers_only=True)
            assert beats.wait_for(beats.confirmed + 3, 60), f"{beats.confirmed} beats confirmed in 60 s"
            _kept(lease, lease_id, etcd_client, run_id, "the node lease ran out")
        finally:
            lease.stop(revoke=True)
            client.close()


def test_a_registration_whose_put_is_answered_past_the_ttl_keeps_its_lease(etcd_server, etcd_client, run_id):
    """A busy etcd answers the alive key's put 3.5 s late, past the 3 s TTL of the lease just granted for it (its
    requests still arrive on time). A registration that sent one keep-alive and then none until the put was answered
    lost that lease meanwhile: the alive key was gone before start() returned, and the first beat found the lease
    gone and registered again. The put's wait sends a keep-alive every beat."""
    m = etcd_server.members[0]
    beats = _Beats()
    with TcpProxy(m.host, m.client_port) as proxy:
        lease, client = _lease((_hostport(proxy.endpoint),), run_id, beats)
        grant = client.grant_lease

        def grant_then_answer_late(*args, **kwargs) -> int:  # the grant is answered on time, what follows late
            client.grant_lease = grant
            lease_id = grant(*args, **kwargs)
            proxy.delay(LATE_PUT_S, answers_only=True)
            return lease_id

        client.grant_lease = grant_then_answer_late
        try:
            started = time.monotonic()
            lease_id = lease.start()
            took = time.monotonic() - started
            proxy.delay(0.0)
            assert took >= TTL_S, f"start() took {took:.1f} s: the put was not answered past the TTL"
            assert beats.wait_for(3, 30), f"{beats.confirmed} beats confirmed in 30 s"
            _kept(lease, lease_id, etcd_client, run_id, "the lease ran out while its registration's put waited")
        finally:
            proxy.delay(0.0)
            lease.stop(revoke=True)
            client.close()
