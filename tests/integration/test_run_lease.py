"""RunLease.ensure() and adopt() against a real etcd, given the `lease` key as the membership view has it: no request
when the view has a lease, a grant when it has none, and a view a little behind (the key written meanwhile by another
node) costs one grant that loses the create-only put and is revoked: one run lease, never two. A closer whose view
has not delivered its own final yet takes the lease it made sure of."""

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
