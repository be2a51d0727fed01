"""A membership view's lock must be re-entrant: closing its stream under the lock (refresh() -> _read_again()) can
deliver the stream's end (_on_watch_end) on the same thread, which takes the lock again. A view given a lock that is
not re-entrant would hang there the first time; it is refused when the view is made."""

from __future__ import annotations

import threading
import time

import pytest

from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.view import MembershipView


def test_a_lock_that_is_not_reentrant_is_refused():
    with pytest.raises(ValueError, match="re-entrant"):
        MembershipView(None, RunKeys("r"), node_id="n1", lock=threading.Condition(threading.Lock()))


@pytest.mark.parametrize("lock", [None, threading.Condition(), threading.Condition(threading.RLock())],
                         ids=["its own", "a Condition", "a Condition over an RLock"])
def test_a_reentrant_lock_is_taken_and_can_be_shared(lock):
    view = MembershipView(None, RunKeys("r"), node_id="n1", lock=lock)
    other = MembershipView(None, RunKeys("r"), node_id="n1", lock=view.lock)  # the closer's tracker shares it
    assert other.lock is view.lock and (lock is None or view.lock is lock)
    with view.lock, other.lock:
        pass


def test_the_mutex_is_the_lock_the_condition_is_made_over():
    """`with view.mutex` (the rounds' fast path) excludes `with view.lock`, and the Condition waits and is notified
    while its lock was taken through the mutex."""
    view = MembershipView(None, RunKeys("r"), node_id="n1")
    tracker = MembershipView(None, RunKeys("r"), node_id="n1", lock=view.lock)
    assert tracker.mutex is view.mutex and view.mutex is not view.lock
    taken = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with view.mutex:
            taken.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(10)
    assert not view.lock.acquire(timeout=0.05)  # held through the mutex by the other thread
    release.set()
    holder.join(10)
    woken = []

    def waiter() -> None:
        with view.mutex:
            woken.append(view.lock.wait(10))

    t = threading.Thread(target=waiter)
    with view.mutex:
        t.start()
        deadline = time.monotonic() + 10
        while not view.lock._waiters and time.monotonic() < deadline:  # noqa: SLF001 - the waiter is in wait()
            view.lock.wait(0.01)  # lets it take the lock and wait
        view.lock.notify_all()
    t.join(10)
    assert woken == [True]
