"""The executor of the etcd-v3 rendezvous's round protocol: it snapshots the local view, asks decide.py what
to do next and does it (the etcd reads and writes, the closer's tracker, the waits)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError

from elastic_rt.rendezvous.decide import (
    Action, Membership, NodeState, RoundView, Step, abandoned, closable, closes, decide, decode_final,
)
from elastic_rt.rendezvous.etcd_client import (
    EtcdClient, GuardedPut, IfAbsent, IfHeld, KeyValue, Outcome, Put, RangeRead, delivering_here,
)
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.liveness import free_port
from elastic_rt.rendezvous.signing import KeySigner
from elastic_rt.rendezvous.view import MembershipView

log = logging.getLogger(__name__)
# The largest round whose final also deletes the rounds before the previous one: that deletion is O(keys) (a join
# per node, a few worker store keys per node) in every member's apply loop, and at scale the final, which every node
# waits for, must not wait on it. Larger rounds' rank 0 deletes them after the round, in a request of its own.
HISTORY_WITH_FINAL_MAX_NODES = 64


@dataclass(frozen=True, kw_only=True)
class RendezvousSettings:
    run_id: str
    node_id: str
    local_addr: str
    min_nodes: int
    max_nodes: int
    lease_ttl_s: float = 3.0
    join_timeout_s: float = 600.0
    last_call_timeout_s: float = 10.0
    store_timeout_s: float = 300.0
    closed_ttl_s: float = 3600.0  # how long a finished run's `closed` marker outlives its other keys
    close_timeout_s: float = 30.0  # how long a node whose job ended retries writing `closed` while etcd is gone
    fingerprint: str = ""  # the job's (JobFingerprint.encode()); "" : not checked (torchrun's entry point)
    accept_closed: bool = False  # a run found finished is not an error
    metrics_addr: str | None = None  # host:port of the agent's /metrics, advertised in alive/ (None: not served)

    @property
    def reregister_grace_s(self) -> float:
        """After an etcd outage, how long a peer whose lease expired has to register again: one TTL
        for its beats to find the lease gone, the keepalive backoff cap, one more beat."""
        return self.lease_ttl_s + 2.0 + self.lease_ttl_s / 3


class Rounds:
    """Rounds as this node takes part in them; `lease_id()` is the current lease to attach its keys to,
    `incarnation` this agent process's (its joins carry it, the final lists the members'), `on_formed(membership)`
    is told of every round it becomes a member of. Before this node writes a final, `claim_lease()` says what else its
    transaction puts (the run lease's key when the run has none yet: the members find it with the final), and
    `settle_lease()` is told what came of that (RunLease.claim and settle)."""

    def __init__(self, client: EtcdClient, keys: RunKeys, settings: RendezvousSettings, view: MembershipView, *,
                 lease_id: Callable[[], int], on_formed: Callable[[Membership], None], incarnation: str = "",
                 claim_lease: Callable[[], GuardedPut | None] = lambda: None,
                 settle_lease: Callable[[tuple[bool, KeyValue | None] | None], None] = lambda outcome: None,
                 signer: KeySigner | None = None, clock: Callable[[], float] = time.monotonic,
                 rng: Callable[[], float]) -> None:
        self._client = client
        self._signer = signer or KeySigner()
        self._incarnation = incarnation
        self.keys = keys
        self.settings = settings
        self._view = view
        self._lease_id = lease_id
        self._on_formed = on_formed
        self._claim_lease, self._settle_lease = claim_lease, settle_lease
        self._clock = clock
        self._rng = rng
        # the closer's joins/ (and alive/) of the joined round when the view does not follow alive/ yet; else the
        # view itself follows the joins (track_joins())
        self._tracker: MembershipView | None = None
        self._ignored_closed = 0  # the mod_revision of the last unsigned `closed` warned about
        self.history_deleted = -1  # the last round whose final this node wrote with the deletion of the rounds before
        # the previous one (keys.history): rank 0 need not delete them again
        self._join_value = json.dumps({"addr": settings.local_addr, "incarnation": incarnation}).encode()
        self._opened: tuple[int, list[KeyValue] | None, int] | None = None  # round 0 as opening() joined it: (lease,
        # its joins where it opened round 0, the revision they were read at), until next_round() takes it
        self._steps: dict[Step, Callable[[Action], NodeState]] = {
            Step.CLOSED: self._closed, Step.TIMEOUT: self._timeout, Step.FORMED: self._formed,
            Step.CREATE_ROUND: self._create_round, Step.ADVANCE_ROUND: self._advance_round,
            Step.CHECK_ABANDONED: self._check_abandoned, Step.AWAIT_NEXT_ROUND: self._await_next_round, Step.JOIN: self._join, Step.UNJOIN: self._stop,
            Step.TRACK_JOINS: self._track_joins, Step.STOP_TRACKING: self._stop, Step.STEP_DOWN: self._step_down,
            Step.READ_JOINS: self._read_joins, Step.WRITE_FINAL: self._write_final, Step.WAIT: self._wait,
        }

    def opening(self, lease_id: int, *, absent: tuple[str, ...] = (), held: tuple[tuple[str, bytes], ...] = ()
                ) -> IfAbsent:
        """CREATE_ROUND (B3) and B5's join of round 0 made ahead of time, in another request (the registration's, before
        its view's first read: that request's compare must hold, NodeLease.start): where the run has no `round`, no
        `closed` and no key of `absent`, round 0 is created with this node's join on `lease_id`, and round 0's joins are
        read there; else, where `round` holds 0, round 0 has no final, the run is not closed and each key of `held`
        holds its value, this node's join of round 0 is put on `lease_id` (not read: the closer's J7 reads them).
        Tell opened() what came of it."""
        keys, join = self.keys, self._join_put(0, lease_id)
        return IfAbsent((keys.round, keys.closed, *absent), (Put(keys.round, b"0"), join),
                        made_read=RangeRead([keys.join_range(0)]), otherwise=self._if_open(0, join, also=held))

    def _join_put(self, rnd: int, lease: int) -> Put:
        """This node's join of round rnd, on `lease`."""
        return Put(self.keys.join(rnd, self.settings.node_id), self._join_value, lease)

    def _if_open(self, rnd: int, join: Put, *, also: tuple[tuple[str, bytes], ...] = ()) -> IfHeld:
        """`join` made in another request where B5 would make it: `round` holds rnd, rnd has no final, the run is not
        closed (and each key of `also` holds its value)."""
        keys = self.keys
        return IfHeld(keys.round, str(rnd).encode(), (keys.final(rnd), keys.closed), (join,), also=also)

    def opened(self, outcome: Outcome, lease_id: int, revision: int) -> None:
        """What came of opening(lease_id) in a request answered at `revision`: the next first round starts from it
        (joined, where either branch put the join)."""
        made, ranges, joined = outcome
        self._opened = (lease_id, ranges[0] if made else None, revision) if made or joined else None

    def forget_opening(self) -> None:
        """An opening not taken yet is void (this node left: its join went with its lease)."""
        self._opened = None

    def next_round(self, previous: Membership | None, deadline: float) -> Membership:
        """Join the current round (or wait for the next one) until a round forms with this node.
        Raises EtcdUnavailableError (the caller retries), RendezvousClosedError, RendezvousTimeoutError,
        RendezvousDataError."""
        s = self.settings
        node = NodeState(node_id=s.node_id, min_nodes=s.min_nodes, max_nodes=s.max_nodes,
                         last_call_timeout_s=s.last_call_timeout_s, deadline=deadline,
                         previous_round=previous.round if previous is not None else None,
                         incarnation=self._incarnation, refuses=self._signer.refuses)
        opened, self._opened = self._opened, None
        try:
            if opened is not None and previous is None:
                node = self._joined_ahead(node, *opened)
            while True:
                with self._view.mutex:
                    action = decide(self._snapshot(node.joined), node, self._clock())
                with delivering_here():  # the view's watch events that come with our answers: applied by
                    node = self._do(action)  # this thread (it holds none of the view's locks across a request)
                if action.step is Step.FORMED:
                    return action.membership
        finally:
            self._stop_tracking()

    def _joined_ahead(self, node: NodeState, lease: int, joins: list[KeyValue] | None, revision: int) -> NodeState:
        """The node as CREATE_ROUND or B5's JOIN would have left it, round 0 being joined by opening() (its join on
        `lease`): joined, and tracking the joins read there (`joins`: it opened round 0) where it expects to close the
        round (else J7 reads them). A lease granted anew since then took that join with it: the node is left as it was
        (decide() joins again)."""
        with self._view.mutex:
            view = self._snapshot(None)
            if view.lease != lease:
                return node
            track = joins is not None and closes(view, node, 0)
        node = node.evolve(joined=0, joined_with=lease, read_due=self._next_read(node))
        if track:
            self._track(node, 0, joins, revision)
        return node

    def _snapshot(self, joined: int | None) -> RoundView:
        """The view (and the tracker) now, without copying; the caller holds the view's lock."""
        view, tracker = self._view, self._tracker
        return RoundView(
            version=(view.version, tracker.version if tracker is not None else 0), lease=self._lease_id(),
            closed=self.closed_trusted(), round=view.current_round(),
            round_revision=view.round.mod_revision if view.round is not None else 0, finals=view.finals,
            waiting=view.waiting, departed=view.departed, smallest_alive=view.smallest_alive,
            follows_alive=view.alive_puts, reloads=view.reloads,
            alive=view.alive if view.alive_puts else (tracker.alive if tracker is not None else None),
            joins=tracker.joins.get(joined, {}) if tracker is not None else view.joins_of(joined),
        )

    def closed_trusted(self) -> bool:
        """The view holds a `closed` marker that the job's secret signs (caller holds the view's lock). One that it
        does not sign is ignored, with a warning once per write."""
        kv = self._view.closed_kv
        if kv is None:
            return False
        why = self._signer.refuses(kv)
        if why is None:
            return True
        if self._ignored_closed != kv.mod_revision:
            self._ignored_closed = kv.mod_revision
            log.warning("node %s: etcd key %s %s; ignoring it (the run goes on): a forgery, or a node without the "
                        "job's --rdzv-conf secret_file", self.settings.node_id, kv.key, why)
        return False

    def _do(self, action: Action) -> NodeState:
        """Perform one action; returns the node's state after it."""
        if action.step in (Step.CLOSED, Step.TIMEOUT, Step.UNJOIN, Step.FORMED):
            self._stop_tracking()
            if action.round is not None:  # this node's join key of the round it leaves
                self._client.delete(self.keys.join(action.round, self.settings.node_id))
        return self._steps[action.step](action)

    def _closed(self, action: Action) -> NodeState:
        raise RendezvousClosedError(f"run {self.settings.run_id} is closed (the job finished)")

    def _timeout(self, action: Action) -> NodeState:
        s = self.settings
        raise RendezvousTimeoutError(
            f"rendezvous {s.run_id} did not gather {s.min_nodes} node(s) within "
            f"{s.join_timeout_s:g} s (join_timeout); are the other nodes started with the same --rdzv-id?")

    def _formed(self, action: Action) -> NodeState:
        self._on_formed(action.membership)
        if action.drop_waiting:
            self._client.delete(self.keys.waiting(self.settings.node_id))
        return action.state

    def _create_round(self, action: Action) -> NodeState:
        return self._open_round(action, 0, expected=None)

    def _advance_round(self, action: Action) -> NodeState:
        """Our own round is over, or its final is refused: open the next one (one of the racing nodes wins)."""
        if action.why:
            log.warning("node %s: refusing round %d: %s; opening round %d", self.settings.node_id, action.round,
                        action.why, action.round + 1)
        return self._open_round(action, action.round + 1, expected=action.revision)

    def _open_round(self, action: Action, rnd: int, *, expected: int | None) -> NodeState:
        """Set `round` to rnd (compare-and-set against `expected`, None: create it) and put this node's join of rnd in
        the same transaction (reading rnd's joins there too with `track`); then wait up to 1 s for the view to show
        the round (decide()'s J4a waits on if it does not yet). A node whose advance of `round` lost the race to
        another node's advance to the same round joins that round in the transaction too, where B5 would have it join
        next: `round` holds rnd, which has no final, and the run is not closed (a re-form's survivors race to open the
        next round: one request each, not a lost compare and then a join)."""
        keys, value = self.keys, str(rnd).encode()
        join = self._join_put(rnd, action.lease)
        # Not for round 0's creation: the nodes that race to create it are those that take themselves for its closer
        # (their views have not seen a smaller node yet), and one that joined at once would follow the joins from
        # there, an event per join, until it learns of a smaller one (at 64 nodes: up to 5 events per node where
        # there were 3). B5 never joins a node's own round again.
        if expected is None or action.state.previous_round == rnd:
            otherwise = None
        else:
            otherwise = self._if_open(rnd, join)
        opened, joined, held, ranges, revision = self._client.compare_and_put_else(
            keys.round, value, expected_mod_revision=expected, also=(join,), otherwise=otherwise,
            read=RangeRead([keys.join_range(rnd)] if action.track else []))
        state = action.state
        if opened or joined:
            state = state.evolve(joined=rnd, joined_with=action.lease, read_due=self._next_read(state))
            if action.track:  # before the wait: the joins' watcher, where it is needed, starts from the read
                self._track(state, rnd, ranges[0], revision)
        view = self._view
        if held is None:  # `round` was deleted meanwhile
            view.wait_for(lambda: view.round is None, 1.0)
        else:  # `round` as the transaction left it (ours, or the winner's)
            view.wait_for(lambda: view.round is not None and view.round.mod_revision >= held.mod_revision, 1.0)
        return state

    def _track(self, node: NodeState, rnd: int, joins: list, revision: int) -> None:
        """Track round rnd's joins as read at `revision` (the closer's, J7), and add their watcher at once unless the
        round can close on them now (decide's closable()): a watcher added later would start in the past, and etcd
        serves such a watcher from its sync loop, up to 100 ms late."""
        view = self._view
        view.track_joins(rnd, joins, revision)
        with view.mutex:
            members, _ = closable(node, rnd, view.joins_of(rnd) or {}, self._clock(),
                                  view.alive if view.alive_puts else None, view.waiting, view.finals.get(rnd - 1))
        if members is None:
            view.follow_joins()

    def _check_abandoned(self, action: Action) -> NodeState:
        """Round R runs without us: are any of its members alive? One read of their alive/ keys."""
        nodes = [str(n) for n in decode_final(action.final).get("nodes", ())]
        found, _, _ = self._client.read_many([self.keys.alive(n) for n in nodes], [])
        if not abandoned(action.final, dict(zip(nodes, found))):
            return action.state
        log.info("node %s: no member of round %d is alive; opening round %d", self.settings.node_id,
                 action.round, action.round + 1)
        return self._advance_round(action)

    def _await_next_round(self, action: Action) -> NodeState:
        """Round R runs without us: ask its members to make room, wait for R + 1."""
        if action.put_waiting:
            self._client.put(self.keys.waiting(self.settings.node_id), b"", lease=action.lease)
        if action.say:
            log.info("node %s: round %d is running; waiting for the next round", self.settings.node_id, action.round)
        self._view.wait(action.version[0], action.wait_s)
        return action.state

    def _join(self, action: Action) -> NodeState:
        node = action.state
        join = self._join_put(action.round, action.lease)
        if action.track:  # this node expects to close the round: its joins, read with this one, then followed
            (joins,), revision = self._client.put_then_read(join, RangeRead([self.keys.join_range(action.round)]))
            self._track(node.evolve(joined=action.round), action.round, joins, revision)
        else:
            self._client.put(join.key, join.value, lease=join.lease)
        due = node.read_due if node.joined_with else self._next_read(node)  # the first join schedules the first read
        return node.evolve(joined_with=action.lease, read_due=due)

    def _track_joins(self, action: Action) -> NodeState:
        if not action.track_alive:  # the joins only: read, then a watcher on the view's own stream from there
            (joins,), revision = self._client.read_ranges([self.keys.join_range(action.round)])
            self._track(action.state, action.round, joins, revision)
            return action.state
        # the joins and every alive/ change, which the view does not follow yet: a view of their own (a read)
        keys = self.keys
        self._tracker = MembershipView(self._client, keys, node_id=self.settings.node_id,
                                       ranges=[keys.join_range(action.round), keys.alive_range],
                                       lock=self._view.lock, clock=self._clock)
        self._tracker.start()
        return action.state

    def _stop(self, action: Action) -> NodeState:
        self._stop_tracking()
        return action.state

    def _step_down(self, action: Action) -> NodeState:
        self._view.refresh()  # a view that watches the smallest node only: find it again
        return action.state

    def _read_joins(self, action: Action) -> NodeState:
        (kvs,), _ = self._client.read_ranges([self.keys.join_range(action.round)])
        node = action.state
        return node.evolve(read={self.keys.parse(kv.key)[2]: kv for kv in kvs}, fresh_read=True,
                       read_due=self._next_read(node))

    def _write_final(self, action: Action) -> NodeState:
        s = self.settings
        final = {"round": action.round, "nodes": list(action.members), "incarnations": list(action.incarnations)}
        if action.members[0] == s.node_id:  # rank 0 closes: its store address travels with the final
            final["master"] = [s.local_addr, free_port()]
        key = self.keys.final(action.round)
        value = self._signer.seal(key, final)
        # rank 0 deletes the rounds before the previous one once a round formed (the handler): in a small round, with
        # its own final (no request of its own)
        history = (self.keys.history(action.round - 1) if action.members[0] == s.node_id and action.round >= 2
                   and len(action.members) <= HISTORY_WITH_FINAL_MAX_NODES else ())
        claim = self._claim_lease()
        if claim is None:
            made, written = self._client.compare_and_put(key, value, expected_mod_revision=None, deletes=history)
        else:  # the run lease's key with the final: one request
            made, written, outcome = self._client.create_with(key, value, claim, deletes=history)
            self._settle_lease(outcome)
        if made and history:
            self.history_deleted = action.round
        return action.state.evolve(written=written)

    def _wait(self, action: Action) -> NodeState:
        view, tracker = self._view, self._tracker
        view.follow_joins()  # the tracked joins' watcher, now that their changes are waited for
        view.wait_for(lambda: (view.version, tracker.version if tracker is not None else 0) != action.version,
                      action.wait_s)
        return action.state

    def _next_read(self, node: NodeState) -> float:
        """When a node that is not the closer reads the joins next: fallback_s, jittered up to twice that."""
        return self._clock() + node.fallback_s * (1 + self._rng())

    def _stop_tracking(self) -> None:
        self._view.untrack_joins()
        if self._tracker is not None:
            self._tracker.stop()
            self._tracker = None
