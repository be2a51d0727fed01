"""MembershipView against a real etcd: before its node is a member of a round it watches only deletions
of alive/ keys (no O(N^2) events at a first meeting); when a round forms, members_formed() counts the
members alive without reading alive/ (O(N) keys per node) and follows every change from the final's
revision on, on the same stream."""

from __future__ import annotations

import pytest

from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.view import MembershipView


@pytest.fixture
def view_and_keys(etcd_client, run_id):
    keys = RunKeys(run_id)
    etcd_client.put(keys.alive("a"), b"{}")
    etcd_client.put(keys.alive("m"), b"{}")
    view = MembershipView(etcd_client, keys, node_id="m", alive_puts=False)
    view.start()
    assert view.wait_for(lambda: view.connected, 10)
    yield view, keys
    view.stop()


def test_deletes_only_until_a_round_forms_then_every_change_without_a_read(etcd_client, view_and_keys,
                                                                            monkeypatch):
    view, keys = view_and_keys
    c = etcd_client
    with view.lock:
        assert set(view.alive) == {"a", "m"} and view.smallest_alive == "a"

    # a registration after the snapshot is not an event; a deletion is, also of a node the view never saw
    c.put(keys.alive("b"), b"{}")
    c.put(keys.alive("z"), b"{}")
    c.delete(keys.alive("z"))
    c.delete(keys.alive("a"))
    c.put(keys.alive("d"), b"{}")
    c.delete(keys.alive("d"))  # d leaves before the round forms, and is back to join it
    c.put(keys.alive("d"), b"{}")
    c.put(keys.alive("e"), b"{}")
    _, final = c.compare_and_put(keys.final(0), b"{}", expected_mod_revision=None)  # the round forms
    c.delete(keys.alive("e"))  # a member gone after the final, before this node heard of the round
    c.put(keys.round, b"0")  # an event after all of the above: the view has applied them all
    assert view.wait_for(lambda: view.round is not None and "e" in view.departed, 10)
    with view.lock:
        assert set(view.alive) == {"m"} and view.smallest_alive == "m"
        assert {"a", "z", "d"} <= set(view.departed)

    reads = []
    monkeypatch.setattr(c, "read_ranges", lambda *a, **k: reads.append(a))  # members_formed() reads nothing
    view.members_formed(("b", "d", "e", "m"), final.mod_revision)
    with view.lock:
        assert set(view.alive) == {"b", "d", "m"} and view.smallest_alive == "b"
        assert view.alive["b"].value == b""  # known alive from the final, never read
        assert "d" not in view.departed and "e" in view.departed and "a" in view.departed
        assert view.connected
    assert reads == []

    # from now on every change comes, on the same stream
    endpoint = view.stream_endpoint
    c.put(keys.alive("c"), b'{"incarnation": "1"}')
    c.delete(keys.alive("b"))
    assert view.wait_for(lambda: "c" in view.alive and "b" not in view.alive and "b" in view.departed, 10)
    c.put(keys.alive("c"), b'{"incarnation": "2"}')
    assert view.wait_for(lambda: view.alive["c"].value == b'{"incarnation": "2"}', 10)
    c.put(keys.alive("e"), b'{"incarnation": "3"}')  # the member that left registers again
    assert view.wait_for(lambda: "e" in view.alive and "e" not in view.departed, 10)
    assert view.stream_endpoint == endpoint
    view.members_formed(("c", "e", "m"), final.mod_revision)  # a later round: the watch stays as it is
    with view.lock:
        assert set(view.alive) == {"c", "d", "e", "m"} and view.alive["c"].value == b'{"incarnation": "2"}'
    assert reads == [] and view.stream_endpoint == endpoint


def test_a_view_that_follows_puts_from_the_start_sees_registrations(etcd_client, run_id):
    keys = RunKeys(run_id)
    view = MembershipView(etcd_client, keys, node_id="m")
    view.start()
    try:
        etcd_client.put(keys.alive("b"), b"{}")
        assert view.wait_for(lambda: "b" in view.alive, 10)
    finally:
        view.stop()
