"""Where EtcdClient sends keep-alives once follow_leader found the leader: a leader that refuses, hangs or stops
answering is left (and confirmed by a Status before it is taken again), a new raft term makes it look again, and an
etcd user that may not read Status leaves keep-alives on the agent's member with one warning. Pure logic: the
endpoints are stand-ins (tests/unit/test_etcd_failover.py's) that answer or fail as told."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import grpc
import pytest

from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous.etcd_client import LEADER_MISSES, LEADER_RETRY_S
from elastic_rt.rendezvous.etcd_endpoint import Renewal
from elastic_rt.rendezvous.wire import CallError
from tests.unit.test_etcd_failover import FakeEndpoint, _client

IDS = {"a": 11, "b": 12, "c": 13}


class Member(FakeEndpoint):
    """A FakeEndpoint that is an etcd member: Status names `leader` (a label) in `term`; a keep-alive is answered
    (`answer`: True, or None for no answer within the beat) or fails with `fail` after `delay_s`."""

    def __init__(self, label, clock, cluster) -> None:
        super().__init__(label, clock)
        self.cluster = cluster
        self.answer: bool = True
        self.keep_alives = 0

    def call(self, method, request, timeout_s, **kw):
        result = super().call(method, request, timeout_s, **kw)
        if method != "Maintenance/Status":
            return result
        return SimpleNamespace(leader=IDS[self.cluster.leader] if self.cluster.leader else 0,
                               header=SimpleNamespace(member_id=IDS[self.label], raft_term=self.cluster.term))

    def keep_alive(self, lease_id, timeout_s, silent_s=None):
        self.keep_alives += 1
        self.clock.now += self.delay_s
        if self.fail is not None:
            raise self.fail
        return Renewal(3.0, self.clock.now, True, self.cluster.term) if self.answer else None


def _members(first: int = 0):
    client, fakes, clock = _client(first=first)
    cluster = SimpleNamespace(leader="b", term=2)
    members = [Member(f.label, clock, cluster) for f in fakes]
    client._endpoints = members  # type: ignore[assignment]
    return client, members, clock, cluster


def _beat(client, every_s: float = 1.0):
    return client.keep_alive(7, every_s=every_s, silent_s=1.5 * every_s)


def test_the_look_finds_the_leader_and_keep_alives_go_there_other_calls_stay():
    client, members, clock, cluster = _members(first=0)
    assert _beat(client).ttl > 0 and members[0].keep_alives == 1  # before the look: the agent's member
    assert client.follow_leader() and client.keepalive_endpoint == "b" and client.current_endpoint == "a"
    assert members[0].dropped == 1  # the keep-alive stream on the member it left is closed
    _beat(client)
    assert [m.keep_alives for m in members] == [1, 1, 0]
    assert not client.follow_leader() and members[1].calls.count("Maintenance/Status") == 1  # found: no look again


def test_a_leader_that_refuses_sends_that_beat_to_the_member_and_is_confirmed_before_it_is_taken_again():
    client, members, clock, cluster = _members(first=0)
    client.follow_leader()
    members[1].fail = CallError(grpc.StatusCode.UNAVAILABLE, "connect: Connection refused")
    assert _beat(client).ttl > 0  # the same beat, on the agent's member
    assert [m.keep_alives for m in members] == [1, 1, 0] and client.keepalive_endpoint == "a"
    assert not client.follow_leader()  # not looked for again at once
    clock.now += 1.25 * LEADER_RETRY_S
    statuses = members[1].calls.count("Maintenance/Status")
    assert not client.follow_leader()  # the look asks it again (it refuses): keep-alives stay on the member
    assert members[1].calls.count("Maintenance/Status") == statuses + 1 and client.keepalive_endpoint == "a"


def test_a_leader_that_hangs_costs_the_beat_and_the_next_goes_to_the_member():
    client, members, clock, cluster = _members(first=0)
    client.follow_leader()
    members[1].fail, members[1].delay_s = CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer"), 1.5
    with pytest.raises(EtcdUnavailableError):
        _beat(client)
    assert client.keepalive_endpoint == "a" and client.current_endpoint == "a"
    assert _beat(client).ttl > 0 and members[0].keep_alives == 1


def test_a_leader_that_answers_no_keep_alive_for_several_beats_is_left():
    client, members, clock, cluster = _members(first=2)
    client.follow_leader()
    members[1].answer = False  # busy, or stepped down while its connection stays alive
    for _ in range(LEADER_MISSES - 1):
        assert _beat(client) is None and client.keepalive_endpoint == "b"
        client.keep_alive(7, every_s=0.0, silent_s=float("inf"))  # a registration's between them: not an answer
    assert _beat(client) is None and client.keepalive_endpoint == "c"
    assert _beat(client).ttl > 0 and members[2].keep_alives == 1
    assert client.keep_alive(7, every_s=0.0, silent_s=float("inf")).ttl > 0  # a registration's: never a miss


def test_a_new_term_makes_it_look_again_and_follow_the_new_leader():
    client, members, clock, cluster = _members(first=0)
    client.follow_leader()
    _beat(client)
    cluster.leader, cluster.term = "c", 3
    assert client.keepalive_endpoint == "b"
    _beat(client)  # answered in term 3
    assert client.follow_leader() and client.keepalive_endpoint == "c" and members[1].dropped == 1


def test_an_etcd_user_refused_status_keeps_alive_on_its_member_with_one_warning(caplog):
    client, members, clock, cluster = _members(first=0)
    members[0].fail = CallError(grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied")
    with caplog.at_level(logging.WARNING, logger="elastic_rt.rendezvous.etcd_client"):
        assert not client.follow_leader()
        clock.now += 10 * LEADER_RETRY_S
        assert not client.follow_leader()
    assert members[0].calls.count("Maintenance/Status") == 1  # not asked again
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "keepalive_to=member" in warnings[0], warnings
