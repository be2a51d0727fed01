"""A node's first round against a real etcd: its membership view's first read goes in the same transaction as its
alive/ key (one request fewer per node: at 1,024 nodes, 1,024 fewer in the first round's burst), and the view it
starts from is the one a read of its own would have given. The job's claim on the run goes there too (one request
fewer per node of a launched job), and so does round 0 with the node's join where the run has none (the first node
of a run), or the node's join of round 0 where that round is open (every other node of a first meeting): never in a
closed run, nor in a round that has its final, nor in a run another job recorded."""

from __future__ import annotations

import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters

from elastic_rt.errors import RunInUseError
from elastic_rt.rendezvous.claim import JobFingerprint
from elastic_rt.rendezvous.etcd_client import RangeRead
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from elastic_rt.rendezvous.view import MembershipView
from tests.support.rendezvous import count_requests, together


def _state(view: MembershipView) -> tuple:
    with view.lock:
        return (view.current_round(), view.smallest_alive, sorted(view.alive), dict(view.finals), view.closed,
                sorted(view.waiting), view.run_lease)


def test_compare_and_put_then_read_reads_at_the_puts_revision_on_both_branches(etcd_client, run_id):
    c, keys = etcd_client, RunKeys(run_id)
    c.put(keys.alive("a"), b"a")
    read = RangeRead([(keys.alive_prefix, keys.alive("m").encode()), (keys.round, keys.round.encode() + b"\0")],
                     keys_only=frozenset({0}), first_only=frozenset({0}))
    ok, kv, ranges, revision, _ = c.compare_and_put_then_read(keys.alive("m"), b"m", expected_mod_revision=None,
                                                           read=read)
    assert ok and kv.value == b"m" and kv.mod_revision == revision
    assert [[(x.key, x.value) for x in r] for r in ranges] == [[(keys.alive("a"), b"")], []]
    put_at = c.put(keys.round, b"0")
    ok, kv, ranges, revision2, _ = c.compare_and_put_then_read(keys.alive("m"), b"other", expected_mod_revision=None,
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
    calls = count_requests(monkeypatch, handler._client,
                           ("read_ranges", "compare_and_put", "compare_and_put_then_read"))
    handler._start()
    assert calls == ["compare_and_put_then_read"], calls  # the alive key and the view's read: one transaction
    assert c.get(keys.join(0, "m"))[0] is None  # the run had a round: the registration did not join it
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


JOB = JobFingerprint.of(script="train.py", script_args=("--lr", "0.1"), min_nodes=1, max_nodes=2).encode()
OTHER = JobFingerprint.of(script="eval.py", script_args=(), min_nodes=1, max_nodes=2).encode()


def _job_handler(endpoint, run_id, node, fingerprint=JOB, **conf):
    return create_etcd_v3_handler(RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2, local_addr="127.0.0.1",
                                                       node_id=node, fingerprint=fingerprint, **conf))


def _requests(monkeypatch, client) -> list[str]:
    return count_requests(monkeypatch, client, ("get", "put", "read_ranges", "read_many", "compare_and_put",
                                                "compare_and_put_else", "compare_and_put_then_read"))


def test_a_new_runs_first_registration_records_the_claim_and_opens_round_0(etcd_endpoint, etcd_client, run_id,
                                                                            monkeypatch):
    keys = RunKeys(run_id)
    h = _job_handler(etcd_endpoint, run_id, "m")
    try:
        calls = _requests(monkeypatch, h._client)
        h._start()
        assert calls == ["compare_and_put_then_read"], calls  # no request of the claim's own
        alive, _ = etcd_client.get(keys.alive("m"))
        claim, _ = etcd_client.get(keys.fingerprint)
        rnd, _ = etcd_client.get(keys.round)
        join, _ = etcd_client.get(keys.join(0, "m"))
        assert claim.value == JOB.encode() and rnd.value == b"0" and join is not None
        assert alive.mod_revision == claim.mod_revision == rnd.mod_revision == join.mod_revision
        assert join.lease == alive.lease == h._lease.lease_id
        with h._view.lock:
            assert h._view.current_round() == 0  # the view's read, in that request, saw the round it opened
        info = h.next_rendezvous()
        assert info.rank == 0 and info.world_size == 1 and h.membership.round == 0
        assert "compare_and_put_else" not in calls[1:] and "compare_and_put" not in calls[1:], calls  # round 0
        # was not opened again (nor anything else compared and put: the final went with the run lease's key)
    finally:
        h.leave()
        h.close()


def test_the_same_jobs_claim_found_costs_no_request_and_opens_no_round(etcd_endpoint, etcd_client, run_id,
                                                                        monkeypatch):
    """The run was claimed by this job before (an agent restarted, a requeued job): the claim is found in the
    registration's request; a round is opened the ordinary way (the registration opens none in a claimed run)."""
    keys = RunKeys(run_id)
    etcd_client.put(keys.fingerprint, JOB.encode())
    h = _job_handler(etcd_endpoint, run_id, "m")
    try:
        calls = _requests(monkeypatch, h._client)
        h._start()
        assert calls == ["compare_and_put_then_read"], calls
        assert etcd_client.get(keys.round)[0] is None
        assert h.next_rendezvous().rank == 0 and h.membership.round == 0
    finally:
        h.leave()
        h.close()


def _joins_changed(client, keys: RunKeys, after: int) -> bool:
    """Whether any key under joins/ was put or deleted after revision `after` (etcd's history: a watch from there
    delivers past changes at once; the wait is for none to come)."""
    return client.wait_for_any([], [keys.joins_prefix], after_revision=after, timeout_s=0.5)


@pytest.mark.parametrize("fingerprint", ["", JOB], ids=["torch-registry", "launched"])
def test_a_registration_joins_an_open_round_0_in_its_request(etcd_endpoint, etcd_client, run_id, monkeypatch,
                                                            fingerprint):
    """Node n's registration opened round 0; node m's registration finds it open and puts m's join of it in the same
    request, on the alive key's lease: m puts no join of its own in its round (m, the smaller, is the closer: J7
    reads the joins), and the round forms with both."""
    keys = RunKeys(run_id)
    n, m = (_job_handler(etcd_endpoint, run_id, node, fingerprint=fingerprint) for node in "nm")
    try:
        n._start()
        calls = _requests(monkeypatch, m._client)
        m._start()
        assert calls == ["compare_and_put_then_read"], calls  # the claim found, the join: no request of their own
        alive, _ = etcd_client.get(keys.alive("m"))
        join, _ = etcd_client.get(keys.join(0, "m"))
        assert join is not None and join.mod_revision == alive.mod_revision and join.lease == alive.lease
        assert etcd_client.get(keys.round)[0].mod_revision < alive.mod_revision  # n's round 0, not opened again
        assert {k: (i.rank, i.world_size) for k, i in together([n, m], 30).items()} == {"m": (0, 2), "n": (1, 2)}
        assert m.membership.round == 0 and n.membership.round == 0
        made = [c for c in calls[1:] if c in ("put", "compare_and_put_else")]  # a join's request, round 0's opening
        assert made == [], calls
        assert etcd_client.get(keys.join(0, "m"))[0].lease == alive.lease  # the join of the registration formed it
    finally:
        for h in (m, n):
            h.leave()
            h.close()


def test_a_node_that_stalls_after_its_registration_joined_round_0_is_a_member_of_it(etcd_endpoint, run_id):
    """z's registration joined the open round 0, then z stalls before its round runs (alive, its lease beating): it is
    a member of round 0, as a node that stalls just after its join always was (MAX joined: b closes at once)."""
    b, c, z = (create_etcd_v3_handler(RendezvousParameters("etcd-v3", etcd_endpoint, run_id, 2, 3,
                                                           local_addr="127.0.0.1", node_id=n, last_call_timeout=1))
               for n in "bcz")
    try:
        b._start()  # opens round 0
        z._start()  # joins it, and never runs its round
        out = together([b, c], 30)
        assert {n: (i.rank, i.world_size) for n, i in out.items()} == {"b": (0, 3), "c": (1, 3)}
        assert b.membership.nodes == ("b", "c", "z") and b.membership.round == 0
    finally:
        for h in (b, c, z):
            h.leave()
            h.close()


def test_a_round_0_with_its_final_is_not_joined(etcd_endpoint, etcd_client, run_id):
    """Round 0 formed (its final written) before this node came: the registration does not join it (B6-B8 next)."""
    keys = RunKeys(run_id)
    etcd_client.put(keys.round, b"0")
    etcd_client.put(keys.final(0), b"{}")
    h = _job_handler(etcd_endpoint, run_id, "m", fingerprint="")
    try:
        h._start()
        assert etcd_client.get(keys.join(0, "m"))[0] is None and etcd_client.get(keys.alive("m"))[0] is not None
    finally:
        h.leave()
        h.close()


@pytest.mark.parametrize("round_0", [False, True], ids=["no-round", "round-0-open"])
def test_another_live_jobs_run_gets_no_round_and_no_key_of_this_node(etcd_endpoint, etcd_client, run_id, round_0):
    """Another job recorded the run and its agent is alive, and the run has no round yet, or an open round 0: the node
    is refused and leaves nothing there (the registration's round 0 needs a run with no fingerprint, its join of an
    open round 0 a run with this job's)."""
    keys = RunKeys(run_id)
    lease = etcd_client.grant_lease(30)
    etcd_client.put(keys.fingerprint, OTHER.encode())
    etcd_client.put(keys.alive("a"), b"{}", lease=lease)
    if round_0:
        etcd_client.put(keys.round, b"0")
        etcd_client.put(keys.join(0, "a"), b"{}", lease=lease)
    before = etcd_client.get(keys.round)[1]
    h = _job_handler(etcd_endpoint, run_id, "s", join_timeout=20)
    try:
        with pytest.raises(RunInUseError):
            h.next_rendezvous()
        assert etcd_client.get(keys.fingerprint)[0].value == OTHER.encode()
        rnd, _ = etcd_client.get(keys.round)
        assert (rnd.value if rnd is not None else None) == (b"0" if round_0 else None)
        assert [kv.key for kv in etcd_client.list_prefix(keys.joins_prefix)[0]] == ([keys.join(0, "a")] if round_0
                                                                                     else [])
        assert not _joins_changed(etcd_client, keys, before)  # never put, not put and deleted by leave()
        assert etcd_client.get(keys.alive("s"))[0] is None
    finally:
        h.leave()
        h.close()
        etcd_client.revoke_lease(lease)


@pytest.mark.parametrize("round_0", [False, True], ids=["no-round", "round-0-open"])
def test_a_closed_run_gets_no_round_and_no_join(etcd_endpoint, etcd_client, run_id, round_0):
    keys = RunKeys(run_id)
    if round_0:
        etcd_client.put(keys.round, b"0")
    before = etcd_client.put(keys.closed, b"{}")
    h = _job_handler(etcd_endpoint, run_id, "m", fingerprint="")
    try:
        with pytest.raises(RendezvousClosedError):
            h.next_rendezvous()
        rnd, _ = etcd_client.get(keys.round)
        assert (rnd is not None) is round_0 and etcd_client.get(keys.join(0, "m"))[0] is None
        assert not _joins_changed(etcd_client, keys, before)  # never put, not put and deleted on CLOSED (J1)
    finally:
        h.leave()
        h.close()


@pytest.mark.parametrize("opens", [True, False], ids=["opened-round-0", "joined-round-0"])
def test_a_lease_granted_anew_after_the_registration_takes_round_0s_join_with_it(etcd_endpoint, etcd_client, run_id,
                                                                                 monkeypatch, opens):
    """Node m's registration opens round 0 with its join (or, n having opened it, joins it); then its lease is lost
    and the lease thread grants another before m's round runs. The join went with the old lease: m joins again on the
    new one and the round forms with n (taking the new lease for the join's, m would wait for a join of its own that
    is gone until join_timeout)."""
    keys = RunKeys(run_id)
    m, n = (create_etcd_v3_handler(RendezvousParameters("etcd-v3", etcd_endpoint, run_id, 2, 2, local_addr="127.0.0.1",
                                                        node_id=node, join_timeout=15)) for node in "mn")
    real, first = m._lease.start, []

    def start_then_lost(**k):
        lease = real(**k)
        first.append(lease)
        etcd_client.revoke_lease(lease)
        deadline = time.monotonic() + 10
        while m._lease.lease_id in (lease, 0):  # the lease thread's next beat finds it gone and grants another
            assert time.monotonic() < deadline, "the lease was never granted anew"
            time.sleep(0.01)
        return lease

    monkeypatch.setattr(m._lease, "start", start_then_lost)
    try:
        if not opens:
            n._start()  # n's registration opens round 0: m's joins it
        before = etcd_client.get(keys.round)[1]
        m._start()
        assert etcd_client.get(keys.round)[0].value == b"0" and etcd_client.get(keys.join(0, "m"))[0] is None
        assert etcd_client.wait_for_any([keys.join(0, "m")], [], after_revision=before, timeout_s=0.5)  # put with
        # the registration, deleted with its lease
        out = together([m, n], 30)
        assert out["m"].rank == 0 and out["n"].rank == 1 and m.membership.round == 0
        join, _ = etcd_client.get(keys.join(0, "m"))
        assert join is not None and join.lease == m._lease.lease_id != first[0]
    finally:
        for h in (m, n):
            h.leave()
            h.close()


def test_a_registration_committed_whose_answer_was_lost_joins_and_claims_again(etcd_endpoint, etcd_client, run_id,
                                                                               monkeypatch):
    """etcd commits the first registration (alive key, claim, round 0 with the join) and its answer is lost (no
    answer within the deadline): the next try finds its own alive key, so nothing of that request is taken as made;
    the claim is checked by a request of its own and round 0 is joined on the lease the next try granted."""
    import grpc

    from elastic_rt.rendezvous.etcd_endpoint import Endpoint
    from elastic_rt.rendezvous.wire import CallError

    keys = RunKeys(run_id)
    h = _job_handler(etcd_endpoint, run_id, "m", last_call_timeout=1)  # 1 of --nnodes 1:2: the last call, 1 s
    real, lost = Endpoint.call, []

    def call(self, method, request, *a, **k):
        answer = real(self, method, request, *a, **k)
        if method == "KV/Txn" and not lost and keys.alive("m").encode() in bytes(request):
            lost.append(1)  # made by etcd, its answer lost
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within the deadline")
        return answer

    monkeypatch.setattr(Endpoint, "call", call)
    try:
        calls = _requests(monkeypatch, h._client)
        info = h.next_rendezvous()
        assert lost and info.rank == 0 and info.world_size == 1 and h.membership.round == 0
        assert "compare_and_put" in calls, calls  # the claim's own request: the lost answer said nothing
        assert etcd_client.get(keys.fingerprint)[0].value == JOB.encode()
        join, _ = etcd_client.get(keys.join(0, "m"))
        alive, _ = etcd_client.get(keys.alive("m"))
        assert join is not None and join.lease == alive.lease == h._lease.lease_id
    finally:
        h.leave()
        h.close()
