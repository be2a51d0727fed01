"""Goodput accounting with an injected clock: categories, settlement at commits, lost progress."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_rt.goodput.ledger import CATEGORIES, GoodputLedger
from tests.support.clock import FakeClock


def _check_sum(ledger: GoodputLedger) -> None:
    assert sum(ledger.totals().values()) + ledger.uncommitted() == pytest.approx(ledger.elapsed(), abs=1e-9)


def _train(ledger: GoodputLedger, clock: FakeClock, first: int, last: int, step_s: float = 1.0) -> None:
    """Report steps first..last, one every step_s."""
    for step in range(first, last + 1):
        clock.advance(step_s)
        ledger.steps(step=step, at=clock.now)
        _check_sum(ledger)


def test_a_run_with_one_failure_is_split_into_every_category():
    clock = FakeClock()
    ledger = GoodputLedger(started_at=90.0, clock=clock)  # the process started 10 s before the observer
    clock.advance(5)
    ledger.workers_started()
    _train(ledger, clock, 1, 10)  # first step at 106: startup 16 s
    ledger.checkpoint(step=5, save_duration_s=0.5, blocked_s=0.5)  # committed while at step 10
    _check_sum(ledger)
    _train(ledger, clock, 11, 13)
    clock.advance(0.5)  # the failure shows half a second after step 13
    ledger.restart()
    clock.advance(2)
    lost = ledger.workers_started()  # restart: 2 s
    assert lost is not None and lost.steps == 8 and lost.committed_step == 5 and lost.last_step == 13
    clock.advance(3)
    ledger.steps(step=6, at=clock.now)  # restore: 3 s; resumed from 5
    _train(ledger, clock, 7, 20)
    clock.advance(1.5)
    assert ledger.finished(succeeded=True) is None
    clock.advance(0.25)  # waiting for the other nodes
    totals = ledger.totals()
    assert totals["startup"] == pytest.approx(16)
    assert totals["restart"] == pytest.approx(2)
    assert totals["restore"] == pytest.approx(3)
    assert totals["checkpoint"] == pytest.approx(0.5)
    # step 5 was reached at 110: 4 s productive; 110.5 .. 118.5 lost (steps 6..13 and the detection)
    assert lost.seconds == pytest.approx(8.0)
    assert totals["lost"] == pytest.approx(8.0)
    assert totals["productive"] == pytest.approx(4 + 14)
    assert totals["other"] == pytest.approx(1.5 + 0.25)
    assert ledger.uncommitted() == 0
    assert sum(totals.values()) == pytest.approx(ledger.elapsed())
    assert ledger.ratio() == pytest.approx(18 / ledger.elapsed())


def test_without_any_commit_a_failure_loses_the_whole_generation():
    clock = FakeClock()
    ledger = GoodputLedger(started_at=clock.now, clock=clock)
    ledger.workers_started()
    _train(ledger, clock, 1, 7)
    ledger.restart()
    lost = ledger.workers_started()
    assert lost.steps == 7 and lost.committed_step is None
    assert lost.seconds == pytest.approx(6)  # from the first step (startup before it)
    assert ledger.totals()["productive"] == 0


def test_a_save_made_while_the_workers_stop_keeps_their_steps():
    clock = FakeClock()
    ledger = GoodputLedger(started_at=clock.now, clock=clock)
    ledger.workers_started()
    _train(ledger, clock, 1, 12)
    ledger.restart()  # scale-up: SIGTERM, the script saves step 13 on its way out
    clock.advance(1)
    ledger.checkpoint(step=13, save_duration_s=0.4, blocked_s=0.4)
    lost = ledger.workers_started()
    assert lost.steps == 0 and lost.seconds == pytest.approx(0)
    assert ledger.totals()["checkpoint"] == 0  # the save's time lies in the restart, counted there
    _check_sum(ledger)


def test_blocked_time_of_each_commit_is_checkpoint_time():
    clock = FakeClock()
    ledger = GoodputLedger(started_at=clock.now, clock=clock)
    ledger.workers_started()
    for commit in (10, 20, 30):
        _train(ledger, clock, commit - 9, commit)
        clock.advance(2)  # a synchronous save of 2 s after the step
        ledger.checkpoint(step=commit, save_duration_s=2, blocked_s=2)
        _check_sum(ledger)
    assert ledger.totals()["checkpoint"] == pytest.approx(6)
    assert ledger.uncommitted() == pytest.approx(0)


def test_heartbeats_that_count_differently_place_the_commit_by_time():
    clock = FakeClock()
    ledger = GoodputLedger(started_at=clock.now, clock=clock)
    ledger.workers_started()
    _train(ledger, clock, 1, 10)  # the heartbeat counts 1..10 in this process
    ledger.checkpoint(step=1000, save_duration_s=3, blocked_s=0)  # a global step the heartbeat never saw
    # placed where the save began (3 s ago: at heartbeat step 7)
    assert ledger.totals()["productive"] == pytest.approx(6)
    ledger.restart()
    lost = ledger.workers_started()
    assert lost.steps == 3 and lost.seconds == pytest.approx(3)


def test_a_failure_before_the_first_step_is_startup_then_restart():
    clock = FakeClock()
    ledger = GoodputLedger(started_at=clock.now, clock=clock)
    ledger.workers_started()
    clock.advance(4)
    ledger.restart()
    clock.advance(1)
    assert ledger.workers_started() is None
    clock.advance(2)
    ledger.steps(step=1, at=clock.now)
    totals = ledger.totals()
    assert totals["startup"] == pytest.approx(6) and totals["restart"] == pytest.approx(1)
    assert totals["restore"] == 0


def test_the_first_step_is_dated_by_the_earliest_heartbeat():
    clock = FakeClock()
    ledger = GoodputLedger(started_at=clock.now, clock=clock)
    ledger.workers_started()
    clock.advance(10)
    assert ledger.steps(step=4, at=clock.now, first_at=clock.now - 3)
    assert ledger.phase == "training" and ledger.phase_since == pytest.approx(clock.now - 3)
    assert ledger.totals()["startup"] == pytest.approx(7)
    assert not ledger.steps(step=5, at=clock.now)


_EVENTS = st.lists(st.tuples(st.sampled_from(["steps", "checkpoint", "restart", "workers_started", "finished"]),
                             st.floats(0, 5), st.integers(0, 5)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(_EVENTS)
def test_categories_only_grow_and_always_sum_to_the_wall_time(events):
    clock = FakeClock()
    ledger = GoodputLedger(started_at=clock.now - 1, clock=clock)
    step = 0
    before = ledger.totals()
    for kind, dt, n in events:
        clock.advance(dt)
        if kind == "steps":
            step += n
            ledger.steps(step=step, at=clock.now - dt / 2)
        elif kind == "checkpoint":
            ledger.checkpoint(step=max(0, step - n), save_duration_s=dt / 3, blocked_s=dt / 4)
        elif kind == "restart":
            ledger.restart()
        elif kind == "workers_started":
            lost = ledger.workers_started()
            assert lost is None or lost.steps >= 0 and lost.seconds >= 0
        else:
            ledger.finished(succeeded=bool(n % 2))
        totals = ledger.totals()
        assert all(totals[c] >= before[c] - 1e-9 for c in CATEGORIES), (before, totals)
        _check_sum(ledger)
        before = totals
