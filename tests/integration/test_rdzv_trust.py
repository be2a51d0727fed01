"""Whom the etcd-v3 rendezvous trusts, with real etcd and a forger writing the keys: a round's master must be the
address its rank 0 registered; with a job secret, finals and `closed` must be signed; a node id held by a live
agent, and a run held by another job's live agents, are refused."""

from __future__ import annotations

import json
import logging

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rt.errors import DuplicateNodeError, RunInUseError
from elastic_rt.rendezvous.claim import JobFingerprint
from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from tests.support.rendezvous import together


def _handler(endpoint, run_id, node, lo=2, hi=2, **conf):
    conf.setdefault("last_call_timeout", 2)
    return create_etcd_v3_handler(RendezvousParameters("etcd-v3", endpoint, run_id, lo, hi,
                                                       local_addr="127.0.0.1", node_id=node, **conf))


def _together(handlers) -> dict:
    return together(handlers, 90)


def _forge_next_final(client, run_id: str, rnd: int, **fields) -> None:
    """What a stranger with write access to the prefix puts there before the job reaches round `rnd`: the
    members as they are (their incarnations copied from their alive/ keys), a master of its own."""
    nodes = ["a", "b"]
    incs = [json.loads(client.get(f"/elastic-rt/{run_id}/alive/{n}")[0].value)["incarnation"] for n in nodes]
    final = {"round": rnd, "nodes": nodes, "incarnations": incs, **fields}
    client.put(f"/elastic-rt/{run_id}/rounds/{rnd:010d}/final", json.dumps(final).encode())


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "job.secret"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    return str(path)


def test_a_forged_final_with_another_master_is_refused_and_the_job_goes_on(etcd_endpoint, etcd_client, run_id,
                                                                          caplog):
    caplog.set_level(logging.WARNING, logger="elastic_rt")
    a, b = (_handler(etcd_endpoint, run_id, n, join_timeout=60) for n in "ab")
    try:
        first = _together([a, b])
        assert {i.bootstrap_store_info.master_addr for i in first.values()} == {"127.0.0.1"}
        _forge_next_final(etcd_client, run_id, 1, master=["127.0.0.99", 4242])
        again = _together([a, b])  # a worker failed: both meet again, and find round 1 already "formed"
        assert {i.bootstrap_store_info.master_addr for i in again.values()} == {"127.0.0.1"}
        assert {h.membership.round for h in (a, b)} == {2}
        assert ("refusing round 1: its master 127.0.0.99:4242 it is not the address rank 0 (a) registered "
                "(127.0.0.1) (a forged final?); opening round 2") in caplog.text
    finally:
        for h in (a, b):
            h.leave()
            h.close()


def test_with_a_secret_an_unsigned_final_and_closed_are_refused(etcd_endpoint, etcd_client, run_id, secret_file,
                                                                caplog):
    caplog.set_level(logging.WARNING, logger="elastic_rt")
    a, b = (_handler(etcd_endpoint, run_id, n, join_timeout=60, secret_file=secret_file) for n in "ab")
    try:
        _together([a, b])
        final = json.loads(etcd_client.get(f"/elastic-rt/{run_id}/rounds/{0:010d}/final")[0].value)
        assert isinstance(final.get("sig"), str)  # the closer signed it
        # the right master address with a port of the forger's own: only the signature tells
        _forge_next_final(etcd_client, run_id, 1, master=["127.0.0.1", 4242])
        etcd_client.put(f"/elastic-rt/{run_id}/closed", b'{"by": "stranger"}')
        again = _together([a, b])
        assert {h.membership.round for h in (a, b)} == {2}
        assert {i.bootstrap_store_info.master_port for i in again.values()} != {4242}
        assert f"refusing round 1: /elastic-rt/{run_id}/rounds/0000000001/final is not signed" in caplog.text
        assert f"etcd key /elastic-rt/{run_id}/closed is not signed" in caplog.text and not a.is_closed()
        a.set_closed()  # the job's own marker replaces the stranger's
        assert _poll(lambda: a.is_closed() and b.is_closed())  # once their views saw it
    finally:
        for h in (a, b):
            h.leave()
            h.close()


def test_without_a_secret_a_stranger_can_close_the_run(etcd_endpoint, etcd_client, run_id):
    """What etcd's auth and roles are for (docs/etcd-security.md): without them and without a secret, nothing in
    the value tells the job's `closed` from a stranger's."""
    a = _handler(etcd_endpoint, run_id, "a", 1, 1)
    try:
        a.next_rendezvous()
        etcd_client.put(f"/elastic-rt/{run_id}/closed", b"1")
        assert _poll(a.is_closed)
    finally:
        a.leave()
        a.close()


def test_a_second_live_agent_with_a_node_id_is_refused(etcd_endpoint, run_id):
    a = _handler(etcd_endpoint, run_id, "a", 1, 2, lease_ttl=1)
    twin = _handler(etcd_endpoint, run_id, "a", 1, 2, lease_ttl=1, join_timeout=20)
    try:
        a.next_rendezvous()
        with pytest.raises(DuplicateNodeError) as info:
            twin.next_rendezvous()  # waits 2 x TTL + 1 s for a's lease, which a keeps alive
        text = str(info.value)
        assert "\n" not in text and f"node id a is in use by another live agent of run {run_id}" in text
        assert "give each agent its own --node-id" in text
        assert a.membership_change() is None  # a's registration is untouched
    finally:
        for h in (a, twin):
            h.leave()
            h.close()


def test_a_live_run_of_another_job_is_refused_and_a_left_one_taken_over(etcd_endpoint, run_id, caplog):
    caplog.set_level(logging.INFO, logger="elastic_rt")
    job = JobFingerprint.of(script="train.py", script_args=("--lr", "0.1"), min_nodes=1, max_nodes=2).encode()
    other = JobFingerprint.of(script="eval.py", script_args=(), min_nodes=1, max_nodes=2).encode()
    a = _handler(etcd_endpoint, run_id, "a", 1, 2, fingerprint=job)
    stranger = _handler(etcd_endpoint, run_id, "s", 1, 2, fingerprint=other, join_timeout=20)
    try:
        a.next_rendezvous()
        with pytest.raises(RunInUseError) as info:
            stranger.next_rendezvous()
        text = str(info.value)
        assert "\n" not in text and f"run {run_id} belongs to another job whose agents are running (a)" in text
        assert "its script is train.py, not eval.py; its script arguments differ" in text
        a.leave()  # the job's agents are gone (its keys stay: it did not finish)
        later = _handler(etcd_endpoint, run_id, "s", 1, 2, fingerprint=other)
        later.next_rendezvous()
        assert "was used by another command before" in caplog.text
        later.leave()
        later.close()
    finally:
        for h in (a, stranger):
            h.leave()
            h.close()


def _poll(fn, timeout_s: float = 20.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not (value := fn()):
        if time.monotonic() > deadline:
            return value
        time.sleep(0.05)
    return value
