"""The scale-up gate (agent/scale_up.py): a running node holds the restart that admits a joining node while its
warm workers import, for at most max_wait_s; pure logic, a fake clock and pool."""

from __future__ import annotations

from elastic_rt.agent.scale_up import ScaleUpGate


class Pool:
    def __init__(self) -> None:
        self.busy = True

    def warming(self) -> bool:
        return self.busy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_held_while_warming_and_released_once_ready():
    pool, clock = Pool(), Clock()
    gate = ScaleUpGate(pool, max_wait_s=60, clock=clock)
    assert gate.hold()
    clock.now += 30
    assert gate.hold()
    pool.busy = False
    assert not gate.hold()


def test_released_after_max_wait_even_while_warming():
    pool, clock = Pool(), Clock()
    gate = ScaleUpGate(pool, max_wait_s=60, clock=clock)
    assert gate.hold()
    clock.now += 59.9
    assert gate.hold()
    clock.now += 0.1
    assert not gate.hold()


def test_a_restart_starts_the_next_scale_up_afresh():
    pool, clock = Pool(), Clock()
    gate = ScaleUpGate(pool, max_wait_s=60, clock=clock)
    assert gate.hold()
    clock.now += 61
    assert not gate.hold()
    gate.reset()  # the group restarted; a node waits again later
    clock.now += 5
    assert gate.hold()


def test_no_pool_or_zero_wait_never_holds():
    clock = Clock()
    assert not ScaleUpGate(None, clock=clock).hold()
    assert not ScaleUpGate(Pool(), max_wait_s=0, clock=clock).hold()
