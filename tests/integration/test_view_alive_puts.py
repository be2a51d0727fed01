"""MembershipView against a real etcd: before its node is a member of a round it watches only deletions
of alive/ keys (no O(N^2) events at a first meeting); follow_alive_puts() reads alive/ once and follows
every change from then on, on the same stream."""

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


def test_deletes_only_until_it_follows_puts(etcd_client, view_and_keys):
    view, keys = view_and_keys
    c = etcd_client
    with view.lock:
        assert set(view.alive) == {"a", "m"} and view.smallest_alive == "a"

    # a registration after the snapshot is not an event; a deletion is, also of a node the view never saw
    c.put(keys.alive("b"), b"{}")
    c.put(keys.alive("z"), b"{}")
    c.delete(keys.alive("z"))
    c.delete(keys.alive("a"))
    assert view.wait_for(lambda: "a" not in view.alive and "z" in view.departed, 10)
    c.put(keys.round, b"0")  # an event after all of the above: the view has applied them all
    assert view.wait_for(lambda: view.round is not None, 10)
    with view.lock:
        assert set(view.alive) == {"m"} and view.smallest_alive == "m" and "a" in view.departed

    assert view.follow_alive_puts(10)
    with view.lock:
        assert set(view.alive) == {"b", "m"} and view.smallest_alive == "b"
        assert view.connected

    # from now on every change comes, on the same stream
    endpoint = view.stream_endpoint
    c.put(keys.alive("c"), b'{"incarnation": "1"}')
    c.delete(keys.alive("b"))
    assert view.wait_for(lambda: "c" in view.alive and "b" not in view.alive, 10)
    c.put(keys.alive("c"), b'{"incarnation": "2"}')
    assert view.wait_for(lambda: view.alive["c"].value == b'{"incarnation": "2"}', 10)
    assert view.stream_endpoint == endpoint
    assert view.follow_alive_puts(1)  # once is enough: a second call changes nothing


def test_a_view_that_follows_puts_from_the_start_sees_registrations(etcd_client, run_id):
    keys = RunKeys(run_id)
    view = MembershipView(etcd_client, keys, node_id="m")
    view.start()
    try:
        etcd_client.put(keys.alive("b"), b"{}")
        assert view.wait_for(lambda: "b" in view.alive, 10)
    finally:
        view.stop()
