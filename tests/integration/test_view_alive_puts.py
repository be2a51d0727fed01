"""MembershipView against a real etcd: before its node is a member of a round it watches one alive/ key, the
smallest live node's if that id is below its own (the closer of a round is the smallest live node), for
deletion: a node that registers or leaves is not an event at every node (O(N) events per lapse at a first
meeting, each waking a node, was what made a meeting of 1,024 simulated nodes collapse). When a round forms,
members_formed() counts the members alive without reading alive/ and follows, from the final's revision on, on the
same stream, every change of the alive/ keys up to the smallest's and from its ring neighbour before it to the one
after it: a member's lapse is an event at its neighbours (and at every node for the smallest), not at every node."""

from __future__ import annotations

import time

import pytest

from elastic_rt.rendezvous.etcd_client import KeyValue
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.view import SMALLEST_READ_DELAY_S, MembershipView


_SKEW = [0.0]  # the view's clock runs ahead by this much (a delay passed without waiting for it)


@pytest.fixture
def view_and_keys(etcd_client, run_id):
    keys = RunKeys(run_id)
    for node in ("c", "e", "m", "x"):
        etcd_client.put(keys.alive(node), b"{}")
    _SKEW[0] = 0.0
    view = MembershipView(etcd_client, keys, node_id="m", alive_puts=False, clock=lambda: time.monotonic() + _SKEW[0])
    view.start()
    assert view.wait_for(lambda: view.connected, 10)
    yield view, keys
    view.stop()


def _settled(view, c, keys, value: bytes) -> None:
    """Every change made before this call has reached the view (a later event on the same stream has)."""
    c.put(keys.round, value)
    assert view.wait_for(lambda: view.round is not None and view.round.value == value, 10)


def test_smallest_only_until_a_round_forms_then_its_ring_and_the_smallest_without_a_read(etcd_client, view_and_keys,
                                                                            monkeypatch):
    view, keys = view_and_keys
    c = etcd_client
    with view.lock:  # the first read: the smallest id (it is below m), without its value
        assert set(view.alive) == {"c"} and view.smallest_alive == "c" and view.alive["c"].value == b""
        reloads = view.reloads

    # neither a registration nor the deletion of another node is an event here
    c.put(keys.alive("b"), b"{}")
    c.delete(keys.alive("e"))
    c.delete(keys.alive("x"))
    _settled(view, c, keys, b"0")
    with view.lock:
        assert set(view.alive) == {"c"} and not view.departed and view.reloads == reloads

    # the smallest node's deletion is: the view reads again and watches the next smallest (b came after the first read)
    c.delete(keys.alive("c"))
    assert view.wait_for(lambda: view.smallest_alive == "b" and "c" in view.departed, 10)
    with view.lock:
        assert set(view.alive) == {"b"} and view.reloads == reloads + 1
    c.delete(keys.alive("b"))  # the last node below m: none left, m would close a round
    assert view.wait_for(lambda: view.smallest_alive is None and "b" in view.departed, 10)
    c.put(keys.alive("b"), b"{}")  # b is back (and m, acting as closer, would learn it from b's join)
    view.refresh()
    assert view.wait_for(lambda: view.smallest_alive == "b", 10)

    c.put(keys.alive("p"), b"{}")
    c.delete(keys.alive("p"))  # p leaves before the round forms, and is back to join it
    c.put(keys.alive("p"), b"{}")
    c.put(keys.alive("q"), b"{}")
    c.put(keys.alive("s"), b"{}")
    c.put(keys.alive("ba"), b"{}")
    _, final = c.compare_and_put(keys.final(0), b"{}", expected_mod_revision=None)  # the round forms
    c.delete(keys.alive("p"))  # a ring neighbour gone after the final, before this node heard of the round
    c.delete(keys.alive("s"))  # and a member that is not one
    _settled(view, c, keys, b"1")

    reads, cancels = [], []
    monkeypatch.setattr(c, "read_ranges", lambda *a, **k: reads.append(a))  # members_formed() reads nothing
    with view.lock:
        stream = view._stream
    send = stream._send
    monkeypatch.setattr(stream, "_send", lambda request: cancels.append(request) or send(request))
    view.members_formed(("b", "ba", "m", "p", "q", "s"), final.mod_revision)  # m is rank 2 (0 and 1: every change)
    assert cancels == []  # the smallest node's watcher is dropped, not cancelled: two watch requests, the new ones
    with view.lock:
        assert {"b", "ba", "m", "p", "q", "s"} <= set(view.alive) and view.smallest_alive == "b"
        assert view.alive["q"].value == b""  # known alive from the final, never read
        assert view.connected
    # p's deletion, after the final, comes again from the ring's watcher (m's neighbours are ba and p)
    assert view.wait_for(lambda: "p" in view.departed and "p" not in view.alive, 10)
    # s's is not an event here: s is not m's neighbour
    _settled(view, c, keys, b"2")
    with view.lock:
        assert "s" in view.alive and "s" not in view.departed
    assert reads == []

    # the ring's keys, from ba to p: every change comes, on the same stream; outside it, none does
    endpoint = view.stream_endpoint
    c.put(keys.alive("d"), b'{"incarnation": "1"}')
    c.put(keys.alive("x"), b'{"incarnation": "1"}')
    c.put(keys.alive("p"), b'{"incarnation": "3"}')  # the neighbour that left registers again
    assert view.wait_for(lambda: "d" in view.alive and "p" in view.alive and "p" not in view.departed, 10)
    c.put(keys.alive("d"), b'{"incarnation": "2"}')
    assert view.wait_for(lambda: view.alive["d"].value == b'{"incarnation": "2"}', 10)
    with view.lock:
        assert "x" not in view.alive
        assert view.registrations([keys.alive("p"), keys.alive("q")], final.mod_revision) == {
            keys.alive("p"): view.alive["p"]}  # q is not followed: its value is read
    # a node smaller than the smallest registers: every member sees it (the smallest's watcher covers every key up
    # to it), and it is the smallest now; its deletion has the view find the next one
    c.put(keys.alive("a"), b"{}")
    assert view.wait_for(lambda: view.smallest_alive == "a", 10)
    monkeypatch.undo()
    c.delete(keys.alive("b"))
    assert view.wait_for(lambda: "b" in view.departed, 10)
    with view.lock:
        reloads = view.reloads
    c.delete(keys.alive("a"))
    # ba, a member below m, is alive as far as m's view knows: no round closes on m before the next forms, so the
    # read of the next smallest waits (members_formed() names it, or the first lease beat after the delay reads it)
    assert view.wait_for(lambda: "a" in view.departed, 10)
    view.revive()
    with view.lock:
        assert view.smallest_alive == "a" and view.reloads == reloads
    _SKEW[0] += SMALLEST_READ_DELAY_S
    view.revive()
    assert view.wait_for(lambda: view.smallest_alive == "ba", 10)  # read: ba is next
    assert view.stream_endpoint == endpoint
    # a later round, other neighbours: the ring's watcher is replaced (one cancel), a value it did not follow is
    # not answered any more
    with view.lock:
        stream = view._stream
        view.learn({keys.alive("q"): KeyValue(keys.alive("q"), b'{"incarnation": "q"}', 1, 1, 0)})
    cancels = []
    send = stream._send
    monkeypatch.setattr(stream, "_send", lambda request: cancels.append(request) or send(request))
    view.members_formed(("ba", "d", "m", "q"), final.mod_revision)
    assert len(cancels) == 1
    with view.lock:
        assert {"ba", "d", "m", "p", "q", "s"} <= set(view.alive) and view.alive["d"].value == b'{"incarnation": "2"}'
        assert view.registrations([keys.alive("d"), keys.alive("q")], final.mod_revision) == {
            keys.alive("d"): view.alive["d"]}
    c.delete(keys.alive("q"))
    assert view.wait_for(lambda: "q" in view.departed, 10)
    assert view.stream_endpoint == endpoint


def test_a_view_that_follows_puts_from_the_start_sees_registrations(etcd_client, run_id):
    keys = RunKeys(run_id)
    view = MembershipView(etcd_client, keys, node_id="m")
    view.start()
    try:
        etcd_client.put(keys.alive("b"), b"{}")
        assert view.wait_for(lambda: "b" in view.alive, 10)
    finally:
        view.stop()


@pytest.mark.parametrize("node, every", [("c", True), ("e", True), ("m", False)])
def test_rank_0_and_rank_1_follow_every_alive_change_the_others_their_ring(etcd_client, run_id, node, every):
    """Rank 0 closes the next round, rank 1 when rank 0 is the node lost: both follow every alive/ change."""
    keys = RunKeys(run_id)
    for n in ("c", "e", "m", "x", "z"):
        etcd_client.put(keys.alive(n), b"{}")
    view = MembershipView(etcd_client, keys, node_id=node, alive_puts=False)
    view.start()
    try:
        assert view.wait_for(lambda: view.connected, 10)
        _, final = etcd_client.compare_and_put(keys.final(0), b"{}", expected_mod_revision=None)
        view.members_formed(("c", "e", "m", "x", "z"), final.mod_revision)
        etcd_client.delete(keys.alive("z"))  # not a ring neighbour of m (m follows e to x)
        etcd_client.put(keys.round, b"1")
        assert view.wait_for(lambda: view.round is not None, 10)
        if every:  # z's delete comes on the watcher members_formed() added: etcd may send it after the round's put,
            assert view.wait_for(lambda: "z" in view.departed, 10)  # which an older watcher saw (it was catching up)
        with view.lock:
            assert view.alive_puts is every and ("z" in view.departed) is every
    finally:
        view.stop()
