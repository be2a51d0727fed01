"""When the smallest live node's lease lapses before a first round forms, every other node must find the next
smallest: that is the one fan-out left while views watch the smallest node only (view.py). It costs each node one
small read and one watch request on the stream it has: no new stream, no read of the view's other ranges.
Counted at a real etcd's own /metrics (a server of its own, so that no other test's traffic is counted), for nine
nodes, each view on a client of its own, as agents have."""

from __future__ import annotations

import threading
import time

import pytest

from etcd_testbed.server import EtcdCluster
from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.view import MembershipView
from tests.support.etcd_metrics import delta, grpc_counts

NODES = [f"n{i:02d}" for i in range(10)]


def _counts(member) -> dict[str, float]:
    """etcd's gRPC messages received by method, and the Watch streams it started."""
    counts = grpc_counts(member)
    return {**counts.received, "watch streams": counts.started.get("Watch", 0.0)}


@pytest.fixture
def cluster():
    with EtcdCluster(1) as c:
        yield c


def test_the_smallest_nodes_lapse_costs_each_node_one_read_and_one_watch_request(cluster, run_id):
    m = cluster.members[0]
    config = EtcdConfig(endpoints=((m.host, m.client_port),))
    writer = EtcdClient(config)
    clients: list[EtcdClient] = []
    views: list[MembershipView] = []
    keys = RunKeys(run_id)
    try:
        smallest_lease = writer.grant_lease(60)
        writer.put(keys.alive(NODES[0]), b"{}", lease=smallest_lease)
        for node in NODES[1:]:
            writer.put(keys.alive(node), b"{}")
        for node in NODES[1:]:
            clients.append(EtcdClient(config))
            views.append(MembershipView(clients[-1], keys, node_id=node, alive_puts=False))
            views[-1].start()
        for view in views:
            assert view.wait_for(lambda v=view: v.connected and v.smallest_alive == NODES[0], 10)
        streams = [v._stream for v in views]
        reloads = [v.reloads for v in views]
        before = _counts(m)

        writer.revoke_lease(smallest_lease)  # the smallest node's lease lapses

        for view in views[1:]:
            assert view.wait_for(lambda v=view: v.smallest_alive == NODES[1] and NODES[0] in v.departed, 10)
        assert views[0].wait_for(lambda: views[0].smallest_alive is None and NODES[0] in views[0].departed, 10)
        # each view has sent its new watcher's create (before it told its readers): wait until etcd counted them
        deadline = time.monotonic() + 10
        while delta(_counts(m), before).get("Watch", 0) < len(views) and time.monotonic() < deadline:
            time.sleep(0.05)
        spent = delta(_counts(m), before)

        assert spent.get("watch streams", 0) == 0, f"a view opened a new watch stream: {spent}"
        assert spent.get("Watch", 0) == len(views), f"one watch request per node: {spent}"
        assert spent.get("Txn", 0) + spent.get("Range", 0) == len(views), f"one read per node: {spent}"
        for view, stream, before_reloads in zip(views, streams, reloads):
            with view.lock:
                assert view._stream is stream and view.connected
                assert view.reloads == before_reloads + 1  # decide()'s J6: the smallest was found again

        # the new smallest is watched on the same streams: its lapse is the next event
        writer.delete(keys.alive(NODES[1]))
        for view in views[2:]:
            assert view.wait_for(lambda v=view: v.smallest_alive == NODES[2] and NODES[1] in v.departed, 10)
        assert views[1].wait_for(lambda: views[1].smallest_alive is None and NODES[1] in views[1].departed, 10)
        # a smaller node that registers later is found by refresh() (the closer learnt it from its join)
        writer.put(keys.alive("a0"), b"{}")
        views[3].refresh()
        assert views[3].wait_for(lambda: views[3].smallest_alive == "a0", 10)
        with views[3].lock:
            assert views[3]._stream is streams[3]
        writer.delete(keys.alive("a0"))
        assert views[3].wait_for(lambda: views[3].smallest_alive == NODES[2] and "a0" in views[3].departed, 10)
    finally:
        for view in views:
            view.stop()
        for client in clients + [writer]:
            client.close()


def _smallest_only_view(etcd_client, run_id: str, registered: tuple[str, ...]) -> tuple[MembershipView, RunKeys]:
    """Node m's view, watching the smallest of `registered` (alive/ keys put first) below m."""
    keys = RunKeys(run_id)
    for node in registered:
        etcd_client.put(keys.alive(node), b"{}")
    view = MembershipView(etcd_client, keys, node_id="m", alive_puts=False)
    view.start()
    assert view.wait_for(lambda: view.connected and view.smallest_alive is not None, 10)
    return view, keys


def test_a_failed_read_of_the_next_smallest_is_tried_again_on_the_same_stream(etcd_client, run_id, monkeypatch):
    view, keys = _smallest_only_view(etcd_client, run_id, ("a", "b", "m"))
    try:
        stream = view._stream
        read, failed = etcd_client.read_ranges, []

        def fails_once(*args, **kwargs):
            if not failed:
                failed.append(args)
                raise EtcdUnavailableError("etcd at test: no answer (injected once)")
            return read(*args, **kwargs)

        monkeypatch.setattr(etcd_client, "read_ranges", fails_once)
        etcd_client.delete(keys.alive("a"))
        assert view.wait_for(lambda: view.smallest_alive == "b" and "a" in view.departed, 10)
        assert len(failed) == 1
        with view.lock:
            assert view._stream is stream and view.connected
        etcd_client.delete(keys.alive("b"))  # and the node found after the retry is watched
        assert view.wait_for(lambda: view.smallest_alive is None and "b" in view.departed, 10)
    finally:
        view.stop()


def test_a_refresh_while_no_stream_is_open_reads_every_range_when_it_reopens(etcd_client, run_id, monkeypatch):
    view, keys = _smallest_only_view(etcd_client, run_id, ("c", "m"))
    try:
        open_watch, held = etcd_client.open_watch, threading.Event()

        def held_open(*args, **kwargs):  # the reopening waits until the refresh below was asked for
            assert held.wait(10)
            return open_watch(*args, **kwargs)

        monkeypatch.setattr(etcd_client, "open_watch", held_open)
        reloads = view.reloads
        view.reconnect()  # the stream ends; a thread reads nothing (no re-read wanted) and reopens it
        assert view.wait_for(lambda: view._stream is None, 10)
        etcd_client.put(keys.alive("b"), b"{}")
        view.refresh()
        held.set()
        assert view.wait_for(lambda: view.smallest_alive == "b", 10)  # the read notifies; the stream's opening does not
        assert view.reloads == reloads + 1  # one read of every range, at the reopening
    finally:
        view.stop()


def test_a_lapse_while_no_thread_can_start_keeps_the_stream_and_revive_finds_the_next_smallest(etcd_client, run_id,
                                                                                               monkeypatch):
    """The smallest node lapses while the process can start no thread (a thread limit): the open stream still works,
    so the view stays connected on it, and revive() (after a lease beat) finds the next smallest on that stream,
    never a second stream beside it."""
    import elastic_rt.rendezvous.view as view_module

    view, keys = _smallest_only_view(etcd_client, run_id, ("a", "b", "m"))
    try:
        stream = view._stream
        real = threading.Thread

        class NoThread(real):
            def start(self):
                raise RuntimeError("can't start new thread")

        monkeypatch.setattr(view_module.threading, "Thread", NoThread)
        etcd_client.delete(keys.alive("a"))
        assert view.wait_for(lambda: "a" in view.departed, 10)
        with view.lock:
            assert view.connected and view._stream is stream and view._stranded
        monkeypatch.setattr(view_module.threading, "Thread", real)
        view.revive()
        assert view.wait_for(lambda: view.smallest_alive == "b", 10)
        with view.lock:
            assert view.connected and view._stream is stream
        etcd_client.delete(keys.alive("b"))  # the node found is watched on that stream
        assert view.wait_for(lambda: view.smallest_alive is None and "b" in view.departed, 10)
    finally:
        view.stop()


def test_a_member_that_sees_rank_0_go_reads_nothing_until_the_next_round_names_the_next_smallest(cluster, run_id):
    """After a round formed, rank 0's lapse is an event at every member (it is the smallest), but a member with a
    member below it that it has not seen go reads nothing then: no round closes on it before the next one forms,
    and that round's final names the next smallest (its least member, alive at the final). At 1,024 nodes the
    read at every member made the re-form 1-2 s slower than when every member followed every alive/ change. With
    no round formed the read comes at the first lease beat after SMALLEST_READ_DELAY_S (revive())."""
    from elastic_rt.rendezvous.view import SMALLEST_READ_DELAY_S

    m = cluster.members[0]
    config = EtcdConfig(endpoints=((m.host, m.client_port),))
    writer = EtcdClient(config)
    clients: list[EtcdClient] = []
    views: dict[str, MembershipView] = {}
    keys = RunKeys(run_id)
    skew = [0.0]  # the views' clock runs ahead by this much (the read's delay, without waiting for it)
    try:
        leases = {node: writer.grant_lease(60) for node in NODES[:2]}
        for node in NODES:
            writer.put(keys.alive(node), b"{}", lease=leases.get(node, 0))
        for node in NODES[2:]:  # the members of rank 2 and above (ranks 0 and 1 follow every alive/ change)
            clients.append(EtcdClient(config))
            views[node] = MembershipView(clients[-1], keys, node_id=node, alive_puts=False,
                                         clock=lambda: time.monotonic() + skew[0])
            views[node].start()
        for view in views.values():
            assert view.wait_for(lambda v=view: v.connected and v.smallest_alive == NODES[0], 10)
        _, final = writer.compare_and_put(keys.final(0), b"{}", expected_mod_revision=None)
        for view in views.values():
            view.members_formed(tuple(NODES), final.mod_revision)
            assert view.wait_for(lambda v=view: v.connected, 10)
        streams = {node: v._stream for node, v in views.items()}
        reloads = {node: v.reloads for node, v in views.items()}
        before = _counts(m)

        writer.revoke_lease(leases[NODES[0]])  # rank 0 lapses
        for view in views.values():
            assert view.wait_for(lambda v=view: NODES[0] in v.departed, 10)
            view.revive()  # a lease beat before the delay: still nothing to read
        _, final = writer.compare_and_put(keys.final(1), b"{}", expected_mod_revision=None)  # the one Txn
        for view in views.values():  # round 1 forms without n00
            view.members_formed(tuple(NODES[1:]), final.mod_revision)
        for node, view in views.items():
            with view.lock:
                assert view.smallest_alive == NODES[1] and view.reloads == reloads[node], node
                assert view._stream is streams[node]
        spent = delta(_counts(m), before)
        assert spent.get("Txn", 0) == 1 and spent.get("Range", 0) == 0, f"a member read at rank 0's loss: {spent}"
        assert spent.get("watch streams", 0) == 0, spent

        # the next smallest, named by the final, is watched: its lapse comes (n02 follows every change now)
        writer.revoke_lease(leases[NODES[1]])
        for view in views.values():
            assert view.wait_for(lambda v=view: NODES[1] in v.departed, 10)
        with views[NODES[4]].lock:
            assert views[NODES[4]].smallest_alive == NODES[1]  # n03 (below n04) is alive: the read waits
        skew[0] += SMALLEST_READ_DELAY_S  # no round formed: the next lease beat after the delay reads
        views[NODES[4]].revive()
        assert views[NODES[4]].wait_for(lambda: views[NODES[4]].smallest_alive == NODES[2], 10)
        with views[NODES[4]].lock:
            assert views[NODES[4]].reloads == reloads[NODES[4]] + 1
        # a member whose view has nobody below it left alive reads at once (it may close the next round): n03 put
        # off its read at n01's lapse (n02 was alive); n02, its ring neighbour, goes too
        with views[NODES[3]].lock:
            assert views[NODES[3]].smallest_alive == NODES[1] and views[NODES[3]].reloads == reloads[NODES[3]]
        writer.delete(keys.alive(NODES[2]))
        assert views[NODES[3]].wait_for(lambda: views[NODES[3]].smallest_alive is None
                                        and NODES[2] in views[NODES[3]].departed, 10)
    finally:
        for view in views.values():
            view.stop()
        for client in clients + [writer]:
            client.close()


def _member_view(etcd_client, keys, node, members, clock):
    """`node`'s view, a member of a round of `members` (all registered first), formed at the final of round 0."""
    view = MembershipView(etcd_client, keys, node_id=node, alive_puts=False, clock=clock)
    view.start()
    assert view.wait_for(lambda: view.connected and view.smallest_alive == members[0], 10)
    _, final = etcd_client.compare_and_put(keys.final(0), b"{}", expected_mod_revision=None)
    view.members_formed(tuple(members), final.mod_revision)
    assert view.wait_for(lambda: view.connected, 10)
    return view


def test_the_read_waits_only_on_a_node_below_whose_deletion_the_view_would_see(etcd_client, run_id):
    """A member puts off finding the next smallest only while its ring neighbour below it is alive: members it does
    not watch (placeholders from the final) say nothing of who is alive, so with that neighbour gone it reads at once
    (it may be the closer now). The smallest that goes and comes back before a round forms is the smallest again,
    with nothing left to read."""
    from elastic_rt.rendezvous.view import SMALLEST_READ_DELAY_S

    keys = RunKeys(run_id)
    members = [f"n{i:02d}" for i in range(8)]
    for node in members:
        etcd_client.put(keys.alive(node), b"{}")
    skew = [0.0]
    view = _member_view(etcd_client, keys, "n05", members, lambda: time.monotonic() + skew[0])  # ring: n04..n06
    try:
        etcd_client.delete(keys.alive("n02"))  # not watched here: n02 stays alive in this view
        etcd_client.delete(keys.alive("n04"))  # the ring neighbour below: seen
        assert view.wait_for(lambda: "n04" in view.departed, 10)
        with view.lock:
            reloads = view.reloads
            assert "n02" in view.alive
        etcd_client.delete(keys.alive("n00"))  # the smallest: n01..n03 are placeholders only, so read now
        assert view.wait_for(lambda: view.smallest_alive == "n01" and "n00" in view.departed, 10)
        with view.lock:
            assert view.reloads == reloads + 1 and view._smallest_due is None

        etcd_client.put(keys.alive("n04"), b"{}")  # the neighbour below is back: the next loss of the smallest waits
        assert view.wait_for(lambda: "n04" in view.alive, 10)
        etcd_client.delete(keys.alive("n01"))
        assert view.wait_for(lambda: "n01" in view.departed, 10)
        with view.lock:
            assert view._smallest_due is not None and view.smallest_alive == "n01"
        etcd_client.put(keys.alive("n01"), b'{"incarnation": "2"}')  # back before any round formed
        assert view.wait_for(lambda: "n01" in view.alive and "n01" not in view.departed, 10)
        with view.lock:
            assert view.smallest_alive == "n01" and view._smallest_due is None
        skew[0] += SMALLEST_READ_DELAY_S
        view.revive()  # nothing put off: no read
        with view.lock:
            assert view.reloads == reloads + 1
    finally:
        view.stop()


def test_a_next_smallest_named_by_a_final_while_the_stream_reopens_is_what_the_new_stream_watches(
        etcd_client, run_id, monkeypatch):
    """members_formed() adopting the round's least member while a thread reopens the watch stream (the lock is not
    held while etcd answers the open): the stream opened for the old smallest's range is dropped and another opened,
    so the new smallest's deletion comes."""
    keys = RunKeys(run_id)
    members = [f"n{i:02d}" for i in range(8)]
    for node in members:
        etcd_client.put(keys.alive(node), b"{}")
    view = _member_view(etcd_client, keys, "n05", members, time.monotonic)
    try:
        etcd_client.delete(keys.alive("n00"))  # the next smallest is put off (n04, below n05, is alive)
        assert view.wait_for(lambda: "n00" in view.departed, 10)
        _, final = etcd_client.compare_and_put(keys.final(1), b"{}", expected_mod_revision=None)
        opened = []
        real_open = etcd_client.open_watch

        def open_watch(*args, **kwargs):
            if not opened:  # round 1 forms while this first reopening waits for etcd
                opened.append(args[0])
                view.members_formed(tuple(members[1:]), final.mod_revision)
            return real_open(*args, **kwargs)

        monkeypatch.setattr(etcd_client, "open_watch", open_watch)
        view.reconnect()
        assert view.wait_for(lambda: view.connected and view._stream is not None and opened, 10)
        with view.lock:
            assert view.smallest_alive == "n01"
        etcd_client.delete(keys.alive("n01"))  # watched by the stream that stayed open
        assert view.wait_for(lambda: "n01" in view.departed, 10)
    finally:
        view.stop()


def _watchers_settle(member, expected: int) -> float:
    """etcd's watcher gauge once it is `expected` (a cancel is answered after it was sent), or as it is at the
    deadline."""
    deadline = time.monotonic() + 10
    while (now := grpc_counts(member).watchers) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def test_a_member_holds_the_same_watchers_in_etcd_however_often_the_smallest_changes(cluster, run_id):
    """Each loss of the smallest node replaces a member's watcher of it: the old one is cancelled in etcd, not left
    idle there. Left idle, one piled up per loss at every member until its stream ended, and a node below them
    that registered again was an event at each. The watcher of one key's deletion that the first round replaces
    is cancelled at its one answer (that key's deletion)."""
    m = cluster.members[0]
    config = EtcdConfig(endpoints=((m.host, m.client_port),))
    writer, client = EtcdClient(config), EtcdClient(config)
    keys = RunKeys(run_id)
    members = [f"n{i:02d}" for i in range(8)]
    view = None
    try:
        for node in members:
            writer.put(keys.alive(node), b"{}")
        assert grpc_counts(m).watchers == 0
        view = _member_view(client, keys, "n05", members, time.monotonic)  # ring n04..n06: the reads are put off
        with view.lock:
            active, stream = len(view._ranges), view._stream
        assert stream.idle_watchers == 1  # the first round's: n00's deletion, dropped without a cancel
        assert _watchers_settle(m, active + 1) == active + 1

        for k in range(3):  # the smallest goes, and the next round forms without it, three times
            writer.delete(keys.alive(members[k]))
            assert view.wait_for(lambda k=k: members[k] in view.departed, 10)
            _, final = writer.compare_and_put(keys.final(k + 1), b"{}", expected_mod_revision=None)
            view.members_formed(tuple(members[k + 1:]), final.mod_revision)
            with view.lock:
                assert view.smallest_alive == members[k + 1] and view._stream is stream
            assert stream.idle_watchers == 0  # n00's deletion was its one answer: cancelled then
            assert _watchers_settle(m, active) == active, f"after losing {members[k]}"

        events = grpc_counts(m).events
        for node in members[:3]:  # the lost smallest nodes register again: one event each, at the one watcher
            writer.put(keys.alive(node), b"{}")
        sentinel = writer.put(keys.alive("n03"), b'{"again": 1}')  # seen by that watcher only, after the three
        assert view.wait_for(lambda: all(n in view.alive for n in members[:3])
                             and view.alive["n03"].mod_revision == sentinel, 10)
        # a stream sends in revision order: a stale watcher's events were sent before the sentinel's reached the view
        deadline = time.monotonic() + 10
        while grpc_counts(m).events - events < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert grpc_counts(m).events - events == 4
    finally:
        if view is not None:
            view.stop()
        writer.close()
        client.close()
