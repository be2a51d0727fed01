"""The members' registrations a node needs with a round (its ring neighbours' and rank 0's alive/ keys, the run lease's
key), against a real etcd: read once, then answered by the membership view, which follows every alive/ change of a
member; what the view lacks or may hold behind etcd is read."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rt.rendezvous.etcd_client import KeyValue
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.liveness import ring_neighbours
from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from tests.support.rendezvous import together


def _handler(endpoint, run_id, node, n):
    return create_etcd_v3_handler(RendezvousParameters("etcd-v3", endpoint, run_id, n, n, local_addr="127.0.0.1",
                                                       node_id=node, last_call_timeout=2))


def _recorded_reads(handlers, monkeypatch):
    """Every read_many() each handler's client makes from now on: node -> list of key lists."""
    reads: dict[str, list[list[str]]] = {h.settings.node_id: [] for h in handlers}
    for h in handlers:
        real = h._client.read_many

        def read_many(keys, prefixes, *a, _real=real, _node=h.settings.node_id, **k):
            reads[_node].append(list(keys))
            return _real(keys, prefixes, *a, **k)

        monkeypatch.setattr(h._client, "read_many", read_many)
    return reads


@pytest.fixture
def three(etcd_endpoint, run_id):
    hs = [_handler(etcd_endpoint, run_id, n, 3) for n in "abc"]
    yield hs
    for h in hs:
        h.leave()
        h.close()


def test_a_restart_round_reads_no_registration_the_view_holds(three, etcd_client, run_id, monkeypatch):
    keys = RunKeys(run_id)
    reads = _recorded_reads(three, monkeypatch)
    together(three)  # the first round: the members' keys are read once
    assert all(any(keys.run_lease in r or any(k.startswith(keys.alive_prefix) for k in r) for r in reads[n])
               for n in "bc"), reads
    for rs in reads.values():
        rs.clear()
    first = three[0].membership.round
    together(three)  # a restart: the view holds them all
    assert {h.membership.round for h in three} == {first + 1}
    assert reads == {n: [] for n in "abc"}
    for h in three:  # and what it answers is what etcd has
        m = h.membership
        names = ring_neighbours(m.nodes, h.settings.node_id)
        wanted = names if m.rank == 0 else [*names, m.nodes[0]]  # as next_rendezvous() asks
        found = h._registrations(wanted, m.revision)
        for key, kv in found.items():
            now, _ = etcd_client.get(key)
            assert kv == now, key
    assert reads == {n: [] for n in "abc"}


def test_a_view_behind_rank_0s_registration_is_checked_against_etcd_before_a_round_is_refused(
        three, etcd_client, run_id, monkeypatch, caplog):
    keys = RunKeys(run_id)
    together(three)
    b = three[1]
    first = b.membership.round
    assert b.membership.nodes[0] == "a"
    with b._view.lock:  # b's view holds a's registration as of an earlier put, from another address
        kv = b._view.alive["a"]
        assert kv.value, "the first round's read left a's value in b's view"
        stale = dataclasses.replace(kv, value=json.dumps({**json.loads(kv.value), "addr": "10.9.9.9"}).encode(),
                                    mod_revision=kv.mod_revision - 1)
        b._view.alive["a"] = stale
    reads = _recorded_reads([b], monkeypatch)
    with caplog.at_level(logging.WARNING, logger="elastic_rt.rendezvous.handler"):
        together(three)
    assert b.membership.round == first + 1 and b.membership.nodes[0] == "a"
    assert not [r for r in caplog.records if "refusing round" in r.getMessage()]
    assert [keys.alive("a")] in reads["b"]  # the view's copy failed the check: etcd's passed it
    with b._view.lock:
        assert b._view.alive["a"] == etcd_client.get(keys.alive("a"))[0]  # and the view keeps etcd's


def _kv(key, value, rev):
    return KeyValue(key, value, rev, rev, 7)


def test_learn_fills_placeholders_and_older_puts_never_a_member_deleted_or_put_since():
    from elastic_rt.rendezvous.view import MembershipView

    keys = RunKeys("learn")
    view = MembershipView(None, keys, node_id="a")  # nothing started: the maps only
    placeholder = KeyValue("", b"", 50, 50, 0)
    view.alive = {"b": placeholder, "c": _kv(keys.alive("c"), b'{"addr": "old"}', 40),
                  "d": _kv(keys.alive("d"), b'{"addr": "newer"}', 60), "e": _kv(keys.alive("e"), b"", 45)}
    read = {keys.alive(n): _kv(keys.alive(n), b'{"addr": "read"}', 45) for n in "bcdefx"}
    view.learn(read)
    assert view.alive["b"] == read[keys.alive("b")]  # a placeholder: filled
    assert view.alive["c"] == read[keys.alive("c")]  # an older put: its event would bring the same
    assert view.alive["d"].value == b'{"addr": "newer"}'  # put again after the read: kept
    assert view.alive["e"] == read[keys.alive("e")]  # the same revision, read without its value: filled
    assert "f" not in view.alive and "x" not in view.alive  # deleted (or never a member): not brought back
    assert view.registrations([keys.alive("b"), keys.run_lease], 1) == {keys.alive("b"): read[keys.alive("b")]}
