"""An etcd member dies: clients fail over to the next endpoint and a running job is not disturbed (the agents that
talked to it move to the next member, the others stay where they are)."""

from __future__ import annotations

import time

import pytest

from etcd_testbed.server import EtcdCluster
from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig, spread_first
from tests.chaos.harness import Node, launch_args
from tests.chaos.test_launch_e2e import _rank0, nodes  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with EtcdCluster(3) as c:
        yield c


def test_client_fails_over_when_its_member_dies(cluster):
    first = cluster.members[0]
    client = EtcdClient(EtcdConfig(endpoints=tuple((m.host, m.client_port) for m in cluster.members),
                                   request_timeout_s=2.0))
    client.put("/failover/a", b"1")
    cluster.kill_member(first)
    try:
        client.put("/failover/b", b"2")  # the first endpoint is dead: the next one answers
        kv, _ = client.get("/failover/a")
        assert kv is not None and kv.value == b"1"
    finally:
        cluster.restart_member(first)
        cluster.wait_healthy(60)
        client.close()


def test_job_survives_the_loss_of_an_etcd_member(cluster, run_id, nodes):  # noqa: F811
    endpoints = cluster.endpoints
    assert spread_first("a", 3) != spread_first("b", 3)  # the two agents start on members of their own
    a = Node(launch_args(endpoints, run_id, "a", nnodes="2", steps=150, step_sleep=0.05), name="a")
    b = Node(launch_args(endpoints, run_id, "b", nnodes="2", steps=150, step_sleep=0.05), name="b")
    nodes.extend([a, b])
    leader, _ = _rank0(a, b)
    leader.wait_for(r"step=5 ", 120)
    victim = cluster.members[spread_first(leader.name, 3)]  # the member rank 0's agent talks to
    killed_at = time.monotonic()
    cluster.kill_member(victim)
    leader.wait_for(r"step=\d+ ", 60, after=killed_at)
    leader.wait_for(r"etcd: failed over to ", 30, after=killed_at)  # its agent was on the victim: it moved on
    try:
        for n in (a, b):
            assert n.wait_exit(240) == 0, n.output[-3000:]
        assert leader.matches(r"done steps=150 world_size=4")
        assert not any(n.matches(r"restarting the worker group") for n in (a, b))
    finally:
        cluster.restart_member(victim)
