"""A job's agents spread over the members of `--rdzv-endpoint` (endpoint_order=spread, the default): each opens its
connection, keep-alive stream and watch on the member its node id picks, and the job meets across members; with
endpoint_order=listed they all start at the first member. A dead member's agents move on and come back."""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from etcd_testbed.server import EtcdCluster
from elastic_rt.rendezvous.etcd_client import EtcdClient, spread_first
from elastic_rt.rendezvous.handler import EtcdRendezvousHandler
from elastic_rt.rendezvous.registration import create_etcd_v3_handler, etcd_config_from_params, settings_from_params
from tests.support.etcd_metrics import grpc_counts
from tests.support.prometheus import wait_until
from tests.support.rendezvous import ranks


@pytest.fixture(scope="module")
def cluster():
    with EtcdCluster(3) as c:
        yield c


def _streams(cluster) -> list[dict[str, float]]:
    """Per member: the Watch and LeaseKeepAlive streams it has had opened (etcd's own counters)."""
    return [{m: counts.started.get(m, 0.0) for m in ("Watch", "LeaseKeepAlive")}
            for counts in map(grpc_counts, cluster.members)]


def _one_per_member(n: int) -> list[str]:
    """Node ids whose agents talk first to member 0, 1, ..., n-1."""
    names: dict[int, str] = {}
    i = 0
    while len(names) < n:
        names.setdefault(spread_first(f"node-{i}", n), f"node-{i}")
        i += 1
    return [names[k] for k in range(n)]


def _meet(cluster, run_id: str, names: list[str], **conf) -> list:
    handlers = [create_etcd_v3_handler(RendezvousParameters(
        "etcd-v3", cluster.endpoints, run_id, len(names), len(names), local_addr="127.0.0.1", node_id=name,
        last_call_timeout=2, **conf)) for name in names]
    got = ranks(handlers)
    assert sorted(r for r, _ in got.values()) == list(range(len(names)))
    return handlers


def _opened(before, after) -> list[tuple[float, float]]:
    return [(a["Watch"] - b["Watch"], a["LeaseKeepAlive"] - b["LeaseKeepAlive"]) for a, b in zip(after, before)]


def test_a_jobs_agents_each_talk_to_the_member_their_node_id_picks(cluster, run_id):
    names = _one_per_member(3)
    before = _streams(cluster)
    handlers = _meet(cluster, run_id, names)
    try:
        opened = _opened(before, _streams(cluster))
        for member, (watches, keep_alives) in enumerate(opened):
            assert watches >= 1 and keep_alives >= 1, (member, opened)  # each member serves its own agent
        for i, h in enumerate(handlers):
            assert h._client.current_endpoint == cluster.members[i].endpoint
    finally:
        for h in handlers:
            h.shutdown()


def test_endpoint_order_listed_puts_every_agent_on_the_first_member(cluster, run_id):
    names = _one_per_member(3)
    before = _streams(cluster)
    handlers = _meet(cluster, run_id, names, endpoint_order="listed", keepalive_to="member")  # (else: the leader's)
    try:
        opened = _opened(before, _streams(cluster))
        assert opened[0][0] >= 3 and opened[0][1] >= 3, opened
        assert opened[1] == (0, 0) and opened[2] == (0, 0), opened
    finally:
        for h in handlers:
            h.shutdown()


def test_a_dead_member_moves_its_agents_on_at_once_and_they_come_back_when_it_does(cluster, run_id):
    """The member an agent talks to dies (not the leader): its next keep-alive goes to the next member in the same
    beat (a refused connection costs no beat), so the agent never reports etcd unreachable. Once the member answers
    again the agent goes back to it (go_home, about every home_retry_s), its watch too."""
    _die_and_come_back(cluster, run_id)


def test_an_agent_whose_etcd_user_may_read_only_its_run_comes_back_too(run_id):
    """go_home's read is of the run's own key: an etcd user limited to the run's prefix may make it."""
    with EtcdCluster(3) as auth_cluster:
        auth_cluster.enable_auth("root-" + uuid.uuid4().hex[:8], {"agent": ("agent-pw", (f"/elastic-rt/{run_id}/",))})
        _die_and_come_back(auth_cluster, run_id, user="agent", password="agent-pw", allow_plaintext_auth="1")


def _die_and_come_back(cluster, run_id: str, **conf) -> None:
    cluster.move_leader(0)  # the victim is not the leader: no election for the survivors to wait out
    name = _one_per_member(3)[2]  # on the last member: the next one is the first (wrapping round)
    params = RendezvousParameters("etcd-v3", cluster.endpoints, run_id, 1, 1, local_addr="127.0.0.1", node_id=name,
                                  last_call_timeout=2, keepalive_to="member", **conf)  # keep-alives follow calls
    config = dataclasses.replace(etcd_config_from_params(params, name), home_retry_s=1.0)
    h = EtcdRendezvousHandler(EtcdClient(config), settings_from_params(params))
    ranks([h])
    changes: list[bool] = []
    h.health.add_listener(changes.append)  # called once now, with True
    victim, home, next_one = cluster.members[2], cluster.members[2].endpoint, cluster.members[0].endpoint
    try:
        cluster.kill_member(victim)
        killed = time.monotonic()
        wait_until("calls on the next member", lambda: h._client.current_endpoint == next_one, 10, poll_s=0.05)
        renewed = h._lease.last_renewed
        wait_until("a renewal after the kill", lambda: h._lease.last_renewed != renewed, 10, poll_s=0.05)
        assert h._lease.last_renewed > killed  # renewed by the next member
        assert changes == [True] and not h.health.unreachable_since(killed), changes
        cluster.restart_member(victim)  # no wait_healthy(): the testbed's check does not authenticate
        wait_until("calls and watch back home",
                   lambda: h._client.current_endpoint == home and h._view.stream_endpoint == home, 30, poll_s=0.05)
        assert h._client._endpoints[0].keepalive is None  # the keep-alive stream on the member it left is closed
        back = time.monotonic()
        wait_until("a renewal at home", lambda: h._lease.last_renewed > back, 10, poll_s=0.05)
        assert h.etcd_reachable() and changes == [True], changes
    finally:
        h.shutdown()
        if not cluster.is_running(victim):
            cluster.restart_member(victim)
        if "user" not in conf:
            cluster.wait_healthy(60)
