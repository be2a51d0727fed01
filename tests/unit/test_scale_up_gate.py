"""The scale-up gate (agent/scale_up.py): a running node holds the restart that admits a joining node while its
warm workers import, for at most max_wait_s; pure logic, a fake clock and pool."""

from __future__ import annotations

from elastic_rt.agent.scale_up import ScaleUpGate, join_when_warm
from tests.support.clock import FakeClock


class Pool:
    def __init__(self) -> None:
        self.busy = True

    def warming(self) -> bool:
        return self.busy


def test_held_while_warming_and_released_once_ready():
    pool, clock = Pool(), FakeClock()
    gate = ScaleUpGate(pool, max_wait_s=60, clock=clock)
    assert gate.hold()
    clock.now += 30
    assert gate.hold()
    pool.busy = False
    assert not gate.hold()


def test_released_after_max_wait_even_while_warming():
    pool, clock = Pool(), FakeClock()
    gate = ScaleUpGate(pool, max_wait_s=60, clock=clock)
    assert gate.hold()
    clock.now += 59.9
    assert gate.hold()
    clock.now += 0.1
    assert not gate.hold()


def test_a_restart_starts_the_next_scale_up_afresh():
    pool, clock = Pool(), FakeClock()
    gate = ScaleUpGate(pool, max_wait_s=60, clock=clock)
    assert gate.hold()
    clock.now += 61
    assert not gate.hold()
    gate.reset()  # the group restarted; a node waits again later
    clock.now += 5
    assert gate.hold()


def test_no_pool_or_zero_wait_never_holds():
    clock = FakeClock()
    assert not ScaleUpGate(None, clock=clock).hold()
    assert not ScaleUpGate(Pool(), max_wait_s=0, clock=clock).hold()


class ReadyAfter(Pool):
    """A pool that finishes warming once the clock reaches `at`."""

    def __init__(self, clock: FakeClock, at: float) -> None:
        super().__init__()
        self.clock, self.at = clock, at

    def warming(self) -> bool:
        return self.clock.now < self.at


def _join(pool, clock: FakeClock, *, running: bool, max_wait_s: float = 60) -> float:
    def sleep(seconds: float) -> None:
        clock.now += seconds

    return join_when_warm(pool, running=lambda: running, max_wait_s=max_wait_s, clock=clock, sleep=sleep)


def test_a_node_joining_a_running_job_waits_for_its_warm_workers():
    clock = FakeClock()
    assert abs(_join(ReadyAfter(clock, clock.now + 7), clock, running=True) - 7) < 0.3


def test_a_node_joins_at_once_when_no_round_runs_or_its_pool_is_ready_or_off():
    clock = FakeClock()
    assert _join(ReadyAfter(clock, clock.now + 7), clock, running=False) == 0
    assert _join(ReadyAfter(clock, clock.now), clock, running=True) == 0
    assert _join(None, clock, running=True) == 0
    assert _join(Pool(), clock, running=True, max_wait_s=0) == 0


def test_a_joining_node_waits_at_most_max_wait():
    clock = FakeClock()
    assert abs(_join(Pool(), clock, running=True, max_wait_s=30) - 30) < 0.3
