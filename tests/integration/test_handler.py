"""The etcd-v3 rendezvous protocol with real etcd: rounds, scale-up, leave, eviction, closing."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters

from elastic_rt.errors import RendezvousDataError
from elastic_rt.rendezvous.registration import create_etcd_v3_handler


def _handler(endpoint, run_id, node, lo=1, hi=2, **conf):
    conf.setdefault("last_call_timeout", 2)
    return create_etcd_v3_handler(RendezvousParameters("etcd-v3", endpoint, run_id, lo, hi,
                                                       local_addr="127.0.0.1", node_id=node, **conf))


def _together(handlers):
    out, errors = {}, []

    def go(h):
        try:
            info = h.next_rendezvous()
            out[h.settings.node_id] = (info.rank, info.world_size)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=go, args=(h,)) for h in handlers]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    return out


def test_round_forms_then_scale_up_then_leave(etcd_endpoint, run_id):
    a, b, c = (_handler(etcd_endpoint, run_id, n, 2, 3) for n in "abc")
    first = _together([a, b])
    assert sorted(first.values()) == [(0, 2), (1, 2)]
    assert a.membership_change() is None
    waiter = threading.Thread(target=lambda: c.next_rendezvous())
    waiter.start()
    assert _poll(lambda: a.membership_change() == "scale_up")
    second = _together([a, b])
    waiter.join(30)
    assert c.membership.nodes == ("a", "b", "c") or set(c.membership.nodes) == {"a", "b", "c"}
    assert {x[1] for x in second.values()} == {3}
    c.leave()
    assert _poll(lambda: a.membership_change() == "peer_lost")
    assert sorted(_together([a, b]).values()) == [(0, 2), (1, 2)]
    a.shutdown()
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()


def _poll(pred, timeout_s=20.0):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _join_then_wait(endpoint, run_id, ready):
    h = _handler(endpoint, run_id, "doomed", lease_ttl=60, last_call_timeout=60)
    h.next_rendezvous()
    ready.set()
    threading.Event().wait(600)


def _survivor_of_a_doomed_peer(etcd_endpoint, run_id):
    """Round 0 of two nodes with 60 s leases: 'survivor' here, 'doomed' in a process of its own."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_join_then_wait, args=(etcd_endpoint, run_id, ready))
    proc.start()
    survivor = _handler(etcd_endpoint, run_id, "survivor", lease_ttl=60, last_call_timeout=60, join_timeout=30)
    survivor.next_rendezvous()
    assert ready.wait(60)
    return survivor, proc


def test_dead_agent_is_evicted_without_waiting_for_its_lease(etcd_endpoint, run_id):
    """With a 60 s lease and a 60 s last call, only eviction lets round 1 form within 30 s."""
    survivor, proc = _survivor_of_a_doomed_peer(etcd_endpoint, run_id)
    assert set(survivor.membership.nodes) == {"doomed", "survivor"}
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    info = survivor.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert survivor.membership.round == 1


def test_garbage_in_final_key_is_reported(etcd_client, etcd_endpoint, run_id):
    etcd_client.put(f"/elastic-rt/{run_id}/round", b"0")
    etcd_client.put(f"/elastic-rt/{run_id}/rounds/0000000000/final", b"\x80\x04pickle?")
    h = _handler(etcd_endpoint, run_id, "a", join_timeout=10)
    with pytest.raises(RendezvousDataError, match="did not write"):
        h.next_rendezvous()


def test_neighbour_watch_reports_a_dead_agent_while_the_group_runs(etcd_endpoint, run_id):
    """No rendezvous in progress, a 60 s lease: only the ring watch can reveal the death."""
    survivor, proc = _survivor_of_a_doomed_peer(etcd_endpoint, run_id)
    assert survivor.membership_change() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert _poll(lambda: survivor.membership_change() == "peer_lost", timeout_s=20)
    survivor.leave()
