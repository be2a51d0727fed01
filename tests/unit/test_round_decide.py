"""The round protocol's rules (elastic_rt/rendezvous/decide.py's table), one row per rule, without etcd: each row
is a view snapshot and a node state, and the step decide() takes with what it carries."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import pytest

from elastic_rt.errors import RendezvousDataError
from elastic_rt.rendezvous.decide import Membership, NodeState, RoundView, Step, abandoned, closable, decide
from elastic_rt.rendezvous.etcd_client import KeyValue

ME = "n2"
NOW = 100.0
LEASE = 7


def kv(key: str, value: bytes = b"", rev: int = 1, lease: int = LEASE) -> KeyValue:
    return KeyValue(key, value, rev, rev, lease)


def joins(*nodes: str, incarnation: str = "inc") -> dict[str, KeyValue]:
    """Joins in the order given (create revisions 10, 11, ...), each carrying its node's incarnation."""
    return {n: kv(f"joins/{n}", json.dumps({"addr": "x", "incarnation": f"{incarnation}-{n}"}).encode(), 10 + i)
            for i, n in enumerate(nodes)}


def final(rnd: int, nodes: list[str], rev: int = 50, **extra) -> KeyValue:
    extra.setdefault("incarnations", [None] * len(nodes))
    return kv(f"/elastic-rt/run/rounds/{rnd}/final", json.dumps({"round": rnd, "nodes": nodes, **extra}).encode(), rev)


def forged(rnd: int, data: dict) -> KeyValue:
    return kv(f"/elastic-rt/run/rounds/{rnd}/final", json.dumps(data).encode(), 50)


def unsigned(kv_: KeyValue) -> str:
    return "is not signed, but this node has --rdzv-conf secret_file"


def view(**over) -> RoundView:
    alive = {n: kv(f"alive/{n}") for n in ("n1", "n2", "n3")}
    base = dict(version=(4, 0), lease=LEASE, closed=False, round=3, round_revision=30, finals={}, waiting={},
                departed={}, smallest_alive="n1", follows_alive=True, reloads=1, alive=alive, joins=None)
    return RoundView(**{**base, **over})


def node(**over) -> NodeState:
    base = dict(node_id=ME, min_nodes=2, max_nodes=3, last_call_timeout_s=10.0, deadline=1000.0)
    return NodeState(**{**base, **over})


def joined(**over) -> NodeState:
    """This node joined round 3 on the current lease; its next fallback read is due at 110."""
    return node(**{"joined": 3, "joined_with": LEASE, "read_due": 110.0, **over})


@dataclass
class Row:
    rule: str
    view: RoundView
    node: NodeState
    step: Step
    expect: dict = field(default_factory=dict)  # Action attributes
    state: dict = field(default_factory=dict)  # attributes of the state after the step
    now: float = NOW


ROWS = [
    # ---- between rounds -----------------------------------------------------------------------
    Row("B1 the deadline passed (before anything else)", view(closed=True), node(deadline=NOW), Step.TIMEOUT,
        {"round": None}),
    Row("B2 the run is closed", view(closed=True), node(), Step.CLOSED, {"round": None}),
    Row("B3 no round key: create round 0, joining it on the lease", view(round=None, round_revision=0), node(),
        Step.CREATE_ROUND, {"lease": LEASE, "track": False}),
    Row("B3 ... and reading its joins with the join when no smaller node is alive (this node will close it)",
        view(round=None, round_revision=0, smallest_alive=None, follows_alive=False, alive=None), node(),
        Step.CREATE_ROUND, {"lease": LEASE, "track": True}),
    Row("B5 the current round has no final: join it", view(), node(), Step.JOIN,
        {"round": 3, "lease": LEASE, "track": False}, {"joined": 3, "joined_with": 0}),
    Row("B5 ... reading its joins with the join as the smallest live node", view(smallest_alive=ME), node(),
        Step.JOIN, {"round": 3, "lease": LEASE, "track": True}),
    Row("B5 ... not in a round R > 0 while the view does not follow alive/ (J7's tracker of alive/ is needed)",
        view(smallest_alive=None, follows_alive=False, alive=None), node(), Step.JOIN, {"round": 3, "track": False}),
    Row("B5 ... but in round 0", view(round=0, round_revision=3, smallest_alive=None, follows_alive=False, alive=None),
        node(), Step.JOIN, {"round": 0, "track": True}),
    Row("B6 a member of the finished round advances it, joining the next on the lease",
        view(finals={3: final(3, ["n1", ME])}), node(previous_round=3), Step.ADVANCE_ROUND,
        {"round": 3, "revision": 30, "lease": LEASE, "track": False}),
    Row("B6 ... also before the view delivered the final of this node's own round (not a join of it again)",
        view(), node(previous_round=3), Step.ADVANCE_ROUND, {"round": 3, "revision": 30, "lease": LEASE}),
    Row("B6 ... reading the next round's joins with the join as the smallest live node",
        view(finals={3: final(3, [ME, "n3"])}, smallest_alive=ME), node(previous_round=3), Step.ADVANCE_ROUND,
        {"round": 3, "track": True}),
    Row("B6 a final elastic-rt did not write (no incarnations) is refused: open the next round",
        view(finals={3: forged(3, {"round": 3, "nodes": ["n1", ME], "master": ["10.6.6.6", 1]})}),
        node(previous_round=2), Step.ADVANCE_ROUND,
        {"round": 3, "revision": 30, "why": "/elastic-rt/run/rounds/3/final has no incarnation for each member"}),
    Row("B6 ... nor one of another round", view(finals={3: forged(3, {"round": 2, "nodes": [ME],
                                                                         "incarnations": [None]})}),
        node(), Step.ADVANCE_ROUND, {"why": "/elastic-rt/run/rounds/3/final names another round"}),
    Row("B6 ... nor one the job's secret does not sign", view(finals={3: final(3, ["n1", ME])}),
        node(previous_round=2, refuses=unsigned), Step.ADVANCE_ROUND,
        {"why": "/elastic-rt/run/rounds/3/final is not signed, but this node has --rdzv-conf secret_file"}),
    Row("B6b the final lists this agent (its join came before etcd interrupted it): formed",
        view(finals={3: final(3, ["n1", ME], incarnations=["i1", "i2"])}), node(previous_round=2, incarnation="i2"),
        Step.FORMED, {"membership": Membership(3, ("n1", ME), 1, None, ("i1", "i2"), 50)}),
    Row("B6b ... not another incarnation of its node", view(finals={3: final(3, ["n1", ME], incarnations=["i1", "x"])}),
        node(previous_round=2, incarnation="i2"), Step.CHECK_ABANDONED),
    Row("B7 a round runs without this node: check whether any of its members is alive",
        view(finals={3: final(3, ["n1", "n3"])}), node(previous_round=2), Step.CHECK_ABANDONED,
        {"round": 3, "revision": 30, "final": final(3, ["n1", "n3"])}, {"checked_alive": (3, (4, 0), NOW)}),
    Row("B7 ... again once the view changed", view(finals={3: final(3, ["n1"])}, version=(5, 0)),
        node(checked_alive=(3, (4, 0), NOW - 1)), Step.CHECK_ABANDONED),
    Row("B7 ... again for another round", view(round=4, round_revision=40, finals={4: final(4, ["n1"])}),
        node(checked_alive=(3, (4, 0), NOW - 1)), Step.CHECK_ABANDONED, {"round": 4, "revision": 40}),
    Row("B7 ... again after abandon_check_s without a change", view(finals={3: final(3, ["n1"])}),
        node(checked_alive=(3, (4, 0), NOW - 5)), Step.CHECK_ABANDONED),
    Row("B8 its members are alive: wait for the next round, saying so once",
        view(finals={3: final(3, ["n1", "n3"])}), node(previous_round=2, checked_alive=(3, (4, 0), NOW - 1)), Step.AWAIT_NEXT_ROUND,
        {"round": 3, "put_waiting": True, "say": True, "wait_s": 5.0, "version": (4, 0), "lease": LEASE},
        {"said_waiting": 3}),
    Row("B8 ... its waiting key on this lease is not put again, nor said twice",
        view(finals={3: final(3, ["n1"])}, waiting={ME: kv("waiting/n2")}),
        node(said_waiting=3, deadline=NOW + 2, checked_alive=(3, (4, 0), NOW - 1)), Step.AWAIT_NEXT_ROUND,
        {"put_waiting": False, "say": False, "wait_s": 2.0}),
    Row("B8 ... a waiting key on an old lease is put again",
        view(finals={3: final(3, ["n1"])}, waiting={ME: kv("waiting/n2", lease=5)}), node(checked_alive=(3, (4, 0), NOW - 1)),
        Step.AWAIT_NEXT_ROUND, {"put_waiting": True}),
    # ---- joined round 3 ---------------------------------------------------------------------------
    Row("J1 the run is closed: the join key goes", view(closed=True), joined(), Step.CLOSED, {"round": 3}),
    Row("J1 ... a join never put is not deleted", view(closed=True), joined(joined_with=0), Step.CLOSED,
        {"round": None}),
    Row("J2 the final lists this node: formed", view(finals={3: final(3, ["n1", ME, "n3"], master=["10.0.0.1", 29500],
                                                                    incarnations=["a", "b", 7])}),
        joined(), Step.FORMED,
        {"membership": Membership(3, ("n1", ME, "n3"), 1, ("10.0.0.1", 29500), ("a", "b", None), 50),
         "drop_waiting": False, "round": None}, {"joined": None, "joined_with": 0}),
    Row("J2 ... from this node's own write before the view shows it; its waiting key goes",
        view(waiting={ME: kv("waiting/n2")}), joined(written=final(3, [ME, "n3"])), Step.FORMED,
        {"membership": Membership(3, (ME, "n3"), 0, None, (None, None), 50), "drop_waiting": True}),
    Row("J2 ... even when the round moved on meanwhile", view(round=4, finals={3: final(3, [ME])}), joined(),
        Step.FORMED),
    Row("J3 the final leaves this node out: unjoin", view(finals={3: final(3, ["n1", "n3"])}), joined(),
        Step.UNJOIN, {"round": 3}, {"joined": None, "read": None, "written": None}),
    Row("J3 ... or the job's secret does not sign it", view(finals={3: final(3, [ME])}), joined(refuses=unsigned),
        Step.UNJOIN, {"round": 3}),
    Row("J4 the round moved on: unjoin", view(round=4), joined(), Step.UNJOIN, {"round": 3}, {"joined": None}),
    Row("J4a the view is behind this node's own opening of the round: wait, keep the join", view(round=2), joined(),
        Step.WAIT, {"version": (4, 0)}, {"joined": 3, "joined_with": LEASE}),
    Row("J4a ... or shows no round yet", view(round=None, round_revision=0), joined(), Step.WAIT),
    Row("J4a ... until the deadline", view(round=2), joined(deadline=NOW), Step.TIMEOUT, {"round": 3}),
    Row("J5 the lease was granted anew: join again on it", view(lease=8), joined(), Step.JOIN,
        {"round": 3, "lease": 8}),
    Row("J6 no smaller live node known: this node closes; J7 it tracks the joins",
        view(smallest_alive=None), joined(), Step.TRACK_JOINS, {"round": 3, "track_alive": False}),
    Row("J7 ... with alive/ too when the view watches deletions only (a re-formation)",
        view(smallest_alive=None, follows_alive=False, alive=None), joined(), Step.TRACK_JOINS,
        {"track_alive": True}),
    Row("J7 ... not in round 0 (no re-formation)", view(round=0, smallest_alive=None, follows_alive=False, alive=None),
        joined(joined=0), Step.TRACK_JOINS, {"track_alive": False}),
    Row("J8 the closer's tracker shows a smaller id: step down, the view reads again",
        view(smallest_alive=ME, reloads=5, joins=joins("n0", ME)), joined(), Step.STEP_DOWN, {},
        {"smaller": "n0", "asked_at": 5}),
    Row("J6 a learnt smaller node closes (not this node): J9 the tracker goes",
        view(smallest_alive=ME, joins=joins(ME)), joined(smaller="n0", asked_at=1), Step.STOP_TRACKING),
    Row("J6 ... until it departs", view(smallest_alive=ME, departed={"n0": 1.0}, joins=joins(ME, "n3")),
        joined(smaller="n0", asked_at=1), Step.WAIT, {}, {"smaller": None}),
    Row("J6 ... or a deletes-only view has read again",
        view(smallest_alive=ME, follows_alive=False, reloads=2, alive=None, joins=joins(ME, "n3")),
        joined(smaller="n0", asked_at=1), Step.WAIT, {}, {"smaller": None}),
    Row("J10 not the closer: the fallback read is due", view(), joined(read_due=NOW), Step.READ_JOINS, {"round": 3}),
    Row("J10 ... or the round has been closable for fallback_s", view(), joined(closable_since=NOW - 10.0),
        Step.READ_JOINS),
    Row("J10 ... but a fresh read is judged first", view(), joined(read_due=NOW, fresh_read=True, read=joins(ME)),
        Step.WAIT, {}, {"fresh_read": False}),
    Row("J11 the closer writes the final as soon as the round is closable (MAX joined)",
        view(smallest_alive=ME, joins=joins("n3", ME, "n4")), joined(), Step.WRITE_FINAL,
        {"round": 3, "members": (ME, "n3", "n4"), "incarnations": ("inc-n2", "inc-n3", "inc-n4")}),
    Row("J11 another node waits fallback_s after it found the round closable",
        view(), joined(read=joins(ME, "n1", "n3"), fresh_read=True), Step.WAIT, {"wait_s": 10.0},
        {"closable_since": NOW, "min_seen_at": NOW}),
    Row("J11 ... then writes the final itself", view(),
        joined(read=joins(ME, "n1", "n3"), fresh_read=True, closable_since=NOW - 10.0, read_due=NOW + 5),
        Step.WRITE_FINAL, {"members": ("n1", ME, "n3")}),
    Row("J11 ... and forgets it when the round stops being closable", view(),
        joined(read=joins(ME), fresh_read=True, closable_since=NOW - 10.0), Step.WAIT, {}, {"closable_since": None}),
    Row("J12 the deadline passed while joined: the join key goes", view(smallest_alive=ME, joins=joins(ME)),
        joined(deadline=NOW), Step.TIMEOUT, {"round": 3}),
    Row("J13 the closer waits until the last call ends", view(smallest_alive=ME, joins=joins(ME, "n3")),
        joined(min_seen_at=NOW - 4.0), Step.WAIT, {"wait_s": 6.0, "version": (4, 0)}),
    Row("J13 ... another node until its next read", view(), joined(read=joins(ME, "n3"), read_due=NOW + 4),
        Step.WAIT, {"wait_s": 4.0}),
    Row("J13 ... nobody past the deadline, and never for less than 10 ms", view(smallest_alive=ME, joins=joins(ME)),
        joined(deadline=NOW + 0.001), Step.WAIT, {"wait_s": 0.01}),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.rule for r in ROWS])
def test_rule(row: Row):
    action = decide(row.view, row.node, row.now)
    assert action.step is row.step
    for name, value in row.expect.items():
        assert getattr(action, name) == value, name
    for name, value in row.state.items():
        assert getattr(action.state, name) == value, name


def _alive(node_id: str, inc: str) -> KeyValue:
    return kv(f"alive/{node_id}", json.dumps({"incarnation": inc}).encode())


@pytest.mark.parametrize("alive, expected", [
    ({"n1": None, "n3": None}, True),  # every member's alive key is gone
    ({"n1": _alive("n1", "new-1"), "n3": None}, True),  # n1's agent restarted: the member is gone
    ({"n1": _alive("n1", "a"), "n3": None}, False),  # n1 is the member that formed the round
    ({"n1": None, "n3": kv("alive/n3")}, False),  # an alive key without an incarnation counts as alive
], ids=["all gone", "restarted", "one member alive", "no incarnation"])
def test_b7_a_round_is_abandoned_when_none_of_its_members_is_alive(alive, expected):
    assert abandoned(final(3, ["n1", "n3"], incarnations=["a", "b"]), alive) is expected


def test_b4_a_final_elastic_rt_did_not_write_is_one_clear_error():
    with pytest.raises(RendezvousDataError, match="etcdctl del --prefix /elastic-rt/run/"):
        decide(view(finals={3: kv("/elastic-rt/run/rounds/3/final", b"\xff not json")}), node(), NOW)
    with pytest.raises(RendezvousDataError, match="not an object"):
        decide(view(finals={3: kv("/elastic-rt/run/rounds/3/final", b"[1, 2]")}), joined(), NOW)


CLOSABLE = [
    # (rule, joins, node overrides, round, alive, waiting, members or None, wait_s)
    ("C1 this node has not joined", joins("n1", "n3"), {}, 3, None, {}, None, float("inf")),
    ("C1 fewer than MIN joined", joins(ME), {}, 3, None, {}, None, float("inf")),
    ("C2 MIN joined: the last call runs", joins(ME, "n1"), {}, 3, None, {}, None, 10.0),
    ("C2 ... from when MIN were first seen", joins(ME, "n1"), {"min_seen_at": NOW - 7}, 3, None, {}, None, 3.0),
    ("C2 ... until it ends", joins(ME, "n1"), {"min_seen_at": NOW - 10}, 3, None, {}, ("n1", ME), 0.0),
    ("C2 MAX joined: no last call", joins(ME, "n1", "n3"), {}, 0, None, {}, ("n1", ME, "n3"), 0.0),
    ("C2 a re-formation closes when every live node joined", joins(ME, "n1"), {}, 3,
     {"n1": 0, ME: 0}, {}, ("n1", ME), 0.0),
    ("C2 ... not while a live node has not", joins(ME, "n1"), {}, 3, {"n1": 0, ME: 0, "n3": 0}, {}, None, 10.0),
    ("C2 ... nor a waiting node", joins(ME, "n1"), {}, 3, {"n1": 0, ME: 0}, {"n9": 0}, None, 10.0),
    ("C2 ... and a first meeting always runs its last call", joins(ME, "n1"), {}, 0, {"n1": 0, ME: 0}, {}, None, 10.0),
    ("C2 ... as does a node whose views do not follow alive/", joins(ME, "n1"), {}, 3, None, {}, None, 10.0),
    ("C3 the first MAX joins by create revision, in id order", joins("n9", ME, "n0", "n5"), {"max_nodes": 3}, 3,
     None, {}, ("n0", ME, "n9"), 0.0),
]


@pytest.mark.parametrize("case", CLOSABLE, ids=[c[0] for c in CLOSABLE])
def test_closable(case):
    _, found, over, rnd, alive, waiting, members, wait_s = case
    previous = final(rnd - 1, ["n1", ME, "n3"])  # a round whose members are alive: a re-formation
    assert closable(node(**over), rnd, found, NOW, alive, waiting, previous) == (members, wait_s)


@pytest.mark.parametrize("previous, alive, members, wait_s", [
    (final(2, ["n1", ME], incarnations=["a", "b"]), {"n1": _alive("n1", "a"), ME: _alive(ME, "c")}, ("n1", ME), 0.0),
    (final(2, ["n7", "n8"], incarnations=["a", "b"]), {"n1": _alive("n1", "a"), ME: _alive(ME, "c")}, None, 10.0),
    (final(2, ["n1", ME], incarnations=["a", "b"]), {"n1": _alive("n1", "x"), ME: _alive(ME, "y")}, None, 10.0),
    (None, {"n1": _alive("n1", "a"), ME: _alive(ME, "c")}, None, 10.0),
    (kv("/elastic-rt/run/rounds/2/final", b"not json"), {"n1": _alive("n1", "a"), ME: _alive(ME, "c")}, None, 10.0),
], ids=["a member survived", "every member gone", "every member restarted", "no final held", "a garbage final"])
def test_c2_a_job_whose_every_earlier_member_is_gone_gathers_with_the_last_call(previous, alive, members, wait_s):
    """A requeued job's new agents (every member of the round before gone) wait for the last call, as at a first
    meeting, where a re-formation closes as soon as every live node joined: the first agent up would otherwise
    close a round of its own and leave the others waiting for the next."""
    assert closable(node(), 3, joins(ME, "n1"), NOW, alive, {}, previous) == (members, wait_s)


def test_min_seen_at_starts_the_last_call_once():
    state = decide(view(smallest_alive=ME, joins=joins(ME, "n3")), joined(), NOW).state
    assert state.min_seen_at == NOW
    assert decide(view(smallest_alive=ME, joins=joins(ME, "n3")), state, NOW + 4).wait_s == 6.0
    assert decide(view(smallest_alive=ME, joins=joins(ME)), joined(), NOW).state.min_seen_at is None


def test_decide_is_pure():
    v = view(smallest_alive=ME, joins=joins(ME, "n3", "n4"))
    before = (dict(v.joins), dict(v.alive), joined())
    first, second = decide(v, joined(), NOW), decide(v, joined(), NOW)
    assert first == second and (dict(v.joins), dict(v.alive), joined()) == before


def test_a_round_from_first_step_to_formed():
    """The closer's steps in order, each decided on what the previous one left (the executor's part faked)."""
    state, steps = node(), []
    tracker: dict[str, KeyValue] | None = None
    written = None
    for _ in range(10):
        v = view(smallest_alive=ME, joins=tracker, finals={3: written} if written else {})
        action = decide(v, state, NOW)
        steps.append(action.step)
        state = action.state
        if action.step is Step.JOIN:
            state = replace(state, joined_with=action.lease)
        elif action.step is Step.TRACK_JOINS:
            tracker = joins(ME, "n3", "n4")
        elif action.step is Step.WRITE_FINAL:
            written = final(3, list(action.members))
        elif action.step is Step.FORMED:
            break
    assert steps == [Step.JOIN, Step.TRACK_JOINS, Step.WRITE_FINAL, Step.FORMED]
    assert action.membership.rank == 0 and state.joined is None
