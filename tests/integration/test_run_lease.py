"""RunLease.ensure(), claim() and settle() and adopt() against a real etcd, given the `lease` key as the membership view
has it: no request when the view has a lease, a grant when it has none (its key put in the final's own transaction:
EtcdClient.create_with), and a view a little behind (the key written meanwhile by another node) costs one grant that
loses the create-only put and is revoked: one run lease, never two. A closer whose view has not delivered its own final
yet takes the lease it claimed."""

from __future__ import annotations

import json

import pytest

from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.run_lease import RunLease, lease_of


def test_a_known_lease_costs_no_request(etcd_client, run_id, monkeypatch):
    keys = RunKeys(run_id)
    lease = RunLease(etcd_client, keys, ttl_s=60)
    lease.ensure(lambda: None)
    kv, _ = etcd_client.get(keys.run_lease)
    assert lease_of(kv) > 0
    for name in ("get", "grant_lease", "compare_and_put", "read_many", "read_ranges"):
        monkeypatch.setattr(etcd_client, name, lambda *a, **k: pytest.fail("ensure() asked etcd"))
    RunLease(etcd_client, keys, ttl_s=60).ensure(lambda: kv)


def test_a_view_behind_grants_once_then_takes_the_key_it_lost_to(etcd_client, run_id, monkeypatch):
    keys = RunKeys(run_id)
    RunLease(etcd_client, keys, ttl_s=60).ensure(lambda: None)  # another node's
    kv, _ = etcd_client.get(keys.run_lease)
    granted, revoked = [], []
    grant, revoke = etcd_client.grant_lease, etcd_client.revoke_lease
    monkeypatch.setattr(etcd_client, "grant_lease", lambda *a, **k: granted.append(grant(*a, **k)) or granted[-1])
    monkeypatch.setattr(etcd_client, "revoke_lease", lambda lease: revoked.append(lease) or revoke(lease))
    RunLease(etcd_client, keys, ttl_s=60).ensure(lambda: None)  # this node's view has not seen it yet
    after, _ = etcd_client.get(keys.run_lease)
    assert after.mod_revision == kv.mod_revision and lease_of(after) == lease_of(kv)
    assert len(granted) == 1 and revoked == granted  # the grant that lost was revoked


def test_a_key_that_is_not_elastic_rts_is_replaced(etcd_client, run_id):
    keys = RunKeys(run_id)
    etcd_client.put(keys.run_lease, b"garbage")
    kv, _ = etcd_client.get(keys.run_lease)
    RunLease(etcd_client, keys, ttl_s=60).ensure(lambda: kv)
    now, _ = etcd_client.get(keys.run_lease)
    assert lease_of(now) == json.loads(now.value)["id"] > 0


def test_the_membership_view_follows_the_key(etcd_client, run_id):
    from elastic_rt.rendezvous.view import MembershipView

    keys = RunKeys(run_id)
    view = MembershipView(etcd_client, keys, node_id="m", alive_puts=False)
    view.start()
    try:
        assert view.wait_for(lambda: view.connected, 10) and view.run_lease is None
        RunLease(etcd_client, keys, ttl_s=60).ensure(lambda: view.run_lease)
        kv, _ = etcd_client.get(keys.run_lease)
        assert view.wait_for(lambda: view.run_lease == kv, 10)
        etcd_client.revoke_lease(lease_of(kv))  # the key lives on the lease itself
        assert view.wait_for(lambda: view.run_lease is None, 10)
    finally:
        view.stop()


def test_the_closer_whose_view_is_behind_its_final_takes_the_lease_it_made_sure_of(etcd_client, run_id, monkeypatch):
    keys = RunKeys(run_id)
    closer = RunLease(etcd_client, keys, ttl_s=60)
    closer.ensure(lambda: None)  # before its final: granted here
    kv, _ = etcd_client.get(keys.run_lease)
    for name in ("get", "grant_lease", "compare_and_put", "read_many", "read_ranges"):
        monkeypatch.setattr(etcd_client, name, lambda *a, **k: pytest.fail("adopt() asked etcd"))
    assert closer.adopt(None, keeper=True, known=False) == lease_of(kv)
    monkeypatch.undo()
    other = RunLease(etcd_client, keys, ttl_s=60)  # holds none and knows none: reads the key, grants nothing
    granted = []
    grant = etcd_client.grant_lease
    monkeypatch.setattr(etcd_client, "grant_lease", lambda *a, **k: granted.append(grant(*a, **k)) or granted[-1])
    assert other.adopt(None, keeper=False, known=False) == lease_of(kv) and not granted


def _counting(monkeypatch, client, names=("grant_lease", "revoke_lease", "compare_and_put")) -> list[tuple[str, object]]:
    calls: list[tuple[str, object]] = []
    for name in names:
        real = getattr(client, name)

        def wrapped(*a, _real=real, _name=name, **k):
            result = _real(*a, **k)
            calls.append((_name, result))
            return result

        monkeypatch.setattr(client, name, wrapped)
    return calls


def test_the_lease_key_goes_in_the_finals_transaction(etcd_client, run_id, monkeypatch):
    keys = RunKeys(run_id)
    lease = RunLease(etcd_client, keys, ttl_s=60)
    calls = _counting(monkeypatch, etcd_client)
    claim = lease.claim(lambda: None)
    assert claim is not None and [c[0] for c in calls] == ["grant_lease"]
    written, final, outcome = etcd_client.create_with(keys.final(0), b"final", claim)
    assert written and outcome is not None and outcome[0]
    lease.settle(outcome)
    kv, _ = etcd_client.get(keys.run_lease)
    assert lease.lease_id == lease_of(kv) == calls[0][1] == kv.lease
    assert kv.mod_revision == final.mod_revision == outcome[1].mod_revision  # one request, one revision
    assert [c[0] for c in calls] == ["grant_lease"]  # no put of its own, nothing revoked
    assert lease.claim(lambda: None) is None  # held from now on


def test_a_claim_that_lost_to_a_key_written_meanwhile_revokes_its_grant(etcd_client, run_id, monkeypatch):
    keys = RunKeys(run_id)
    RunLease(etcd_client, keys, ttl_s=60).ensure(lambda: None)  # another node's
    theirs, _ = etcd_client.get(keys.run_lease)
    lease = RunLease(etcd_client, keys, ttl_s=60)
    calls = _counting(monkeypatch, etcd_client)
    claim = lease.claim(lambda: None)  # the view is behind: it has no key
    written, _, outcome = etcd_client.create_with(keys.final(0), b"final", claim)
    assert written and outcome == (False, theirs)  # the final is written, the key is not replaced
    lease.settle(outcome)
    assert lease.lease_id == lease_of(theirs)
    assert [c[0] for c in calls] == ["grant_lease", "revoke_lease"] and calls[1][1] is None
    after, _ = etcd_client.get(keys.run_lease)
    assert after == theirs


def test_a_claim_whose_final_was_not_written_puts_the_key_on_its_own(etcd_client, run_id, monkeypatch):
    keys = RunKeys(run_id)
    etcd_client.put(keys.final(0), b"another node's final")
    lease = RunLease(etcd_client, keys, ttl_s=60)
    calls = _counting(monkeypatch, etcd_client)
    claim = lease.claim(lambda: None)
    written, final, outcome = etcd_client.create_with(keys.final(0), b"final", claim)
    assert not written and final.value == b"another node's final" and outcome is None
    lease.settle(None)
    kv, _ = etcd_client.get(keys.run_lease)
    assert lease.lease_id == lease_of(kv) == calls[0][1] > 0
    assert [c[0] for c in calls] == ["grant_lease", "compare_and_put"]


def test_a_claim_whose_final_request_failed_is_claimed_again_with_the_same_grant(etcd_client, run_id, monkeypatch):
    keys = RunKeys(run_id)
    lease = RunLease(etcd_client, keys, ttl_s=60)
    calls = _counting(monkeypatch, etcd_client)
    first = lease.claim(lambda: None)  # then the final's request got no answer: settle() is never told
    etcd_client.put(keys.run_lease, b"garbage")  # meanwhile: a key that names no lease
    garbage, _ = etcd_client.get(keys.run_lease)
    again = lease.claim(lambda: garbage)
    assert again.put == first.put and again.expected_mod_revision == garbage.mod_revision
    written, _, outcome = etcd_client.create_with(keys.final(0), b"final", again)
    lease.settle(outcome)
    assert outcome[0] and lease.lease_id == first.put.lease
    assert [c[0] for c in calls] == ["grant_lease"]


def test_adopt_revokes_a_claim_that_was_never_settled(etcd_client, run_id, monkeypatch):
    keys = RunKeys(run_id)
    RunLease(etcd_client, keys, ttl_s=60).ensure(lambda: None)  # the final's writer made sure of it
    theirs, _ = etcd_client.get(keys.run_lease)
    lease = RunLease(etcd_client, keys, ttl_s=60)
    claim = lease.claim(lambda: None)  # this node's final request failed; another node's final formed the round
    calls = _counting(monkeypatch, etcd_client)
    assert lease.adopt(theirs, keeper=False) == lease_of(theirs)
    assert calls == [("revoke_lease", None)]
    assert etcd_client.refresh_lease(claim.put.lease) <= 0  # gone
    assert etcd_client.refresh_lease(lease_of(theirs)) > 0
