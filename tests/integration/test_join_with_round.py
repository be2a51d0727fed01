"""A node's join against a real etcd: the node that opens a round (creates `round`, or advances it) puts its join of
that round in the same transaction, and a node that expects to close the round reads the round's joins there too,
adding a watcher for them only when it has to wait for more: a one-node job's restart is two requests (open and join,
then the final) where it was four, and no watch request. A node that loses the race to open a round joins the round
the winner opened in the same transaction (where it has no final and the run is not closed), and writes nothing
else."""

from __future__ import annotations

import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rt.rendezvous.etcd_client import GuardedPut, IfHeld, Put, RangeRead
from elastic_rt.rendezvous.etcd_endpoint import WatchStream
from elastic_rt.rendezvous import rounds
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from tests.support.rendezvous import count_requests, together

_REQUESTS = ("get", "put", "delete", "read_many", "read_ranges", "put_then_read", "compare_and_put",
             "compare_and_put_then_read", "compare_and_put_else", "create_with", "grant_lease", "delete_ranges")


def _handler(endpoint: str, run_id: str, node: str, nnodes: tuple[int, int]):
    return create_etcd_v3_handler(RendezvousParameters("etcd-v3", endpoint, run_id, *nnodes, local_addr="127.0.0.1",
                                                       node_id=node))


def _count(monkeypatch, handler) -> list[str]:
    """The etcd requests the handler's client makes (outermost only)."""
    return count_requests(monkeypatch, handler._client, _REQUESTS)


def test_a_failed_compare_puts_none_of_the_keys_that_go_with_it(etcd_client, run_id):
    c, keys = etcd_client, RunKeys(run_id)
    c.put(keys.round, b"0")
    join = Put(keys.join(1, "m"), b"{}")
    ok, kv, ranges, _, _ = c.compare_and_put_then_read(keys.round, b"1", expected_mod_revision=None, also=(join,),
                                                    read=RangeRead([keys.join_range(1)]))
    assert not ok and kv.value == b"0" and ranges == [[]]
    assert c.get(keys.join(1, "m"))[0] is None
    ok, kv, ranges, revision, _ = c.compare_and_put_then_read(keys.round, b"1", expected_mod_revision=kv.mod_revision,
                                                           also=(join,), read=RangeRead([keys.join_range(1)]))
    assert ok and kv.value == b"1" and kv.mod_revision == revision
    assert [(x.key, x.mod_revision) for x in ranges[0]] == [(keys.join(1, "m"), revision)]  # read after the puts


def _history(c, keys: RunKeys, rounds: range) -> None:
    for rnd in rounds:  # a round's key, a join and a worker store key each
        c.put(keys.final(rnd), b"{}")
        c.put(keys.join(rnd, "m"), b"{}")
        c.put(keys.round_store(rnd) + "k", b"v")


def _left(c, keys: RunKeys) -> list[str]:
    return sorted(kv.key[len(keys.base):] for p in (keys.rounds_prefix, keys.joins_prefix, keys.stores_prefix)
                  for kv in c.read_many([], [p])[1][0])


@pytest.mark.parametrize("how", ["compare_and_put", "create_with"])
def test_a_finals_write_deletes_the_rounds_before_the_previous_only_when_it_puts(etcd_client, run_id, how):
    """The deletion of history that rides with rank 0's final (keys.history): made in the put's revision, only when
    the final is put, and never of `round`, the previous round or the new one."""
    c, keys = etcd_client, RunKeys(run_id)
    c.put(keys.round, b"3")
    _history(c, keys, range(3))
    final = keys.final(3)

    def write():
        if how == "compare_and_put":
            return c.compare_and_put(final, b"final", expected_mod_revision=None, deletes=keys.history(2))
        claim = GuardedPut(Put(keys.run_lease, b"1"), expected_mod_revision=None)
        ok, kv, outcome = c.create_with(final, b"final", claim, deletes=keys.history(2))
        assert (outcome is not None and outcome[0] and outcome[1].mod_revision == kv.mod_revision) == ok  # with it
        return ok, kv

    c.put(final, b"another node's")
    before = _left(c, keys)
    ok, kv = write()
    assert not ok and kv.value == b"another node's"
    assert _left(c, keys) == before  # a final not put deletes nothing
    c.delete(final)
    ok, kv = write()
    assert ok and kv.value == b"final"
    assert _left(c, keys) == ["joins/0000000002/m", "rounds/0000000002/final", "rounds/0000000003/final",
                              "stores/0000000002/k"]
    assert c.get(keys.round)[0].value == b"3"
    assert kv.mod_revision == c.read_many([], [keys.rounds_prefix])[2]  # the last write: one request, one revision


def test_a_failed_compare_makes_the_otherwise_puts_only_while_its_condition_holds(etcd_client, run_id):
    """The failure branch's nested transaction: the join of round 1 is put (and read) only while `round` holds 1,
    round 1 has no final and the run is not closed; a compare that succeeds makes only its own puts."""
    c, keys = etcd_client, RunKeys(run_id)
    join = Put(keys.join(1, "m"), b"{}")
    otherwise = IfHeld(keys.round, b"1", (keys.final(1), keys.closed), (join,))

    def open_1():  # as a node that saw round 0 (now gone or moved on) opens round 1
        return c.compare_and_put_else(keys.round, b"1", expected_mod_revision=None, also=(join,), otherwise=otherwise,
                                      read=RangeRead([keys.join_range(1)]))

    c.put(keys.round, b"2")  # moved past 1: nothing is put
    assert open_1()[:2] == (False, False) and c.get(keys.join(1, "m"))[0] is None
    c.put(keys.round, b"1")
    c.put(keys.final(1), b"{}")  # round 1 is closed
    assert open_1()[:2] == (False, False) and c.get(keys.join(1, "m"))[0] is None
    c.delete(keys.final(1))
    c.put(keys.closed, b"")  # the run is
    assert open_1()[:2] == (False, False) and c.get(keys.join(1, "m"))[0] is None
    c.delete(keys.closed)
    ok, made, kv, ranges, revision = open_1()  # another node opened round 1: this one joins it
    assert (ok, made, kv.value) == (False, True, b"1")
    assert [(x.key, x.mod_revision) for x in ranges[0]] == [(keys.join(1, "m"), revision)]  # read after the put
    c.delete(keys.round)
    c.delete(keys.join(1, "m"))
    ok, made, kv, ranges, revision = open_1()  # no `round`: this node creates it, with its join
    assert (ok, made, kv.value, kv.mod_revision) == (True, False, b"1", revision)
    assert [x.key for x in ranges[0]] == [keys.join(1, "m")]


def test_a_node_that_loses_the_race_to_open_a_round_joins_it_in_the_same_request(etcd_endpoint, etcd_client, run_id,
                                                                                   monkeypatch):
    """Node m (a one-node job) was the member of round 0; another node opened round 1 before m's view delivered it.
    m's open of round 1 loses the compare and puts its join of round 1 in the same transaction: the round forms with
    it after one request and the final, where m used to try the open again until its view delivered the round, then
    join with a request of its own."""
    from elastic_rt.rendezvous.view import MembershipView

    keys = RunKeys(run_id)
    h = _handler(etcd_endpoint, run_id, "m", (1, 1))
    try:
        assert h.next_rendezvous().rank == 0 and h.membership.round == 0
        view, real, held = h._view, MembershipView._on_watch, []

        def late(self, gen, index, events, created):  # the round's event reaches m's view 1 s late, lock not held
            if self is view and not held and any(ev.kv.key == keys.round for ev in events):
                held.append(threading.Timer(1.0, real, (self, gen, index, events, created)))
                held[0].start()
                return None
            return real(self, gen, index, events, created)

        monkeypatch.setattr(MembershipView, "_on_watch", late)
        round0, _ = etcd_client.get(keys.round)
        assert etcd_client.compare_and_put(keys.round, b"1", expected_mod_revision=round0.mod_revision)[0]
        deadline = time.monotonic() + 10  # the other node's open has come to m's connection, and was held
        while not held:
            assert time.monotonic() < deadline, "m's view never received round 1"
            time.sleep(0.01)
        calls = _count(monkeypatch, h)
        info = h.next_rendezvous()
        assert info.rank == 0 and h.membership.round == 1
        assert calls == ["compare_and_put_else", "compare_and_put"], calls  # the lost open with the join; the final
        join, _ = etcd_client.get(keys.join(1, "m"))
        assert join is not None and join.lease == h._lease.lease_id
    finally:
        h.leave()
        h.close()


def test_put_then_read_reads_at_the_puts_revision(etcd_client, run_id):
    c, keys = etcd_client, RunKeys(run_id)
    c.put(keys.join(0, "a"), b"a")
    (joins,), revision = c.put_then_read(Put(keys.join(0, "m"), b"m"), RangeRead([keys.join_range(0)]))
    assert [(x.key, x.value) for x in joins] == [(keys.join(0, "a"), b"a"), (keys.join(0, "m"), b"m")]
    assert c.get(keys.join(0, "m"))[0].mod_revision == revision


def test_a_one_node_jobs_restart_is_two_requests_and_no_watch(etcd_endpoint, etcd_client, run_id, monkeypatch):
    keys = RunKeys(run_id)
    h = _handler(etcd_endpoint, run_id, "m", (1, 1))
    try:
        calls = _count(monkeypatch, h)
        first = h.next_rendezvous()
        assert first.rank == 0 and first.world_size == 1
        # the lease; the alive key with round 0 created, its join put and read (the run had no round), and the
        # view's read; the run's lease granted; the final with the run lease's key
        assert calls == ["grant_lease", "compare_and_put_then_read", "grant_lease", "create_with"], calls
        alive, _ = etcd_client.get(keys.alive("m"))
        join, _ = etcd_client.get(keys.join(0, "m"))
        rnd, _ = etcd_client.get(keys.round)
        assert rnd.value == b"0" and rnd.mod_revision == join.mod_revision == alive.mod_revision  # one transaction
        assert join.lease == alive.lease == h._lease.lease_id
        lease_key, _ = etcd_client.get(keys.run_lease)
        final, _ = etcd_client.get(keys.final(0))
        assert lease_key is not None and lease_key.mod_revision == final.mod_revision  # one transaction
        assert lease_key.lease == h._run_lease.lease_id > 0
        deadline = time.monotonic() + 10  # the agent can tell etcd answers (its view is connected)
        while not h.etcd_reachable():
            assert time.monotonic() < deadline, "the handler never found etcd reachable after its first round"
            time.sleep(0.01)
        calls.clear()
        added: list[tuple] = []
        add = WatchStream.add
        monkeypatch.setattr(WatchStream, "add", lambda self, i, r, *a, **k: added.append(r) or add(self, i, r, *a, **k))
        second = h.next_rendezvous()
        assert second.rank == 0 and second.world_size == 1
        assert calls == ["compare_and_put_else", "compare_and_put"], calls  # open and join; the final
        assert added == []  # the round closed on the joins read with the join: no watcher of them
        assert h.membership.round == 1
        join, _ = etcd_client.get(keys.join(1, "m"))
        assert join is not None and join.lease == h._lease.lease_id
        final, _ = etcd_client.get(keys.final(1))
        assert final is not None and final.mod_revision > join.mod_revision
        calls.clear()
        third = h.next_rendezvous()
        assert third.rank == 0 and h.membership.round == 2
        # open and join; the final, with rank 0's deletion of round 0 (no third request)
        assert calls == ["compare_and_put_else", "compare_and_put"], calls
        assert etcd_client.get(keys.final(0))[0] is None and etcd_client.get(keys.join(0, "m"))[0] is None
        assert etcd_client.get(keys.final(1))[0] is not None and etcd_client.get(keys.join(1, "m"))[0] is not None
        assert etcd_client.get(keys.final(2))[0] is not None
    finally:
        h.leave()
        h.close()


def test_a_large_rounds_rank_0_deletes_the_rounds_before_the_previous_after_the_round(etcd_endpoint, etcd_client,
                                                                                       run_id, monkeypatch):
    """Above HISTORY_WITH_FINAL_MAX_NODES members the final carries no deletion (it is O(keys) in every member's apply
    loop): rank 0 deletes those rounds in a request of its own once the round formed. A one-node job with the bound
    set to 0 stands for a large round."""
    monkeypatch.setattr(rounds, "HISTORY_WITH_FINAL_MAX_NODES", 0)
    keys = RunKeys(run_id)
    h = _handler(etcd_endpoint, run_id, "m", (1, 1))
    try:
        h.next_rendezvous()
        h.next_rendezvous()
        calls = _count(monkeypatch, h)
        h.next_rendezvous()
        assert h.membership.round == 2
        assert calls == ["compare_and_put_else", "compare_and_put", "delete_ranges"], calls
        assert etcd_client.get(keys.final(0))[0] is None and etcd_client.get(keys.join(0, "m"))[0] is None
        assert etcd_client.get(keys.final(1))[0] is not None and etcd_client.get(keys.join(1, "m"))[0] is not None
    finally:
        h.leave()
        h.close()


@pytest.mark.parametrize("restart", [False, True], ids=["first meeting", "re-formation"])
def test_a_closer_that_must_wait_for_more_joins_follows_them(etcd_endpoint, etcd_client, run_id, monkeypatch,
                                                              restart):
    """Three nodes of --nnodes 3: the closer ("a", the smallest id) joins alone first and reads only its own join, so
    it adds the joins' watcher (once) before it waits; the others join, and the round forms with every node."""
    keys = RunKeys(run_id)
    hs = [_handler(etcd_endpoint, run_id, n, (3, 3)) for n in ("a", "b", "c")]
    try:
        rnd = 0
        if restart:
            together(hs)
            rnd = hs[0].membership.round + 1
        calls = _count(monkeypatch, hs[0])
        added: list[tuple] = []
        add = WatchStream.add
        monkeypatch.setattr(WatchStream, "add", lambda self, i, r, *a, **k: added.append(r) or add(self, i, r, *a, **k))
        first = threading.Thread(target=lambda: out.update(a=hs[0].next_rendezvous()), daemon=True)
        out: dict = {}
        first.start()
        deadline = time.monotonic() + 30
        while etcd_client.get(keys.join(rnd, "a"))[0] is None:
            assert time.monotonic() < deadline and first.is_alive(), "node a never joined"
            time.sleep(0.01)
        out.update(together(hs[1:]))
        first.join(30)
        assert not first.is_alive()
        assert [out[n].rank for n in ("a", "b", "c")] == [0, 1, 2] and {i.world_size for i in out.values()} == {3}
        assert {h.membership.round for h in hs} == {rnd}
        assert added.count(keys.join_range(rnd)) == 1, added  # a's watcher of the joins, added before it waited
        assert calls.count("read_ranges") == 0, calls  # its joins came with its join: no read of its own
    finally:
        for h in hs:
            h.leave()
            h.close()


def test_a_node_whose_view_lags_its_own_final_opens_the_next_round_not_its_own_again(etcd_endpoint, run_id):
    """next_rendezvous() at once after a round formed, before the view delivered that round's final (the node
    wrote it; here the view is made to lag by dropping it): the node must open round 1, not join round 0 again and
    come back with the round it left."""
    h = _handler(etcd_endpoint, run_id, "m", (1, 1))
    try:
        assert h.next_rendezvous().rank == 0 and h.membership.round == 0
        with h._view.lock:
            h._view.finals.clear()
        h.next_rendezvous()
        assert h.membership.round == 1
    finally:
        h.leave()
        h.close()


def test_a_node_whose_view_lags_its_own_opening_keeps_its_join(etcd_endpoint, run_id, monkeypatch):
    """The view delivers the round this node opened 1.5 s late (past the open's 1 s wait): the node waits for it with
    its join in place (J4a), rather than take the round for one that moved on, delete its join and join again."""
    from elastic_rt.rendezvous.view import MembershipView

    keys = RunKeys(run_id)
    h = _handler(etcd_endpoint, run_id, "m", (1, 1))
    try:
        assert h.next_rendezvous().rank == 0
        view, real_apply, lagged = h._view, MembershipView._apply, []

        def slow_apply(self, index, events):
            if self is view and not lagged and any(ev.kv.key == keys.round for ev in events):
                lagged.append(1)
                time.sleep(1.5)
            return real_apply(self, index, events)

        monkeypatch.setattr(MembershipView, "_apply", slow_apply)
        calls = _count(monkeypatch, h)
        h.next_rendezvous()
        assert lagged and h.membership.round == 1
        assert calls == ["compare_and_put_else", "compare_and_put"], calls  # no delete, no second join
    finally:
        h.leave()
        h.close()


def _held_after_registering(monkeypatch, h, gate: threading.Event) -> threading.Event:
    """Hold h's next_rendezvous() between its registration (lease, alive key, the view's first read) and its
    round: the returned event is set once it registered; the round goes on when `gate` is set."""
    registered, real = threading.Event(), h._rounds.next_round

    def held(previous, deadline):
        registered.set()
        assert gate.wait(60), "never released"
        return real(previous, deadline)

    monkeypatch.setattr(h._rounds, "next_round", held)
    return registered


def _register_in_order(monkeypatch, hs, gate: threading.Event) -> tuple[list[threading.Thread], dict]:
    """Start each handler's next_rendezvous() once the one before it registered, so that every node's view has
    read every smaller node; each stops before its round until `gate` is set. node id -> its RendezvousInfo, or the
    exception it raised."""
    out: dict = {}
    threads = []

    def go(h):
        try:
            out[h.settings.node_id] = h.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported in `out`
            out[h.settings.node_id] = exc

    for h in hs:
        registered = _held_after_registering(monkeypatch, h, gate)
        t = threading.Thread(target=go, args=(h,), daemon=True)
        t.start()
        assert registered.wait(30), f"{h.settings.node_id} never registered"
        threads.append(t)
    return threads, out


def test_a_smallest_node_that_hangs_before_its_first_round_does_not_hold_the_others(etcd_endpoint, etcd_client,
                                                                                  run_id, monkeypatch):
    """The smallest node registered and hangs (alive, its lease beating, its round never run): it would close the
    round (J6), so the others close it without it once it has been closable for fallback_s (J11). The run is in round
    1 before it registers (a registration opens round 0, or joins it where it is open, in its own request)."""
    etcd_client.put(RunKeys(run_id).round, b"1")
    hs = [create_etcd_v3_handler(RendezvousParameters("etcd-v3", etcd_endpoint, run_id, 2, 3, local_addr="127.0.0.1",
                                                      node_id=n, last_call_timeout=1)) for n in ("a", "b", "c")]
    gate, held_a = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []
    try:
        threads, _ = _register_in_order(monkeypatch, hs[:1], held_a)
        rest, out = _register_in_order(monkeypatch, hs[1:], gate)
        t0 = time.monotonic()
        gate.set()
        for t in rest:
            t.join(60)
        assert sorted(out) == ["b", "c"] and [out[n].rank for n in "bc"] == [0, 1], out
        fallback_s = max(2.0, hs[1].settings.last_call_timeout_s)
        print(f"formed without the hung node in {time.monotonic() - t0:.1f} s (fallback_s {fallback_s:g})")
    finally:
        gate.set()
        for h in hs:
            h.leave()
            h.close()
        held_a.set()
        for t in threads:
            t.join(30)
