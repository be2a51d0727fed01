"""The etcd-v3 rendezvous protocol with real etcd: rounds, scale-up, leave, eviction, closing."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters

from elastic_rt.errors import RendezvousDataError
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from tests.support.rendezvous import ranks


def _handler(endpoint, run_id, node, lo=1, hi=2, **conf):
    conf.setdefault("last_call_timeout", 2)
    return create_etcd_v3_handler(RendezvousParameters("etcd-v3", endpoint, run_id, lo, hi,
                                                       local_addr="127.0.0.1", node_id=node, **conf))


def _together(handlers):
    return ranks(handlers)


def test_round_forms_then_scale_up_then_leave(etcd_endpoint, run_id):
    a, b, c = (_handler(etcd_endpoint, run_id, n, 2, 3) for n in "abc")
    assert not c.round_running()  # nothing formed yet: a node starting now waits for nothing before joining
    first = _together([a, b])
    assert sorted(first.values()) == [(0, 2), (1, 2)]
    assert a.membership_change() is None
    assert c.round_running()  # c joining now makes a and b restart (a scale-up)
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
    assert not c.round_running()  # closed
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()


def test_round_closes_when_its_closer_never_joins(etcd_endpoint, etcd_client, run_id):
    """The smallest live id closes rounds; if that node never joins, the others read the joins and close. The round
    is 1 before it registers (a registration opens round 0, or joins it where it is open, in its own request)."""
    etcd_client.put(RunKeys(run_id).round, b"1")
    a, b, c = (_handler(etcd_endpoint, run_id, n, 2, 3, last_call_timeout=1) for n in "abc")
    try:
        a._start()  # registered (alive/a), never joins
        assert sorted(_together([b, c]).values()) == [(0, 2), (1, 2)]
        assert b.membership.nodes == ("b", "c")
    finally:
        for h in (a, b, c):
            h.leave()
            h.close()


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


def test_a_node_that_sees_the_next_round_before_the_lost_peer_still_says_peer_lost(etcd_endpoint, run_id):
    """c leaves; b notices first and opens the next round before a ever looks. a's group is as broken as
    b's (it must stop at once, not wait out a graceful stop), and its restart must say what happened."""
    a, b, c = (_handler(etcd_endpoint, run_id, n, 2, 3) for n in "abc")
    _together([a, b, c])
    formed = a.membership.round
    c.leave()
    assert _poll(lambda: b.membership_change() == "peer_lost")
    again: dict = {}
    rejoin = threading.Thread(target=lambda: again.update(b=b.next_rendezvous().world_size))
    rejoin.start()

    def advanced() -> bool:
        with a._view.lock:
            return (a._view.current_round() or 0) > formed

    try:
        assert _poll(advanced), "b did not open the next round"
        assert a.membership_change() == "peer_lost"
        assert a.next_rendezvous().world_size == 2
        rejoin.join(30)
        assert again == {"b": 2}
    finally:
        a.set_closed()
        rejoin.join(30)
        for h in (a, b):
            h.leave()


def test_a_lost_member_is_seen_by_its_ring_neighbours_and_rank_0_who_open_the_next_round_for_the_others(
        etcd_endpoint, run_id, caplog):
    """c leaves a round of five. Its ring neighbours (b, d) and rank 0 (a: it follows every alive/ change, as the next
    round's closer) see its deletion; e does not (its view follows d to e, and the keys up to a's): a lapse is an
    event at a few nodes, not at every node. The first to find c lost opens the next round at once, before its
    agent stops its workers, and e learns from that."""
    import logging

    caplog.set_level(logging.INFO, logger="elastic_rt")
    nodes = [_handler(etcd_endpoint, run_id, n, 4, 5) for n in "abcde"]
    a, b, c, d, e = nodes
    try:
        _together(nodes)
        formed = a.membership.round
        c.leave()
        assert _poll(lambda: all(h.membership_change() == "peer_lost" for h in (a, b, d)))
        assert "opened round %d for the members to re-form" % (formed + 1) in caplog.text
        assert _poll(lambda: e.membership_change() == "round_advanced")
        with e._view.lock:
            assert "c" not in e._view.departed and "c" in e._view.alive  # never an event at e
        assert sorted(_together([a, b, d, e]).values()) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    finally:
        for h in nodes:
            h.leave()
            h.close()


def test_neighbour_watch_reports_a_dead_agent_while_the_group_runs(etcd_endpoint, run_id):
    """No rendezvous in progress, a 60 s lease: only the ring watch can reveal the death."""
    survivor, proc = _survivor_of_a_doomed_peer(etcd_endpoint, run_id)
    assert survivor.membership_change() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert _poll(lambda: survivor.membership_change() == "peer_lost", timeout_s=20)
    survivor.leave()


# ---- failure model: outages, partitions, liveness evidence ---------------------------------------

@pytest.fixture
def own_etcd():
    """An etcd of this test's own: it gets paused."""
    from etcd_testbed.server import EtcdCluster

    with EtcdCluster(1) as cluster:
        yield cluster


def _live(handlers, timeout_s=30.0):
    """Poll every handler's membership_change() (as the agent's monitor tick does) until timeout_s;
    returns the first non-None answer per node."""
    import time

    seen: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for h in handlers:
            change = h.membership_change()
            if change and h.settings.node_id not in seen:
                seen[h.settings.node_id] = change
        time.sleep(0.1)
    return seen


def test_etcd_paused_past_the_lease_ttl_restarts_nothing(own_etcd, run_id):
    """Leases expire when etcd resumes (it revokes them before any keepalive gets through): every node
    registers again with the same incarnation, and nobody is declared lost."""
    import time

    a, b = (_handler(own_etcd.endpoints, run_id, n, 2, 2) for n in "ab")
    try:
        _together([a, b])
        pid = own_etcd.members[0].proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            assert _poll(lambda: not a.etcd_reachable() and not b.etcd_reachable(), 10)
            assert a.membership_change() is None and b.membership_change() is None
            time.sleep(6.0)  # the outage: twice the 3 s TTL
        finally:
            os.kill(pid, signal.SIGCONT)
        assert _poll(lambda: a.etcd_reachable() and b.etcd_reachable(), 15)
        assert _live([a, b], timeout_s=a.settings.reregister_grace_s + 2) == {}
        assert a._lease.renewals_lost + b._lease.renewals_lost >= 1  # they did expire, and came back
        with a._view.lock:
            assert set(a._view.alive) == {"a", "b"}
    finally:
        for h in (a, b):
            h.leave()
            h.close()


def test_node_cut_from_etcd_is_lost_within_ttl_and_rejoins_when_healed(etcd_endpoint, run_id):
    import time

    from elastic_rt.chaos.proxy import TcpProxy
    from elastic_rt.rendezvous.registration import parse_endpoints

    (host, port), = parse_endpoints(etcd_endpoint)
    with TcpProxy(host, port) as proxy:
        a, b = (_handler(etcd_endpoint, run_id, n, 2, 3, last_call_timeout=1) for n in "ab")
        c = _handler(proxy.endpoint, run_id, "c", 2, 3, last_call_timeout=1, read_timeout=1)
        try:
            _together([a, b, c])
            assert {h.membership.round for h in (a, b, c)} == {0}
            cut_at = time.monotonic()
            proxy.cut("blackhole")
            assert _poll(lambda: a.membership_change() == "peer_lost", 15)
            lost_after = time.monotonic() - cut_at
            assert lost_after < a.settings.lease_ttl_s + 2.0, lost_after
            assert b.membership_change() == "peer_lost"
            assert c.membership_change() is None  # it cannot tell; it must not guess
            assert sorted(_together([a, b]).values()) == [(0, 2), (1, 2)]
            proxy.heal()
            assert _poll(lambda: c.membership_change() == "round_advanced", 20)  # fenced: re-formed out
            waiter = threading.Thread(target=c.next_rendezvous)
            waiter.start()
            assert _poll(lambda: a.membership_change() == "scale_up", 20)
            _together([a, b])
            waiter.join(30)
            assert {h.membership.round for h in (a, b, c)} == {2}
            assert sorted(h.membership.rank for h in (a, b, c)) == [0, 1, 2]
        finally:
            for h in (a, b, c):
                h.leave()
                h.close()


def test_liveness_evidence_needs_a_port_that_answered():
    """Refused on first contact (a firewall, the wrong address family) is no evidence; a held
    connection that closes and then refuses is (the agent died)."""
    import socket

    from elastic_rt.rendezvous.liveness import LivenessListener, Peer, PeerWatch

    dead: list[str] = []
    watch = PeerWatch(lambda p: dead.append(p.node), retry_s=0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        never = Peer("never", "127.0.0.1", s.getsockname()[1], 1)  # bound, not listening: refuses
    listener = LivenessListener("127.0.0.1")
    held = Peer("held", "127.0.0.1", listener.port, 2)
    try:
        watch.watch([never, held])
        assert not watch.dead("never") and not watch.dead("held")
        listener.close()  # the agent dies: its sockets close, its port refuses
        assert _poll(lambda: watch.dead("held"), 10)
        assert dead == ["held"]
        assert not watch.dead("never")
    finally:
        watch.stop()
        listener.close()


def test_liveness_listener_binds_the_local_address_family():
    import socket

    from elastic_rt.rendezvous.liveness import LivenessListener

    v4 = LivenessListener("127.0.0.1")
    assert v4.address == f"127.0.0.1:{v4.port}"
    v4.close()
    from tests.integration.test_chaos_proxy import _ipv6_loopback

    if not _ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (::1)")
    v6 = LivenessListener("::1")
    try:
        assert v6.address == f"[::1]:{v6.port}"
        socket.create_connection(("::1", v6.port), timeout=2).close()
    finally:
        v6.close()


def test_free_port_is_one_a_store_can_listen_on_and_the_kernel_then_hands_out_anew():
    import socket

    from elastic_rt.rendezvous.liveness import free_port

    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p <= 65535 for p in ports) and len(ports) > 1  # the kernel's ephemeral choices
    port = ports.pop()
    with socket.socket() as sock:  # rank 0's TCPStore listens on every interface
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        sock.listen(1)
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_revoked_lease_is_registered_again_at_once_not_waited_for_as_an_outage(etcd_endpoint, etcd_client,
                                                                                 run_id, caplog):
    # TTL 30 s: the lease thread would notice the lease gone only at its next beat, 10 s later
    a = _handler(etcd_endpoint, run_id, "a", 1, 1, lease_ttl=30)
    try:
        assert a.next_rendezvous().world_size == 1
        old = a._lease.lease_id
        etcd_client.revoke_lease(old)  # as a peer's eviction, or an expiry during a long outage, would
        caplog.set_level("INFO", logger="elastic_rt")
        assert a.next_rendezvous().world_size == 1  # its join put finds the lease gone: NOT_FOUND
        assert a.membership.round == 1
        assert a._lease.lease_id != old and a._lease.renewals_lost == 1
        assert not [r for r in caplog.records if "waiting for etcd" in r.getMessage()], caplog.text
    finally:
        a.shutdown()


def test_an_agent_that_restarted_while_its_old_lease_lives_is_lost_at_once(etcd_endpoint, run_id, caplog):
    """b's agent process is replaced (same node id, a new incarnation) while the old one's lease still lives (60 s)
    and its liveness port, on the new agent's own address, refuses: the new agent takes the alive/ key over at
    once, and only its new value tells a, against the incarnation the final recorded."""
    import logging

    caplog.set_level(logging.INFO, logger="elastic_rt")
    a, b = (_handler(etcd_endpoint, run_id, n, 2, 3, lease_ttl=60) for n in "ab")
    _together([a, b])
    assert a.membership_change() is None
    a._peer_watch.stop()  # a would evict b's lease when its liveness connection closes: the take-over is tested
    b._lease.stop(revoke=False)  # the old agent process dies: no more beats, its listener closed, its lease lives
    b_again = _handler(etcd_endpoint, run_id, "b", 2, 3, lease_ttl=60, join_timeout=30)
    waiter = threading.Thread(target=lambda: pytest.raises(RendezvousClosedError, b_again.next_rendezvous))
    waiter.start()
    try:
        assert _poll(lambda: a.membership_change() == "peer_lost")
        assert "node b lost: its agent restarted (new incarnation)" in caplog.text
        assert "node b: the agent that held this node id" in caplog.text and "is gone; taking its place" in caplog.text
        assert a.membership_change() == "peer_lost"  # it stays lost until the group re-forms
    finally:
        a.set_closed()
        waiter.join(30)
        for h in (a, b, b_again):
            h.leave()


def test_a_node_whose_lease_lapsed_while_it_waited_joins_again_at_once(etcd_endpoint, etcd_client, run_id):
    """A node waiting in a first meeting does not watch its own alive/ key (it watches the smallest live node's
    only): when its lease is lost its join goes with it, and its new lease must wake it to join again, not its
    fallback read (last call 120 s here: the round would wait for it that long)."""
    a, b, c = (_handler(etcd_endpoint, run_id, n, 3, 3, lease_ttl=3, last_call_timeout=120) for n in "abc")
    done: dict[str, int] = {}
    errors: list[BaseException] = []

    def go(h):
        try:
            done[h.settings.node_id] = h.next_rendezvous().world_size
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(h,), daemon=True) for h in (a, b)]
    try:
        for t in threads:
            t.start()
        keys = b.keys
        assert _poll(lambda: len(etcd_client.list_prefix(keys.join_prefix(0), keys_only=True)[0]) == 2)
        old = b._lease.lease_id
        etcd_client.revoke_lease(old)  # b's lease lapses while it waits: its join is deleted with it
        assert _poll(lambda: b._lease.lease_id not in (0, old))  # the lease thread's next beat (1 s) registers b again
        assert _poll(lambda: etcd_client.get(keys.join(0, "b"))[0] is not None)  # ... and b joins again
        threads.append(threading.Thread(target=go, args=(c,), daemon=True))
        threads[-1].start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert done == {"a": 3, "b": 3, "c": 3}
    finally:
        for h in (a, b, c):
            h.leave()
            h.close()


def test_leases_granted_anew_while_a_first_meeting_waits_wedge_no_node(etcd_endpoint, etcd_client, run_id):
    """Every waiting node's lease lapses at once, five times over (a starved machine: 1,024 simulated nodes on two
    cores lost hundreds of leases at once). Each node's lease thread registers it again while its rendezvous thread
    decides on the view: the rendezvous read the lease id under the view's lock while the lease thread held its own
    lock across the grant's requests (and called into the view), and the node hung for good (1 try in 3 of a single
    lapse hung; the round never formed). Now every node joins again each time, and the round forms when the last
    node comes."""
    names = "abcde"
    hs = {n: _handler(etcd_endpoint, run_id, n, 5, 5, lease_ttl=3, last_call_timeout=120, join_timeout=90)
          for n in names}
    done: dict[str, int] = {}
    errors: list[BaseException] = []

    def go(n):
        try:
            done[n] = hs[n].next_rendezvous().world_size
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    keys = hs["a"].keys
    threads = [threading.Thread(target=go, args=(n,), daemon=True) for n in "abcd"]

    def registered(leases: set[int]) -> bool:  # etcd's view: four joins, four alive keys, none on `leases`
        joins = etcd_client.list_prefix(keys.join_prefix(0), keys_only=True)[0]
        alive = [kv for kv in etcd_client.list_prefix(keys.alive_prefix, keys_only=True)[0] if not kv.key.endswith("/e")]
        return len(joins) == 4 and len(alive) == 4 and not {kv.lease for kv in [*joins, *alive]} & leases

    try:
        for t in threads:
            t.start()
        assert _poll(lambda: registered(set()))
        for lapse in range(5):
            leases = {kv.lease for kv in etcd_client.list_prefix(keys.alive_prefix, keys_only=True)[0]}
            for lease in leases:
                etcd_client.revoke_lease(lease)
            assert _poll(lambda: registered(leases)), f"lapse {lapse}: a node did not register and join again"
        threads.append(threading.Thread(target=go, args=("e",), daemon=True))
        threads[-1].start()
        deadline = time.monotonic() + 60
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not errors, errors
        assert done == dict.fromkeys(names, 5)
    finally:  # in threads: a wedged node's leave() would wait on its view's lock for good
        closers = [threading.Thread(target=lambda h=h: (h.leave(), h.close()), daemon=True) for h in hs.values()]
        for t in closers:
            t.start()
        deadline = time.monotonic() + 30
        for t in closers:
            t.join(max(0.0, deadline - time.monotonic()))
