"""Connection.unary's tick: what a caller does while it waits for a reply (a registration's keep-alives). Pure logic
on a fake clock: a stream whose wait advances the clock."""

from __future__ import annotations

import grpc
import pytest

from elastic_rt.rendezvous.connection import Tick, _ticking
from elastic_rt.rendezvous.wire import CallError
from tests.support.clock import FakeClock


class _Stream:
    """A call sent at the clock's time whose reply comes `reply_after_s` after the send (None: never); each wait
    moves the clock on, and is recorded."""

    def __init__(self, clock: FakeClock, reply_after_s: float | None) -> None:
        self.clock, self.sent_at = clock, clock.now
        self._reply_at = None if reply_after_s is None else self.sent_at + reply_after_s
        self.waits: list[float] = []

    def next(self, timeout_s: float) -> bytes:
        self.waits.append(timeout_s)
        if self._reply_at is not None and self._reply_at <= self.clock.now + timeout_s:
            self.clock.now = max(self.clock.now, self._reply_at)
            return b"reply"
        self.clock.now += timeout_s
        raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s:g} s")


def _ticks(clock: FakeClock, stream: _Stream, every_s: float, takes_s: float = 0.0) -> tuple[list[float], Tick]:
    """The times (from the send) at which the tick ran, and a tick that takes `takes_s` of the clock."""
    at: list[float] = []

    def fn() -> None:
        at.append(round(clock.now - stream.sent_at, 6))
        clock.now += takes_s

    return at, Tick(every_s, fn)


def test_a_reply_within_the_first_interval_calls_no_tick():
    clock = FakeClock()
    stream = _Stream(clock, 0.1)
    at, tick = _ticks(clock, stream, 1.0)
    assert _ticking(stream, 10.0, tick, clock) == b"reply"
    assert at == [] and stream.waits == [1.0]


def test_a_late_reply_is_waited_for_with_a_tick_each_interval_from_the_send():
    clock = FakeClock()
    stream = _Stream(clock, 3.5)
    at, tick = _ticks(clock, stream, 1.0)
    assert _ticking(stream, 10.0, tick, clock) == b"reply"
    assert at == [1.0, 2.0, 3.0]


def test_the_deadline_runs_from_the_send_and_no_tick_comes_at_or_after_it():
    clock = FakeClock()
    stream = _Stream(clock, None)
    at, tick = _ticks(clock, stream, 1.0)
    with pytest.raises(CallError) as info:
        _ticking(stream, 2.5, tick, clock)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert at == [1.0, 2.0]
    assert clock.now - stream.sent_at == pytest.approx(2.5)


def test_a_tick_that_overran_its_interval_is_not_followed_by_another_at_once():
    clock = FakeClock()
    stream = _Stream(clock, 4.0)
    at, tick = _ticks(clock, stream, 1.0, takes_s=1.5)
    assert _ticking(stream, 10.0, tick, clock) == b"reply"
    assert at == [1.0, 3.5]  # the next one a full interval after the first one ended (2.5 s), not at 2.0 s


def test_a_failure_other_than_the_deadline_ends_the_wait_at_once():
    clock = FakeClock()

    class Broken(_Stream):
        def next(self, timeout_s: float) -> bytes:
            raise CallError(grpc.StatusCode.UNAVAILABLE, "connection broken")

    stream = Broken(clock, None)
    at, tick = _ticks(clock, stream, 1.0)
    with pytest.raises(CallError) as info:
        _ticking(stream, 10.0, tick, clock)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and at == []


def test_a_call_that_ended_with_etcds_own_deadline_is_not_ticked_through():
    """etcd ended the call with DEADLINE_EXCEEDED (its own deadline, from when it received the request): Stream.next
    raises it again at every wait, and the wait must end with it, not tick on until the local deadline."""
    clock = FakeClock()

    class EndedByEtcd(_Stream):
        def next(self, timeout_s: float) -> bytes:
            self.waits.append(timeout_s)
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "context deadline exceeded")

    stream = EndedByEtcd(clock, None)
    at, tick = _ticks(clock, stream, 1.0)
    with pytest.raises(CallError):
        _ticking(stream, 10.0, tick, clock, ended=lambda: True)
    assert at == [] and stream.waits == [1.0, 0.0]


def test_a_reply_that_came_with_the_calls_end_just_after_a_wait_is_returned():
    clock = FakeClock()

    class LateReply(_Stream):
        def next(self, timeout_s: float) -> bytes:
            self.waits.append(timeout_s)
            if len(self.waits) == 1:
                self.clock.now += timeout_s
                raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within 1 s")
            return b"reply"  # it came, with its trailers, as the first wait ended

    stream = LateReply(clock, None)
    at, tick = _ticks(clock, stream, 1.0)
    assert _ticking(stream, 10.0, tick, clock, ended=lambda: True) == b"reply"
    assert at == []


def test_a_tick_needs_an_interval():
    with pytest.raises(ValueError, match="> 0"):
        Tick(0.0, lambda: None)
