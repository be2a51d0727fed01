"""A node's first round against a real etcd: its membership view's first read goes in the same transaction as its
alive/ key (one request fewer per node: at 1,024 nodes, 1,024 fewer in the first round's burst), and the view it
starts from is the one a read of its own would have given."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rt.rendezvous.etcd_client import RangeRead
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from elastic_rt.rendezvous.view import MembershipView


def _state(view: MembershipView) -> tuple:
    with view.lock:
        return (view.current_round(), view.smallest_alive, sorted(view.alive), dict(view.finals), view.closed,
                sorted(view.waiting), view.run_lease)


def test_compare_and_put_then_read_reads_at_the_puts_revision_on_both_branches(etcd_client, run_id):
    c, keys = etcd_client, RunKeys(run_id)
    c.put(keys.alive("a"), b"a")
    read = RangeRead([(keys.alive_prefix, keys.alive("m").encode()), (keys.round, keys.round.encode() + b"\0")],
                     keys_only=frozenset({0}), first_only=frozenset({0}))
    ok, kv, ranges, revision = c.compare_and_put_then_read(keys.alive("m"), b"m", expected_mod_revision=None,
                                                           read=read)
    assert ok and kv.value == b"m" and kv.mod_revision == revision
    assert [[(x.key, x.value) for x in r] for r in ranges] == [[(keys.alive("a"), b"")], []]
    put_at = c.put(keys.round, b"0")
    ok, kv, ranges, revision2 = c.compare_and_put_then_read(keys.alive("m"), b"other", expected_mod_revision=None,
                                                            read=read)
    assert not ok and kv.value == b"m" and kv.mod_revision == revision  # refused: nothing written, the key as it is
    assert revision2 >= put_at  # read after the round's put (other tests' leases may move the revision too)
    assert [[(x.key, x.value) for x in r] for r in ranges] == [[(keys.alive("a"), b"")], [(keys.round, b"0")]]


@pytest.fixture
def handler(etcd_endpoint, run_id):
    h = create_etcd_v3_handler(RendezvousParameters("etcd-v3", etcd_endpoint, run_id, 2, 2, local_addr="127.0.0.1",
                                                    node_id="m"))
    yield h
    h.leave()
    h.close()


def test_the_views_first_read_goes_with_the_alive_key(handler, etcd_client, run_id, monkeypatch):
    c, keys = etcd_client, RunKeys(run_id)
    c.put(keys.alive("c"), b"{}")  # a smaller live node (the closer to be), a larger one, a round, a final
    c.put(keys.alive("x"), b"{}")
    c.put(keys.round, b"0")
    c.put(keys.final(0), b"{}")
    calls: list[str] = []
    for name in ("read_ranges", "compare_and_put", "compare_and_put_then_read"):
        real = getattr(handler._client, name)

        def wrapped(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(handler._client, name, wrapped)
    handler._start()
    assert calls == ["compare_and_put_then_read"], calls  # the alive key and the view's read: one transaction
    own = MembershipView(c, keys, node_id="m", alive_puts=False)  # a view that reads for itself
    own.start()
    try:
        assert _state(handler._view) == _state(own)
        assert _state(own)[:3] == (0, "c", ["c"])
    finally:
        own.stop()
    alive, _ = c.get(keys.alive("m"))
    assert alive is not None and alive.lease == handler._lease.lease_id
    with handler._view.lock:  # the watch goes on from the alive key's own revision
        assert handler._view.reloads == 1 and set(handler._view._revs) == {alive.mod_revision}


def test_a_read_of_other_ranges_than_the_views_is_not_taken_the_view_reads_itself(etcd_client, run_id, monkeypatch):
    c, keys = etcd_client, RunKeys(run_id)
    c.put(keys.alive("c"), b"{}")
    view = MembershipView(c, keys, node_id="m", alive_puts=False)
    spec = view.first_read()
    ranges, revision = c.read_ranges(spec.ranges, keys_only=spec.keys_only, first_only=spec.first_only)
    c.put(keys.waiting("w"), b"")  # after that read: only a read of the view's own finds it
    reads: list[RangeRead] = []
    real = c.read_ranges

    def read_ranges(rs, **k):
        reads.append(RangeRead(rs, k.get("keys_only", frozenset()), k.get("first_only", frozenset())))
        return real(rs, **k)

    monkeypatch.setattr(c, "read_ranges", read_ranges)
    stale = RangeRead(spec.ranges[:-1], spec.keys_only, spec.first_only)  # not what the view reads
    view.start((stale, ranges[:-1], revision))
    try:
        assert reads == [spec]  # start() read, itself, what first_read() says
        with view.lock:
            assert view.smallest_alive == "c" and "w" in view.waiting and view.reloads == 1
    finally:
        view.stop()
