"""The closer's view of a round's joins against a real etcd: track_joins() takes the joins as read, and
follow_joins() (called before the closer waits) adds one watcher to the view's own stream from the read's next
revision, so etcd sends every later change at once (a watcher that started in the past would wait for etcd's sync
loop, up to 100 ms); no stream or thread of its own, and no watch request at all for a closer that closes the round
on the joins it read.
untrack_joins() drops it (late events of a dropped watcher never reach the next round's joins), and a read
revision etcd has compacted away by the time the watcher is added costs one read of the whole view."""

from __future__ import annotations

import subprocess

import pytest

from etcd_testbed.server import EtcdCluster, find_etcdctl
from elastic_rt.rendezvous.etcd_client import EtcdClient
from elastic_rt.rendezvous.etcd_endpoint import WatchStream
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.view import MembershipView


def _view(client, keys):
    client.put(keys.alive("m"), b"{}")
    view = MembershipView(client, keys, node_id="m", alive_puts=False)
    view.start()
    assert view.wait_for(lambda: view.connected, 10)
    return view


@pytest.fixture
def view_and_keys(etcd_client, run_id):
    keys = RunKeys(run_id)
    view = _view(etcd_client, keys)
    yield view, keys
    view.stop()


@pytest.fixture
def own_etcd():
    """An etcd of this test's own: its history gets compacted."""
    with EtcdCluster(1) as cluster:
        yield cluster


def _opened(view, c, keys, rnd: int) -> int:
    """Put `round` = rnd; the revision that opened it, once the view has it."""
    rev = c.put(keys.round, str(rnd).encode())
    assert view.wait_for(lambda: view.round is not None and view.round.mod_revision == rev, 10)
    return rev


def _joins(view, rnd: int):
    with view.lock:
        found = view.joins_of(rnd)
        return None if found is None else set(found)


def _track(view, c, keys, rnd: int) -> None:
    """What the closer does (rounds.py): read the round's joins, then track them from there, and wait for them."""
    (joins,), revision = c.read_ranges([keys.join_range(rnd)])
    view.track_joins(rnd, joins, revision)
    view.follow_joins()


def test_the_joins_as_read_then_every_change_at_once(etcd_client, view_and_keys, monkeypatch):
    view, keys = view_and_keys
    c = etcd_client
    _opened(view, c, keys, 0)
    c.put(keys.join(0, "a"), b"{}")
    c.put(keys.join(0, "b"), b"{}")
    assert _joins(view, 0) is None
    with view.lock:
        stream = view._stream
    starts = []
    add = stream.add
    monkeypatch.setattr(stream, "add", lambda i, r, start, **k: starts.append((r, start)) or add(i, r, start, **k))
    (joins,), revision = c.read_ranges([keys.join_range(0)])
    view.track_joins(0, joins, revision)
    with view.lock:  # no waiting for the stream: the read's joins are there
        assert set(view.joins_of(0)) == {"a", "b"}
    assert starts == []  # no watcher until the closer waits for the joins to change
    view.follow_joins()
    view.follow_joins()
    # the watcher starts after the read, not in the past (etcd syncs a watcher that starts in the past every
    # 100 ms; one that starts at the next revision gets each write as it happens); once
    assert starts == [(keys.join_range(0), revision + 1)]
    reads = []
    monkeypatch.setattr(c, "read_ranges", lambda *a, **k: reads.append(a) or pytest.fail("the view read"))
    c.put(keys.join(0, "m"), b"{}")
    c.delete(keys.join(0, "a"))
    c.put(keys.join(1, "early"), b"{}")  # another round's joins are not this range's
    assert view.wait_for(lambda: set(view.joins_of(0)) == {"b", "m"}, 10)
    assert not reads
    monkeypatch.undo()
    with view.lock:
        assert view.joins_of(1) is None and 1 not in view.joins

    view.untrack_joins()
    assert _joins(view, 0) is None
    _opened(view, c, keys, 1)
    c.delete(keys.join(0, "b"))  # the dropped watcher's range: nothing of it may reach round 1's joins
    _track(view, c, keys, 1)
    c.put(keys.join(1, "x"), b"{}")
    assert view.wait_for(lambda: set(view.joins_of(1)) == {"early", "x"}, 10)  # "early": the read found it
    c.put(keys.join(0, "late"), b"{}")
    _opened(view, c, keys, 1)  # a later event on the same stream: everything before it has arrived
    with view.lock:
        assert set(view.joins_of(1)) == {"early", "x"} and set(view.joins) == {1}, view.joins


def test_a_read_revision_compacted_before_the_watcher_starts_costs_one_read_of_the_view(own_etcd, run_id):
    c = EtcdClient(own_etcd.client_config())
    keys = RunKeys(run_id)
    view = _view(c, keys)
    try:
        _compacted_then_tracked(own_etcd, c, view, keys)
    finally:
        view.stop()
        c.close()


def _compacted_then_tracked(etcd_server, c, view, keys) -> None:
    _opened(view, c, keys, 0)
    c.put(keys.join(0, "a"), b"{}")
    (joins,), revision = c.read_ranges([keys.join_range(0)])
    c.put(keys.join(0, "b"), b"{}")
    now = c.put(keys.join(0, "c"), b"{}")
    c.delete(keys.join(0, "c"))
    etcdctl = find_etcdctl(etcd_server.binary)
    subprocess.run([etcdctl, "--endpoints", etcd_server.endpoints, "compact", str(now)], check=True,
                   capture_output=True, timeout=30)
    with view.lock:
        reloads = view.reloads
    view.track_joins(0, joins, revision)
    view.follow_joins()
    assert view.wait_for(lambda: view.reloads > reloads and set(view.joins_of(0)) == {"a", "b"}, 10)
    c.put(keys.join(0, "d"), b"{}")
    assert view.wait_for(lambda: set(view.joins_of(0)) == {"a", "b", "d"}, 10)


def test_a_closer_that_closes_on_the_joins_it_read_sends_no_watch_request(etcd_client, view_and_keys, monkeypatch):
    view, keys = view_and_keys
    c = etcd_client
    _opened(view, c, keys, 0)
    c.put(keys.join(0, "m"), b"{}")
    with view.lock:
        stream = view._stream
    sent = []
    monkeypatch.setattr(stream, "add", lambda *a, **k: sent.append(("add", a)))
    monkeypatch.setattr(stream, "_send", lambda request: sent.append(("send", request)))
    (joins,), revision = c.read_ranges([keys.join_range(0)])
    view.track_joins(0, joins, revision)
    with view.lock:
        assert set(view.joins_of(0)) == {"m"}
    view.untrack_joins()
    assert _joins(view, 0) is None and sent == []
    monkeypatch.undo()
    # the view goes on as before: tracked and followed again, it sees a later join
    _track(view, c, keys, 0)
    c.put(keys.join(0, "n"), b"{}")
    assert view.wait_for(lambda: set(view.joins_of(0) or ()) == {"m", "n"}, 10)


def test_joins_tracked_while_the_stream_opens_leave_the_view_connected(etcd_client, run_id, monkeypatch):
    """The closer tracks the joins it read (no watcher) after the view's stream sent its creates and before etcd
    answered them: the view is connected once the creates it opened with are answered (not one per range it holds
    by then, which would leave it disconnected, and the agent deaf to etcd, for good)."""
    c, keys = etcd_client, RunKeys(run_id)
    c.put(keys.alive("m"), b"{}")
    view = MembershipView(c, keys, node_id="m", alive_puts=False)
    real_init = WatchStream.__init__
    tracked = []

    def opened(stream, *a, **k):  # the creates are sent; their answers may be on their way already
        real_init(stream, *a, **k)
        if not tracked:
            tracked.append(1)
            view.track_joins(0, [], 1)

    monkeypatch.setattr(WatchStream, "__init__", opened)
    view.start()
    try:
        assert view.wait_for(lambda: view.connected, 10)
        with view.lock:
            assert view.joins_of(0) == {}
    finally:
        view.stop()


def test_joins_untracked_before_etcd_answered_their_create_leave_the_view_connected(etcd_client, run_id, monkeypatch):
    """A stream opened while the view tracks joins creates their watcher too; the round ends (untrack) before etcd
    answered that create: the answer still counts towards the creates the stream opened with."""
    c, keys = etcd_client, RunKeys(run_id)
    c.put(keys.alive("m"), b"{}")
    view = MembershipView(c, keys, node_id="m", alive_puts=False)
    view.track_joins(0, [], 1)  # tracked before the stream opens: its range is one of the stream's creates
    real_init = WatchStream.__init__
    done = []

    def opened(stream, *a, **k):  # the creates are sent; their answers may be on their way already
        real_init(stream, *a, **k)
        if not done:
            done.append(1)
            view.untrack_joins()

    monkeypatch.setattr(WatchStream, "__init__", opened)
    view.start()
    try:
        assert view.wait_for(lambda: view.connected, 10)
    finally:
        view.stop()
