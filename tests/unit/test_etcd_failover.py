"""Which endpoint EtcdClient calls: a keep-alive's one attempt a beat, a dead member passed over at once, and the
way back to the agent's own member (go_home). Pure logic: the endpoints are stand-ins that answer or fail as told."""

from __future__ import annotations

import random

import grpc
import pytest

from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig
from elastic_rt.rendezvous.wire import CallError
from tests.support.clock import FakeClock


class FakeEndpoint:
    """Fails each call with `fail` (a CallError) `delay_s` after it began (on the fake clock), or answers "ok";
    records each call's method and request."""

    def __init__(self, label: str, clock: FakeClock) -> None:
        self.label = label
        self.clock = clock
        self.fail: CallError | None = None
        self.delay_s = 0.0
        self.calls: list[str] = []
        self.requests: list[object] = []
        self.dropped = 0

    def call(self, method, request, timeout_s, **_):
        self.calls.append(method)
        self.requests.append(request)
        self.clock.now += self.delay_s  # the failure's own duration, which _call measures
        if self.fail is not None:
            raise self.fail
        return "ok"

    def drop_keepalive(self) -> None:
        self.dropped += 1

    def close(self) -> None:
        pass


def _client(first: int = 0, home_retry_s: float = 30.0) -> tuple[EtcdClient, list[FakeEndpoint], FakeClock]:
    clock = FakeClock()
    client = EtcdClient(EtcdConfig(endpoints=(("a", 1), ("b", 1), ("c", 1)), first=first, home_retry_s=home_retry_s),
                        clock=clock, rng=random.Random(0))
    fakes = [FakeEndpoint(x, clock) for x in "abc"]
    client._endpoints = fakes  # type: ignore[assignment]
    return client, fakes, clock


def _beat(client: EtcdClient, timeout_s: float):
    return client._call(lambda ep, t: ep.call("Lease/LeaseKeepAlive", None, t), timeout_s=timeout_s, attempts=1)


def test_the_first_call_goes_to_the_endpoint_the_config_picked():
    client, fakes, clock = _client(first=2)
    assert _beat(client, 1.0) == "ok"
    assert [len(f.calls) for f in fakes] == [0, 0, 1] and client.current_endpoint == "c"


def test_a_member_that_fails_at_once_is_passed_over_in_the_same_beat():
    client, fakes, clock = _client(first=1)
    fakes[1].fail = CallError(grpc.StatusCode.UNAVAILABLE, "connect: Connection refused")
    assert _beat(client, 10.0) == "ok"  # b refused: c answered this beat's keep-alive
    assert [len(f.calls) for f in fakes] == [0, 1, 1] and client.current_endpoint == "c"


def test_a_slow_failure_uses_the_beats_one_attempt():
    client, fakes, clock = _client()
    fakes[0].fail, fakes[0].delay_s = CallError(grpc.StatusCode.UNAVAILABLE, "connection broken"), 0.06
    with pytest.raises(EtcdUnavailableError, match=r"\(a: unavailable\)"):
        _beat(client, 0.2)  # failed after more than a quarter of the deadline: counted
    assert [len(f.calls) for f in fakes] == [1, 0, 0]
    assert client.current_endpoint == "b"  # the next beat starts there
    fakes[1].fail = CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within 0.2 s")
    with pytest.raises(EtcdUnavailableError):
        _beat(client, 0.2)  # a deadline always counts, however fast it came
    assert [len(f.calls) for f in fakes] == [1, 1, 0] and client.current_endpoint == "c"


def test_every_member_failing_at_once_is_etcd_unreachable_and_the_start_stays():
    client, fakes, clock = _client(first=1)
    for f in fakes:
        f.fail = CallError(grpc.StatusCode.UNAVAILABLE, "connect: Connection refused")
    with pytest.raises(EtcdUnavailableError, match="not reachable"):
        _beat(client, 10.0)
    assert [len(f.calls) for f in fakes] == [1, 1, 1] and client.current_endpoint == "b"


def test_go_home_waits_its_interval_then_returns_once_the_member_answers():
    client, fakes, clock = _client(first=0, home_retry_s=30.0)
    fakes[0].fail = CallError(grpc.StatusCode.UNAVAILABLE, "connect: Connection refused")
    _beat(client, 10.0)
    assert client.current_endpoint == "b"
    clock.now += 22  # due 22.5-37.5 s after the failover (30 s, give or take a quarter)
    assert not client.go_home("/run/round")
    assert fakes[0].calls == ["Lease/LeaseKeepAlive"]  # not asked yet
    clock.now += 16
    assert not client.go_home("/run/round")  # asked once: still refuses, so the agent stays on b
    assert fakes[0].calls[1:] == ["KV/Range"] and fakes[0].requests[1].key == b"/run/round"
    assert fakes[0].requests[1].count_only and client.current_endpoint == "b" and fakes[1].dropped == 0
    assert not client.go_home("/run/round") and len(fakes[0].calls) == 2  # not again before the next interval
    fakes[0].fail = None
    clock.now += 38
    assert client.go_home("/run/round")
    assert client.current_endpoint == "a" and fakes[1].dropped == 1  # b's keep-alive stream closed
    clock.now += 100
    assert not client.go_home("/run/round") and len(fakes[0].calls) == 3  # at home: nothing to do


def test_a_silent_member_given_up_is_not_asked_again_at_once():
    client, fakes, clock = _client(first=0)
    fakes[0].fail = CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within 1 s")
    with pytest.raises(EtcdUnavailableError):
        _beat(client, 1.0)  # the beat's one attempt: the next call starts at b
    assert _beat(client, 1.0) == "ok" and client.current_endpoint == "b"
    assert not client.go_home("/run/round") and fakes[0].calls == ["Lease/LeaseKeepAlive"]


def test_go_home_does_nothing_on_the_agents_own_member():
    client, fakes, clock = _client(first=2, home_retry_s=0.0)
    assert not client.go_home("/run/round")
    assert [f.calls for f in fakes] == [[], [], []]
