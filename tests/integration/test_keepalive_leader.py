"""Lease keep-alives go straight to the member that leads (--rdzv-conf keepalive_to=leader, the default), from 1-3
lease TTLs after the agent was first in a round, not through the member it talks to, which would forward each one to the leader: etcd's own
counters show where they arrive. They follow the leader when it moves or dies, without the lease lapsing;
keepalive_to=member keeps them on the agent's member."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from etcd_testbed.server import EtcdCluster
from elastic_rt.rendezvous.etcd_client import EtcdClient, spread_first
from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from tests.support.etcd_metrics import grpc_counts
from tests.support.prometheus import wait_until
from tests.support.rendezvous import ranks

BEAT_S = 0.5


@pytest.fixture(scope="module")
def cluster():
    with EtcdCluster(3) as c:
        yield c


def _keep_alives(cluster) -> list[float]:
    """LeaseKeepAlive messages each member has received (its own counter)."""
    return [counts.received.get("LeaseKeepAlive", 0.0) for counts in map(grpc_counts, cluster.members)]


def _beats(client: EtcdClient, lease: int, count: int) -> None:
    """What the lease thread does: a keep-alive, then follow_leader, `count` times; none finds the lease gone (an
    answer that comes after its beat counts with a later one)."""
    for _ in range(count):
        renewal = client.keep_alive(lease, every_s=BEAT_S, silent_s=1.5 * BEAT_S)
        assert renewal is None or renewal.ttl > 0, renewal
        client.follow_leader()


def _arrivals(cluster, client: EtcdClient, lease: int, count: int) -> list[float]:
    """`count` beats; the keep-alives each member received meanwhile (its own counter)."""
    before = _keep_alives(cluster)
    _beats(client, lease, count)
    return [a - b for a, b in zip(_keep_alives(cluster), before)]


def _on(client: EtcdClient, lease: int, endpoint: str, what: str) -> None:
    """Beat until keep-alives go to `endpoint` (a look that failed is tried again LEADER_RETRY_S later)."""
    wait_until(what, lambda: (_beats(client, lease, 1), client.keepalive_endpoint == endpoint)[1], 30, poll_s=0)


def _follower(cluster) -> int:
    leader = cluster.leader_index()
    assert leader is not None
    return (leader + 1) % len(cluster.members)


def test_keep_alives_go_to_the_leader_not_through_the_member_the_client_talks_to(cluster):
    first = _follower(cluster)
    leader = cluster.leader_index()
    client = EtcdClient(cluster.client_config(first=first))
    try:
        lease = client.grant_lease(10)
        _on(client, lease, cluster.members[leader].endpoint, "keep-alives on the leader")  # the first beat goes to
        # the member, the look after it finds the leader
        assert client.current_endpoint == cluster.members[first].endpoint  # other calls stay on the member
        got = _arrivals(cluster, client, lease, 10)
        assert got[leader] >= 10 and got[first] == 0, got
    finally:
        client.close()


def test_keepalive_to_member_keeps_them_on_the_member(cluster):
    first = _follower(cluster)
    client = EtcdClient(cluster.client_config(first=first, keepalive_to_leader=False))
    try:
        lease = client.grant_lease(10)
        got = _arrivals(cluster, client, lease, 10)
        assert got[first] >= 10 and sum(got) == got[first], got
        assert client.keepalive_endpoint == cluster.members[first].endpoint
    finally:
        client.close()


def test_keep_alives_follow_the_leader_when_it_moves(cluster):
    first = _follower(cluster)
    client = EtcdClient(cluster.client_config(first=first))
    try:
        lease = client.grant_lease(10)
        _on(client, lease, cluster.members[cluster.leader_index()].endpoint, "keep-alives on the leader")
        old = cluster.leader_index()
        new = next(i for i in range(3) if i not in (old, first))  # neither the old leader nor the client's member
        cluster.move_leader(new)
        _on(client, lease, cluster.members[new].endpoint, "keep-alives on the new leader")
        got = _arrivals(cluster, client, lease, 5)
        assert got[new] >= 5 and got[new] == sum(got), got
    finally:
        client.close()


def test_an_agent_waiting_for_its_first_round_keeps_alive_on_its_member_then_on_the_leader(cluster, run_id):
    """Not in a round yet (its job needs two nodes), an agent leaves its keep-alives on its member for beat after beat
    (a meeting's load stays off the leader's connection); 1-3 TTLs after it is in one, they go to the leader."""
    leader = cluster.leader_index()
    name = next(f"node-{i}" for i in range(100)
                if spread_first(f"node-{i}", 3) != leader)  # an agent whose member does not lead
    params = lambda node: RendezvousParameters(  # noqa: E731
        "etcd-v3", cluster.endpoints, run_id, 2, 2, local_addr="127.0.0.1", node_id=node, last_call_timeout=2,
        lease_ttl=3)
    first = create_etcd_v3_handler(params(name))
    waiting = ThreadPoolExecutor(1).submit(first.next_rendezvous)
    handlers = [first]
    try:
        wait_until("the waiting agent's registration", lambda: first._lease.lease_id, 10, poll_s=0.05)
        renewed = first._lease.last_renewed
        wait_until("three renewals while it waits", lambda: first._lease.last_renewed >= renewed + 2 * 1.0, 10,
                   poll_s=0.05)
        assert not waiting.done()
        assert first._client.keepalive_endpoint == first._client.current_endpoint != cluster.members[leader].endpoint
        handlers.append(create_etcd_v3_handler(params("other")))
        ranks(handlers[1:])
        waiting.result(timeout=60)
        wait_until("keep-alives on the leader once in a round (within 3 TTLs)",
                   lambda: first._client.keepalive_endpoint == cluster.members[leader].endpoint, 20, poll_s=0.05)
    finally:
        for h in handlers:
            h.shutdown()


def test_a_jobs_agents_all_keep_alive_on_the_leader_and_a_dead_leader_costs_no_lease(run_id):
    """Three agents, one on each member (endpoint_order=spread): once they met, every keep-alive arrives at the leader.
    The leader dies: the agents' keep-alives go to the member each talks to in the same beat (one that is gone fails
    over), then to the new leader, and no lease lapses (a beat may still fail while the survivors elect a leader:
    their members hold renewals until there is one)."""
    with EtcdCluster(3) as c:
        handlers = [create_etcd_v3_handler(RendezvousParameters(
            "etcd-v3", c.endpoints, run_id, 3, 3, local_addr="127.0.0.1", node_id=f"node-{i}", last_call_timeout=2,
            lease_ttl=3)) for i in range(3)]
        try:
            ranks(handlers)
            leader = c.leader_index()
            on_leader = lambda at: all(h._client.keepalive_endpoint == c.members[at].endpoint  # noqa: E731
                                       for h in handlers)
            wait_until("every agent's keep-alives on the leader (within 3 TTLs of the round)", lambda: on_leader(leader),
                       20, poll_s=0.05)
            before = _keep_alives(c)
            time.sleep(2.0)  # a window of beats (each agent sends one a second) to count
            got = [a - b for a, b in zip(_keep_alives(c), before)]
            assert got[leader] >= 3 and got[leader] == sum(got), got

            c.kill_member(c.members[leader])
            killed = time.monotonic()
            wait_until("a new leader", lambda: c.leader_index() not in (None, leader), 30, poll_s=0.1)
            new = c.leader_index()
            wait_until("every agent's keep-alives on the new leader", lambda: on_leader(new), 30, poll_s=0.05)
            wait_until("a renewal since the kill by each agent",
                       lambda: all(h._lease.last_renewed > killed for h in handlers), 10, poll_s=0.05)
            assert [h._lease.renewals_lost for h in handlers] == [0, 0, 0]
        finally:
            for h in handlers:
                h.shutdown()


def test_an_etcd_user_limited_to_its_run_keeps_alive_on_the_leader(run_id):
    """With auth on, a job's user may read and write its run's prefix only: the look authenticates on each member it
    asks (etcd 3.4 and 3.5.1 allow Status to every authenticated user) and keep-alives go to the leader."""
    with EtcdCluster(3) as c:
        c.enable_auth("root-" + run_id, {"agent": ("agent-pw", (f"/elastic-rt/{run_id}/",))})
        leader = c.leader_index()
        first = (leader + 1) % 3
        client = EtcdClient(c.client_config(first=first, user="agent", password="agent-pw"))
        try:
            lease = client.grant_lease(10)
            _on(client, lease, c.members[leader].endpoint, "keep-alives on the leader")
            got = _arrivals(c, client, lease, 5)
            assert got[leader] >= 5 and got[first] == 0, got
        finally:
            client.close()
