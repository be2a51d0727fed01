"""Which endpoint EtcdClient calls: a keep-alive's one attempt a beat, a dead member passed over at once, and the
way back to the agent's own member (go_home). Pure logic: the endpoints are stand-ins that answer or fail as told."""

from __future__ import annotations

import time

import grpc
import pytest

from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig
from elastic_rt.rendezvous.wire import CallError


class FakeEndpoint:
    """Fails each call with `fail` (a CallError) after `delay_s`, or answers "ok"; records the calls."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.fail: CallError | None = None
        self.delay_s = 0.0
        self.calls: list[str] = []
        self.dropped = 0

    def call(self, method, request, timeout_s, **_):
        self.calls.append(method)
        if self.delay_s:
            time.sleep(self.delay_s)  # the failure's own duration, which _call measures
        if self.fail is not None:
            raise self.fail
        return "ok"

    def drop_keepalive(self) -> None:
        self.dropped += 1

    def close(self) -> None:
        pass


def _client(first: int = 0, home_retry_s: float = 30.0) -> tuple[EtcdClient, list[FakeEndpoint]]:
    client = EtcdClient(EtcdConfig(endpoints=(("a", 1), ("b", 1), ("c", 1)), first=first, home_retry_s=home_retry_s))
    fakes = [FakeEndpoint(x) for x in "abc"]
    client._endpoints = fakes  # type: ignore[assignment]
    return client, fakes


def _beat(client: EtcdClient, timeout_s: float):
    return client._call(lambda ep, t: ep.call("Lease/LeaseKeepAlive", None, t), timeout_s=timeout_s, attempts=1)


def test_the_first_call_goes_to_the_endpoint_the_config_picked():
    client, fakes = _client(first=2)
    assert _beat(client, 1.0) == "ok"
    assert [len(f.calls) for f in fakes] == [0, 0, 1] and client.current_endpoint == "c"


def test_a_member_that_fails_at_once_is_passed_over_in_the_same_beat():
    client, fakes = _client(first=1)
    fakes[1].fail = CallError(grpc.StatusCode.UNAVAILABLE, "connect: Connection refused")
    assert _beat(client, 10.0) == "ok"  # b refused: c answered this beat's keep-alive
    assert [len(f.calls) for f in fakes] == [0, 1, 1] and client.current_endpoint == "c"


def test_a_slow_failure_uses_the_beats_one_attempt():
    client, fakes = _client()
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
    client, fakes = _client(first=1)
    for f in fakes:
        f.fail = CallError(grpc.StatusCode.UNAVAILABLE, "connect: Connection refused")
    with pytest.raises(EtcdUnavailableError, match="not reachable"):
        _beat(client, 10.0)
    assert [len(f.calls) for f in fakes] == [1, 1, 1] and client.current_endpoint == "b"


def test_go_home_waits_its_interval_then_returns_once_the_member_answers():
    client, fakes = _client(first=0, home_retry_s=0.2)
    fakes[0].fail = CallError(grpc.StatusCode.UNAVAILABLE, "connect: Connection refused")
    _beat(client, 10.0)
    assert client.current_endpoint == "b"
    assert not client.go_home()  # within home_retry_s of the failover: a's not asked
    assert fakes[0].calls == ["Lease/LeaseKeepAlive"]
    deadline = time.monotonic() + 5
    while not fakes[0].calls[1:] and time.monotonic() < deadline:
        assert not client.go_home()  # a still refuses: stays on b
    assert fakes[0].calls[1:] == ["KV/Range"] and client.current_endpoint == "b" and fakes[1].dropped == 0
    fakes[0].fail = None
    while not client.go_home() and time.monotonic() < deadline:
        pass
    assert client.current_endpoint == "a" and fakes[1].dropped == 1  # b's keep-alive stream closed
    assert not client.go_home()  # at home: nothing to do


def test_go_home_does_nothing_on_the_agents_own_member():
    client, fakes = _client(first=2, home_retry_s=0.0)
    assert not client.go_home()
    assert [f.calls for f in fakes] == [[], [], []]
