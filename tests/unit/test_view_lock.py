"""A membership view's lock must be re-entrant: closing its stream under the lock (refresh() -> _read_again()) can
deliver the stream's end (_on_watch_end) on the same thread, which takes the lock again. A view given a lock that is
not re-entrant would hang there the first time; it is refused when the view is made."""

from __future__ import annotations

import threading

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
