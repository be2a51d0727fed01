"""The agent's fencing view and the worker's check (pure logic: the handler is a stand-in)."""

from __future__ import annotations

import pytest

from elastic_rt.checkpoint.fence import FENCE_FILE, FenceCheck, FencedError, FencePublisher
from tests.support.clock import FakeClock


class Handler:
    """What FencePublisher reads from the rendezvous handler (EtcdRendezvousHandler.fence_view, catch_up)."""

    def __init__(self) -> None:
        self.round, self.last_renewed, self.lost, self.reachable, self.etcd_up = 3, 100.0, 0, True, True
        self.caught_up = True
        self.catch_ups = 0

    def fence_view(self) -> dict:
        return {"run_id": "job", "launch_id": "17", "round": self.round, "last_renewed": self.last_renewed,
                "renewals_lost": self.lost, "lease_ttl_s": 3.0, "reachable": self.reachable, "etcd_up": self.etcd_up}

    def catch_up(self) -> bool:
        self.catch_ups += 1
        return self.caught_up


@pytest.fixture
def setup(tmp_path):
    handler, clock = Handler(), FakeClock()
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


def test_an_unconfirmed_lease_without_an_outage_confirms_nothing_new(setup):
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


def test_during_an_etcd_outage_reported_by_a_live_agent_the_writer_lease_decides(setup, caplog):
    """etcd is needed to change membership, not to train: a save during an outage commits (the writer lease still
    checks that no newer writer took the URL), once, with a warning."""
    handler, clock, publisher, check = setup
    handler.reachable, handler.etcd_up = False, False
    clock.now = 110.0  # far past the last renewal (100.0) + TTL
    publisher.publish()
    with caplog.at_level("WARNING", logger="elastic_rt.checkpoint"):
        check.check(wait_s=0)
        clock.now += 0.5
        publisher.publish()  # the live agent rewrites its report
        check.check(wait_s=0)
    assert len([r for r in caplog.records if "etcd does not answer" in r.getMessage()]) == 1


def test_an_outage_report_that_stopped_being_rewritten_fences_the_writer(setup):
    """The agent froze with its node during an outage (or died): its last report is not believed for long."""
    handler, clock, publisher, check = setup
    handler.reachable, handler.etcd_up = False, False
    clock.now = 110.0
    publisher.publish()
    clock.now = 111.5  # no rewrite for 1.5 s
    with pytest.raises(FencedError, match="has not confirmed round 3"):
        check.check(wait_s=0)


def test_once_the_lease_is_found_gone_an_outage_report_no_longer_counts(setup):
    """etcd answered again and this node's lease had expired: the others may have re-formed meanwhile."""
    handler, clock, publisher, check = setup
    handler.reachable, handler.etcd_up = False, False
    clock.now = 110.0
    publisher.publish()
    handler.lost, handler.caught_up = 1, False  # found gone; the read of `round` has not caught up yet
    clock.now = 111.5
    publisher.publish()
    with pytest.raises(FencedError):
        check.check(wait_s=0)
