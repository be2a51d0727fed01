"""The agent's fencing view and the worker's check (pure logic: the handler is a stand-in)."""

from __future__ import annotations

import pytest

from elastic_rt.checkpoint.fence import FENCE_FILE, FenceCheck, FencedError, FencePublisher


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Handler:
    """What FencePublisher reads from the rendezvous handler (EtcdRendezvousHandler.fence_view, catch_up)."""

    def __init__(self) -> None:
        self.round, self.last_renewed, self.lost, self.reachable = 3, 100.0, 0, True
        self.caught_up = True
        self.catch_ups = 0

    def fence_view(self) -> dict:
        return {"run_id": "job", "launch_id": "17", "round": self.round, "last_renewed": self.last_renewed,
                "renewals_lost": self.lost, "lease_ttl_s": 3.0, "reachable": self.reachable}

    def catch_up(self) -> bool:
        self.catch_ups += 1
        return self.caught_up


@pytest.fixture
def setup(tmp_path):
    handler, clock = Handler(), Clock()
    publisher = FencePublisher(str(tmp_path), handler, clock=clock)
    publisher.publish()
    check = FenceCheck(str(tmp_path / FENCE_FILE), round=3, clock=clock)
    return handler, clock, publisher, check


def test_the_round_is_current_while_the_lease_is_confirmed(setup):
    handler, clock, publisher, check = setup
    clock.now = 102.9
    check.check(wait_s=0)
    assert (check.run_id, check.launch_id) == ("job", "17")


def test_a_newer_round_fences_the_writer(setup):
    handler, clock, publisher, check = setup
    handler.round = 4
    publisher.publish()
    with pytest.raises(FencedError, match="round 3, but its agent is in round 4"):
        check.check(wait_s=0)


def test_an_unconfirmed_lease_fences_the_writer_after_the_wait(setup):
    handler, clock, publisher, check = setup
    clock.now = 103.5  # last renewal 100.0 + TTL 3 s: a frozen agent confirms nothing
    with pytest.raises(FencedError, match="has not confirmed round 3"):
        check.check(wait_s=0)


def test_an_unreachable_etcd_confirms_nothing_new(setup):
    handler, clock, publisher, check = setup
    handler.reachable, handler.last_renewed = False, 103.0
    publisher.publish()
    clock.now = 103.5
    with pytest.raises(FencedError):
        check.check(wait_s=0)


def test_after_the_lease_was_found_gone_nothing_is_confirmed_until_the_view_caught_up(setup):
    handler, clock, publisher, check = setup
    clock.now = 110.0  # resumed after a pause: the lease was found gone and granted anew
    handler.lost, handler.last_renewed, handler.caught_up = 1, 109.9, False
    publisher.publish()
    with pytest.raises(FencedError):
        check.check(wait_s=0)
    handler.caught_up, handler.round = True, 5  # the read of `round` shows the others re-formed
    publisher.publish()
    assert handler.catch_ups == 2
    with pytest.raises(FencedError, match="agent is in round 5"):
        check.check(wait_s=0)
