"""The round protocol's rules as one pure function: decide(view, node, now) -> Action, from a snapshot of the
membership view and this node's own state; rounds.py performs each action against etcd.

The rules, in the order they are tried (handler.py's docstring says why):

  Between rounds (this node holds no join key)
    B1  the join deadline passed                            -> TIMEOUT
    B2  the run is closed                                   -> CLOSED
    B3  no `round` key                                      -> CREATE_ROUND (0, create-only; this node's join of 0 in
                                                               the same transaction; made ahead of time in the
                                                               registration's request where the run had no round
                                                               then: Rounds.opening, the round starts joined)
    B4  the current round's final is not elastic-rt's       -> RendezvousDataError (one line, no waiting)
    B5  the current round has no final (in the view), and this node was not a member of it -> JOIN it (round 0:
        made ahead of time in the registration's request where round 0 was open then, Rounds.opening)
    B6  it has one that elastic-rt did not write (not its form, or not signed by the job's secret: a forgery;
        nobody can join R any more, its final is taken), or this node was a member of it (also while the view has
        not delivered R's final yet: a node that calls again at once must not join its own round again)
                                                            -> ADVANCE_ROUND (CAS R -> R+1 and this node's join of
                                                               R+1 in one transaction; a warning for the first)
    B6b it lists this node with this agent's incarnation (it joined R in an earlier call that etcd interrupted)
                                                            -> FORMED (the handler checks the master next: a
        master that is not the address rank 0 registered makes it a member of a refused round: B6 next)
    B7  it has one, this node was not a member, and it has not checked the members' alive keys since the view
        last changed (or for abandon_check_s)                -> CHECK_ABANDONED: one read of their alive/ keys;
        when none is alive (gone, or put again by a restarted agent) the whole job was stopped and started
        again (a requeued batch job): no member is left to open the next round, so this node does (CAS R -> R+1,
        with its join of R+1, as B6)
    B8  otherwise                                           -> AWAIT_NEXT_ROUND (waiting/N on its lease)
  Joined round J
    J1  the run is closed                                   -> CLOSED (the join key deleted)
    J2  J's final lists this node                           -> FORMED (waiting/N deleted if the view has it)
    J3  J's final does not, or elastic-rt did not write it (B6) -> UNJOIN (then B6)
    J4a the view shows no round, or one before J (it is behind this node's own opening of J) -> WAIT (J12 bounds it)
    J4  `round` moved past J                                -> UNJOIN
    J5  the join key is not on the current lease            -> JOIN (again)
    J6  the closer is the smallest live id this node knows: the view's smallest alive/ node, a smaller node
        learnt from its join (until it departs or a deletes-only view has read again), else this node
    J7  closer, no tracker                                  -> TRACK_JOINS (done already where the join said `track`)
    J8  closer, a smaller id joined                         -> STEP_DOWN (the view reads again)
    J9  not closer, a tracker                               -> STOP_TRACKING
    J10 not closer, the fallback read is due or the round has been closable for fallback_s -> READ_JOINS
    J11 closable (C1-C3), and closer or closable for fallback_s -> WRITE_FINAL (create-only)
    J12 the join deadline passed                            -> TIMEOUT (the join key deleted)
    J13 otherwise                                           -> WAIT for a change, until the last call ends,
                                                               the closable wait ends, the next read or the deadline
  Closable, on the joins this node knows (the tracker's, or its last read)
    C1  this node joined, and at least MIN did
    C2  MAX joined; or R > 0, a member of R-1 is alive (this incarnation of it), and every live node and every
        waiting node joined (a re-formation needs no last call; a job whose every earlier member is gone, started
        again, gathers as a first meeting does); or last_call_timeout_s passed since MIN were first seen
    C3  the members: the first MAX joins by create revision, in node-id order (rank = position, so rank 0 stays)

fallback_s = max(2 s, last_call_timeout_s); abandon_check_s = 5 s. The next fallback read is scheduled by the executor, jittered.

An advance to round R (ADVANCE_ROUND, CHECK_ABANDONED's advance) that loses its compare to another node's advance to R
puts this node's join of R in the same transaction where B5 would join it next (`round` holds R, R has no final, the
run is not closed, and R is not this node's previous round): the advance and B5's join in one request. Not
CREATE_ROUND: a loser there joins after its view delivered round 0, as before.

A node that puts a join (JOIN from B5, CREATE_ROUND, ADVANCE_ROUND, CHECK_ABANDONED's advance) expecting to close the round (J6 ahead of time: no
smaller live node known) reads the round's joins in the same transaction and tracks them from there (`track`): J7
costs no request of its own. Not for a round R > 0 that a view which does not follow alive/ yet joins (J7's tracker of
alive/ is needed then), nor for a join of round 0 made in the registration's request where another node had opened it
(that request cannot know whether this node will close: J7 reads the joins, one request, as B5's JOIN with `track`
would have been).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import lru_cache
from typing import Callable, Collection, Mapping

from elastic_rt.errors import RendezvousDataError
from elastic_rt.rendezvous.etcd_client import KeyValue
from elastic_rt.rendezvous.monitor import incarnation


@dataclass(frozen=True)
class Membership:
    """The outcome of one round, from this node's point of view."""

    round: int
    nodes: tuple[str, ...]
    rank: int
    master: tuple[str, int] | None = None  # rank 0's address and store port, when the final carries them
    incarnations: tuple[str | None, ...] = ()  # each member's agent process, as its join said (None: unknown)
    revision: int = 0  # the final's mod_revision: every member was alive then


@dataclass(frozen=True)
class RoundView:
    """What decide() reads: the membership view and the closer's tracker at one instant. The mappings are the
    views' own, read while their lock is held: nothing is copied."""

    version: tuple[int, int]  # (the view's, the tracker's or 0): what WAIT waits to change
    lease: int  # this node's current lease
    closed: bool
    round: int | None  # the current round (None: no `round` key yet)
    round_revision: int  # its mod_revision (for ADVANCE_ROUND's compare-and-set)
    finals: Mapping[int, KeyValue]
    waiting: Mapping[str, KeyValue]
    departed: Collection[str]
    smallest_alive: str | None
    follows_alive: bool  # the view sees every alive/ change (else only the smallest live node's deletion)
    reloads: int  # how often the view has read its ranges or found the smallest live node again
    alive: Mapping[str, KeyValue] | None  # every live node, from a view that follows alive/ (None: none does)
    joins: Mapping[str, KeyValue] | None  # the tracker's joins of the joined round (None: no tracker)


@dataclass(frozen=True, kw_only=True)
class NodeState:
    """This node in one next_round() call: its settings, and what it remembers between decisions."""

    node_id: str
    min_nodes: int
    max_nodes: int
    last_call_timeout_s: float
    deadline: float
    previous_round: int | None = None  # the round this node was last a member of
    said_waiting: int | None = None  # the round it last logged waiting for
    checked_alive: tuple[int, tuple[int, int], float] | None = None  # (round, view version, when): its members
    #                                                      were found alive (B7)
    joined: int | None = None  # the round it joined (holds or is about to put a join key for)
    joined_with: int = 0  # the lease its join key is on (0: not put yet)
    read: Mapping[str, KeyValue] | None = None  # the joins as last read (a node that is not the closer)
    fresh_read: bool = False  # `read` has not been judged yet
    read_due: float = float("inf")  # when the next fallback read is due
    closable_since: float | None = None
    min_seen_at: float | None = None  # when MIN joins (or a closable round) were first seen
    smaller: str | None = None  # a node with a smaller id, learnt from its join
    asked_at: int = 0  # the view's reload count when it was asked to read again for `smaller`
    written: KeyValue | None = None  # J's final as this node's own create-only write returned it

    abandon_check_s: float = 5.0  # B7: how long a check of a running round's members stands without a change
    incarnation: str = ""  # this agent process's (B6b)
    # why a final is not the job's own (the job secret's signature), None when it is: B6, J3
    refuses: Callable[[KeyValue], str | None] = field(default=lambda kv: None, repr=False, compare=False)

    @property
    def fallback_s(self) -> float:
        return max(2.0, self.last_call_timeout_s)

    def evolve(self, **changes) -> NodeState:
        """A copy with `changes`: dataclasses.replace without its per-field getattr and generated __init__ (a round
        makes several; replace() was 8% of the time of back-to-back restarts under a profiler). NodeState has no
        __post_init__ for this to skip; one added would have to run here too."""
        unknown = changes.keys() - _NODE_FIELDS
        if unknown:
            raise TypeError(f"NodeState has no field {', '.join(sorted(unknown))}")
        new = object.__new__(NodeState)
        state = new.__dict__
        state.update(self.__dict__)
        state.update(changes)
        return new

    def between_rounds(self) -> NodeState:
        """The state after leaving a joined round."""
        return self.evolve(joined=None, joined_with=0, read=None, fresh_read=False, read_due=float("inf"),
                       closable_since=None, min_seen_at=None, smaller=None, asked_at=0, written=None)


_NODE_FIELDS = frozenset(f.name for f in fields(NodeState))


class Step(Enum):
    """What the executor does next (the rule table above says when)."""

    CLOSED = "closed"  # raise RendezvousClosedError; delete the join key of `round` first, if there is one
    TIMEOUT = "timeout"  # raise RendezvousTimeoutError; likewise
    CREATE_ROUND = "create_round"  # create `round` as 0 (create-only) and put joins/0/N on `lease`, in one
    #                                transaction; wait up to 1 s for the view to show it
    ADVANCE_ROUND = "advance_round"  # CAS `round` from `round` to `round` + 1 and put joins/`round`+1/N on `lease`, in
    #                                  one transaction; wait up to 1 s for it to move
    CHECK_ABANDONED = "check_abandoned"  # read the alive/ keys of `round`'s members; none alive: ADVANCE_ROUND
    AWAIT_NEXT_ROUND = "await_next_round"  # put waiting/N on `lease` (put_waiting); wait up to wait_s
    JOIN = "join"  # put joins/`round`/N on `lease` (and read them all, with `track`)
    UNJOIN = "unjoin"  # delete joins/`round`/N (None: none was put)
    FORMED = "formed"  # return `membership` (deleting waiting/N first if drop_waiting)
    TRACK_JOINS = "track_joins"  # start the closer's tracker of `round`'s joins (and alive/, see `track_alive`)
    STOP_TRACKING = "stop_tracking"
    STEP_DOWN = "step_down"  # a smaller node joined: have the view read again
    READ_JOINS = "read_joins"  # read joins/`round`/*; schedule the next read
    WRITE_FINAL = "write_final"  # write `round`'s final (create-only): members, incarnations
    WAIT = "wait"  # wait up to wait_s for the view's or the tracker's version to change from `version`


@dataclass(frozen=True)
class Action:
    """One step and what it needs; `state` is the node's state after it (the executor adds what its I/O
    returns: the lease a join went on, the joins read, the final written)."""

    step: Step
    state: NodeState
    round: int | None = None
    lease: int = 0  # JOIN, CREATE_ROUND, ADVANCE_ROUND, AWAIT_NEXT_ROUND: the lease to put the key on
    wait_s: float = 0.0
    version: tuple[int, int] = (0, 0)
    revision: int = 0  # ADVANCE_ROUND, CHECK_ABANDONED: the expected mod_revision of `round`
    final: KeyValue | None = None  # CHECK_ABANDONED: the running round's final (its members, their incarnations)
    say: bool = False  # AWAIT_NEXT_ROUND: log that this node waits (once per round)
    why: str = ""  # ADVANCE_ROUND: the round's final is refused, and why (logged)
    put_waiting: bool = False  # AWAIT_NEXT_ROUND: waiting/N is missing or on an old lease
    track_alive: bool = False  # TRACK_JOINS: the tracker also follows alive/ (the view does not)
    track: bool = False  # JOIN, CREATE_ROUND, ADVANCE_ROUND: read the round's joins with the join and track them (J7)
    members: tuple[str, ...] = ()  # WRITE_FINAL
    incarnations: tuple[str | None, ...] = ()  # WRITE_FINAL
    membership: Membership | None = None  # FORMED
    drop_waiting: bool = False  # FORMED


def decide(view: RoundView, node: NodeState, now: float) -> Action:
    """The next step of this node in the round protocol. Pure: reads its arguments, changes nothing."""
    if node.joined is None:
        return _between_rounds(view, node, now)
    return _joined(view, node, now)


def _between_rounds(view: RoundView, node: NodeState, now: float) -> Action:
    if now >= node.deadline:
        return Action(Step.TIMEOUT, node)  # B1
    if view.closed:
        return Action(Step.CLOSED, node)  # B2
    rnd = view.round
    if rnd is None:
        return Action(Step.CREATE_ROUND, node, lease=view.lease, track=closes(view, node, 0))  # B3
    final = view.finals.get(rnd)
    if final is None and node.previous_round != rnd:
        return Action(Step.JOIN, node.evolve(joined=rnd), round=rnd, lease=view.lease,
                      track=closes(view, node, rnd))  # B5
    # B4 raises for a final that is not JSON; no final here: this node's own round, not delivered yet (B6)
    why = (malformed(final) or node.refuses(final)) if final is not None else None
    if why is not None or node.previous_round == rnd:
        return Action(Step.ADVANCE_ROUND, node, round=rnd, revision=view.round_revision, lease=view.lease,
                      track=closes(view, node, rnd + 1), why=f"{final.key} {why}" if why else "")  # B6
    m = membership(rnd, node.node_id, final)
    if m is not None and node.incarnation and m.incarnations[m.rank] == node.incarnation:
        return Action(Step.FORMED, node.between_rounds(), membership=m,
                      drop_waiting=node.node_id in view.waiting)  # B6b
    checked = node.checked_alive
    if checked is None or checked[:2] != (rnd, view.version) or now - checked[2] >= node.abandon_check_s:
        return Action(Step.CHECK_ABANDONED, node.evolve(checked_alive=(rnd, view.version, now)), round=rnd,
                      revision=view.round_revision, final=final, lease=view.lease,
                      track=closes(view, node, rnd + 1))  # B7
    waiting = view.waiting.get(node.node_id)  # B8
    return Action(Step.AWAIT_NEXT_ROUND, node.evolve(said_waiting=rnd), round=rnd, lease=view.lease,
                  version=view.version,
                  wait_s=max(0.0, min(node.deadline - now, node.abandon_check_s)), say=node.said_waiting != rnd,
                  put_waiting=waiting is None or waiting.lease != view.lease)


def closes(view: RoundView, node: NodeState, rnd: int) -> bool:
    """J6 and J7 ahead of time, for a node that puts its join of round rnd and has learnt no smaller node: it
    expects to close rnd (no smaller live node in the view), and its view can follow the joins without a tracker
    of alive/ (rnd 0, or a view that follows alive/)."""
    smallest = view.smallest_alive
    return (smallest is None or smallest >= node.node_id) and (rnd == 0 or view.follows_alive)


def _joined(view: RoundView, node: NodeState, now: float) -> Action:
    rnd, me = node.joined, node.node_id
    key = rnd if node.joined_with else None  # the join key to delete when leaving the round
    if view.closed:
        return Action(Step.CLOSED, node, round=key)  # J1
    final = view.finals.get(rnd) or node.written
    if final is not None and (malformed(final) or node.refuses(final)) is not None:
        return _leave_round(view, node, now, key)  # J3: not a final this job wrote
    if final is not None:
        m = membership(rnd, me, final)
        if m is not None:
            return Action(Step.FORMED, node.between_rounds(), membership=m, drop_waiting=me in view.waiting)  # J2
        return _leave_round(view, node, now, key)  # J3
    if view.round is None or view.round < rnd:  # J4a: the view is behind this node's own opening of rnd
        if now >= node.deadline:
            return Action(Step.TIMEOUT, node, round=key)
        return Action(Step.WAIT, node, version=view.version, wait_s=max(min(1.0, node.deadline - now), 0.01))
    if view.round != rnd:
        return _leave_round(view, node, now, key)  # J4
    if node.joined_with != view.lease:
        return Action(Step.JOIN, node, round=rnd, lease=view.lease)  # J5
    smaller = node.smaller  # J6
    if smaller is not None and (smaller in view.departed or (not view.follows_alive and view.reloads > node.asked_at)):
        smaller = None
    closer = view.smallest_alive or me
    closer = min(closer, smaller) if smaller is not None else closer
    node = node.evolve(smaller=smaller) if smaller != node.smaller else node
    if closer == me:
        if view.joins is None:
            return Action(Step.TRACK_JOINS, node, round=rnd, track_alive=rnd > 0 and not view.follows_alive)  # J7
        lowest = min(view.joins, default=me)
        if lowest < me:
            return Action(Step.STEP_DOWN, node.evolve(smaller=lowest, asked_at=view.reloads))  # J8
        joins = view.joins
    else:
        if view.joins is not None:
            return Action(Step.STOP_TRACKING, node)  # J9
        waited = node.closable_since is not None and now - node.closable_since >= node.fallback_s
        if not node.fresh_read and (now >= node.read_due or waited):
            return Action(Step.READ_JOINS, node, round=rnd)  # J10
        joins = node.read or {}
    alive = view.alive
    members, wait_s = closable(node, rnd, joins, now, alive, view.waiting, view.finals.get(rnd - 1))
    seen = node.min_seen_at
    if members is not None or len(joins) >= node.min_nodes:
        seen = seen or now
    since = node.closable_since
    if members is None:
        since = None
    elif closer == me or (since is not None and now - since >= node.fallback_s):
        state = node.evolve(min_seen_at=seen, fresh_read=False)  # J11
        return Action(Step.WRITE_FINAL, state, round=rnd, members=members,
                      incarnations=tuple(incarnation(joins[n]) for n in members))
    else:
        since = since or now
        wait_s = since + node.fallback_s - now
    if closer != me:
        wait_s = min(wait_s, node.read_due - now)
    state = node.evolve(min_seen_at=seen, closable_since=since, fresh_read=False)
    if now >= node.deadline:
        return Action(Step.TIMEOUT, state, round=rnd)  # J12
    return Action(Step.WAIT, state, version=view.version, wait_s=max(min(wait_s, node.deadline - now), 0.01))  # J13


def _leave_round(view: RoundView, node: NodeState, now: float, key: int | None) -> Action:
    """J3, J4: the round ended without this node; with no join key put, decide between rounds at once."""
    if key is None:
        return _between_rounds(view, node.between_rounds(), now)
    return Action(Step.UNJOIN, node.between_rounds(), round=key)


def closable(node: NodeState, rnd: int, joins: Mapping[str, KeyValue], now: float,
             alive: Mapping[str, KeyValue] | None, waiting: Collection[str],
             previous: KeyValue | None) -> tuple[tuple[str, ...] | None, float]:
    """(the members, in rank order, if round rnd can close on these joins now, else None; how long until the
    last call ends). `alive` follows every alive/ change (None: no view here does; then only MAX joins or the
    last call close a round); `previous`: round rnd-1's final as the view holds it (None: not held)."""
    if node.node_id not in joins or len(joins) < node.min_nodes:  # C1
        return None, float("inf")
    last_call_left = (node.min_seen_at or now) + node.last_call_timeout_s - now  # C2
    if len(joins) < node.max_nodes and last_call_left > 0:
        everyone = (rnd > 0 and alive is not None and all(n in joins for n in alive)
                    and all(n in joins for n in waiting) and _survived(previous, alive))
        if not everyone:
            return None, last_call_left
    first = sorted(joins, key=lambda n: joins[n].create_revision)[: node.max_nodes]  # C3
    return tuple(sorted(first)), 0.0


def membership(rnd: int, node_id: str, final: KeyValue) -> Membership | None:
    """This node's Membership of round rnd from its final, or None when the final does not list it."""
    data = decode_final(final)
    nodes = tuple(data.get("nodes", ()))
    if node_id not in nodes:
        return None
    master = data.get("master")
    master = (str(master[0]), int(master[1])) if isinstance(master, list) and len(master) == 2 else None
    incs = data.get("incarnations")
    if not isinstance(incs, list) or len(incs) != len(nodes):
        incs = (None,) * len(nodes)
    elif _all_str(incs):
        incs = tuple(incs)
    else:
        incs = tuple(i if isinstance(i, str) else None for i in incs)
    return Membership(rnd, nodes, nodes.index(node_id), master, incs, final.mod_revision)


def abandoned(final: KeyValue, alive: Mapping[str, KeyValue | None]) -> bool:
    """B7: no member that `final` lists is alive: each one's alive/ key is gone, or was put again by another
    incarnation of its node (its agent restarted). `alive` maps each member to its alive/ key as read."""
    data = decode_final(final)
    nodes = [str(n) for n in data.get("nodes", ())]
    incs = data.get("incarnations")
    incs = incs if isinstance(incs, list) and len(incs) == len(nodes) else [None] * len(nodes)
    return bool(nodes) and not any(
        kv is not None and (inc is None or incarnation(kv) in (None, inc))
        for inc, kv in ((inc, alive.get(n)) for inc, n in zip(incs, nodes)))


def _survived(final: KeyValue | None, alive: Mapping[str, KeyValue]) -> bool:
    """C2: a member of the round `final` closed is alive, as the same incarnation (a re-formation); False for no
    final, or one elastic-rt did not write (the last call then runs, as at a first meeting)."""
    try:
        return final is not None and malformed(final) is None and not abandoned(final, alive)
    except RendezvousDataError:
        return False


def malformed(final: KeyValue) -> str | None:
    """Why a final (JSON) is not one elastic-rt writes, or None: its round, its members (node ids) and one
    incarnation per member, as every final carries them. RendezvousDataError when it is not JSON at all."""
    data = decode_final(final)
    nodes, incs = data.get("nodes"), data.get("incarnations")
    rnd = final.key.rsplit("/", 2)[-2]
    if data.get("round") != (int(rnd) if rnd.isdigit() else None):
        return "names another round"
    if not isinstance(nodes, list) or not nodes or not _all_str(nodes):
        return "lists no members"
    if not isinstance(incs, list) or len(incs) != len(nodes):
        return "has no incarnation for each member"
    return None


def _all_str(items: list) -> bool:
    """Every item is a str (JSON's strings are exactly str): one pass in C, where a round's final lists N."""
    return not set(map(type, items)) - {str}


@lru_cache(maxsize=8)
def _parsed(value: bytes) -> object:
    """The JSON in a final's value, parsed once: decide() reads the same final several times per node (its form,
    its members, rank 0's address) and it lists every member. Callers only read what it returns."""
    return json.loads(value.decode())


def decode_final(kv: KeyValue) -> dict:
    """A round's final as a dict (shared: read it, never change it); RendezvousDataError (one line saying what to
    do) when it is not elastic-rt's."""
    try:
        value = _parsed(kv.value)
        if not isinstance(value, dict):
            raise ValueError("not an object")
        return value
    except (UnicodeDecodeError, ValueError) as exc:
        raise RendezvousDataError(
            f"etcd key {kv.key} (round membership) holds {len(kv.value)} bytes that elastic-rt did not write "
            f"({exc}); remove the run's keys with `etcdctl del --prefix {kv.key.rsplit('/rounds/', 1)[0]}/` "
            "or use a new --rdzv-id"
        ) from exc
