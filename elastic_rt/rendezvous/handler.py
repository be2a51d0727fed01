"""elastic-rt's rendezvous on etcd v3: lease-based membership, one key per node per round, watched not polled.

Protocol (keys from RunKeys):
  round            current round number R (created as 0)
  joins/R/N        node N's join of round R, attached to N's lease (vanishes when N dies); its value
                   holds N's address and incarnation
  rounds/R/final   the membership of round R (ranks in node-id order, each member's incarnation),
                   written once (create-only) by whoever closes it; when rank 0 closes it, also rank
                   0's address and store port
  alive/N          node N's liveness key, attached to its lease, for the whole run; its value
                   holds N's address, liveness port and incarnation (one per agent process)
  waiting/N        a node that found round R already closed and waits for R+1
  closed           the job is over; late joiners exit instead of waiting. On a lease of closed_ttl_s: the last
                   agent to leave removes every other key of the run, and the marker outlives them that long
  fingerprint      the job that uses the run (script, arguments, nnodes, launch id: claim.py); a node of another
                   job is refused while any agent of the run is alive
  lease            the id of the run's lease (run_lease.py), on the lease itself; the stores' keys are put on it
  stores/R/        the c10d store of round R's agents (bulk traffic, not watched); rank 0's store address at
                   stores/R/elastic-rt/master when it did not close the round itself

Every node keeps a local view of these keys (MembershipView) except the joins and the
stores: one range read, then one watch stream from that read's revision. Until the node is
a member of a round the view knows one alive/ key, the smallest below its own id, and
watches it for deletion (the closer is the smallest live node; at a first meeting every
registration, or every lapse, would otherwise be an event at every node: O(N^2)); when its
first round forms it counts the members alive (the final lists them, with
each one's incarnation from its join) and, from the final's revision on, without reading alive/ (N keys at each of
N nodes), follows every alive/ change as rank 0 or rank 1 (the next round's closer, and the one after it) and, at
every other member, the keys up to the smallest's and those of its ring neighbours: a member's lapse is an event at
its neighbours and ranks 0 and 1, and
a neighbour that finds it lost opens the next round at once (compare-and-set, no join), which every member sees. The agent's
monitor tick and the rendezvous loop read only the view; an idle job costs etcd the lease
keepalives and nothing else.

A round closes when MAX nodes joined, or when at least MIN joined and either every live
node (alive/*) has joined (re-formation rounds, R > 0: no last call needed) or
last_call_timeout_s passed since MIN were seen. The closer is the live node with the
smallest id: it alone watches the round's joins (O(N) events, one node: read in the transaction of its own join,
then a watcher added to its view's stream from that read's revision, only when it must wait for more joins, so no
stream or thread of its own; a view of its own, with a read, only while its view does not yet follow alive/ in a
round R > 0) and writes the
final (one create-only write; a node that does not know a smaller one yet acts as the
closer until it sees that node's join: a few nodes for random arrival order); everybody
else learns the final from the view (O(1) events per node). Only if no final comes do the
others read the joins, every max(2 s, last_call_timeout) jittered, and close the round
themselves once it has been closable for as long. A node of round R that must re-rendezvous bumps `round` from R to
R+1 by compare-and-set, with its join of R+1 in the same transaction. Per node and round: one join put (with the
CAS on `round` for the node that opens the round), at most one CAS on `final`, a waiting put and delete for late
nodes. A node's first registration (lease, then one transaction) puts its alive/ key, makes the view's first read,
records the job's fingerprint where the run has none, and creates round 0 with its join where the run has no round
(nor `closed`, nor, for a launched job, a fingerprint), or puts its join of round 0 where round 0 is open (no final,
the run not closed, and for a launched job the run held this job's fingerprint): the nodes of a first meeting have
joined round 0 before their round begins (no join request of their own), and are members of it from then on even if
they stall before their round runs (as a node that stalls after its join: the others' fallback close, J11, counts its
join).

decide.py holds these rules as one pure function of the view and the node's state (its docstring
has them as a table); rounds.py performs what it decides.

Trust (docs/rendezvous.md): a round's master (rank 0's store address, in its final or in the round's store) is
accepted only when it is the address its rank 0 registered in alive/; with `--rdzv-conf secret_file` each final,
`closed` and rank 0's store address are signed with the job's secret (signing.py) and a value it does not sign
is refused: a refused round is left for the next one (its members open round R+1), an unsigned `closed` is
ignored. A second live agent with a node id already registered is refused (lease.py).

Failure model (docs/failure-model.md says it for operators):
- etcd is needed to change membership, not to train. While etcd does not answer, the
  view is stale and membership_change() says nothing (never a restart because etcd is
  unreachable); the lease thread retries with jittered backoff and fails over between
  endpoints. When etcd answers again and nothing changed, nothing restarts: a lease that
  expired meanwhile is granted anew and alive/ re-put with the same incarnation.
- A peer is lost when its alive key is gone AND one of: its liveness connection says its
  agent died (held connection closed then refused, or refused where it answered before);
  etcd answered this node throughout (from a TTL before the key vanished until now: the
  peer failed to renew while etcd worked, i.e. it is dead, frozen or cut off); or it did not
  re-register within reregister_grace_s after this node's own etcd outage ended. A peer
  that re-registers with another incarnation (its agent restarted) is lost at once.
  Fast path: a held connection that closes and then refuses revokes the peer's lease
  at once (a SIGKILLed agent); a host that vanished is lost when its lease expires.
- Fencing. The round number is the fencing token: a group of round R is valid while
  `round` is R, and only a member of round R can advance it (a node joining late waits).
  A node that could not renew its lease for longer than the TTL may have been re-formed
  out, but while it cannot reach etcd it cannot tell "etcd is down for everyone" (nobody
  can re-form: forming a round needs etcd) from "I am cut off" (the others re-form
  without it, which kills their workers, so its own old group cannot complete a
  collective). So it keeps its workers while etcd is unreachable and decides when etcd
  answers: if `round` moved past R, it stops its workers (round_advanced) and joins the
  next round as a new member (scale-up if MAX allows, else it waits); if not, it
  re-registers and goes on. A worker failure meanwhile is decided the same way, when etcd
  answers. There is never a second group of round R: `final` of R is written once, and a
  new group needs a new round.
"""

from __future__ import annotations

import json
import logging
import random
import time
from datetime import timedelta
from typing import Callable, Mapping

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)


from elastic_rt.decisions import RestartReason
from elastic_rt.errors import EtcdUnavailableError, LeaseGoneError, RendezvousDataError, RunInUseError
from elastic_rt.interfaces import MembershipHandler
from elastic_rt.rendezvous.claim import claim_ahead, claim_run, remove_run_keys
from elastic_rt.rendezvous.etcd_client import EtcdClient, IfAbsent, KeyValue, Outcome
from elastic_rt.rendezvous.etcd_reachability import Backoff, EtcdHealth
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.lease import NodeLease
from elastic_rt.rendezvous.liveness import PeerWatch, free_port, parse_peer, ring_neighbours
from elastic_rt.rendezvous.monitor import MembershipMonitor
from elastic_rt.rendezvous.decide import Membership
from elastic_rt.rendezvous.rounds import RendezvousSettings, Rounds
from elastic_rt.rendezvous.run_lease import RunLease
from elastic_rt.rendezvous.signing import KeySigner, master_refusal, registered_addr
from elastic_rt.rendezvous.store import EtcdStore
from elastic_rt.rendezvous.view import MembershipView

log = logging.getLogger(__name__)
LEADER_LOOK_TTLS = (1.0, 3.0)  # keep-alives move to the leader this many lease TTLs after the node's first round
MASTER_KEY = "elastic-rt/master"  # rank 0's store address in the round's store, when it did not close the round


def alive_info(settings: RendezvousSettings) -> dict:
    """What this node's alive/ value tells the others and `elastic-rt status` (with the liveness port and the
    incarnation NodeLease adds): its address, --nnodes, and where its agent serves /metrics, when it does."""
    info: dict = {"addr": settings.local_addr, "nnodes": [settings.min_nodes, settings.max_nodes]}
    if settings.metrics_addr:
        info["metrics"] = settings.metrics_addr
    return info


class EtcdRendezvousHandler(RendezvousHandler, MembershipHandler):
    """torch.distributed.elastic RendezvousHandler backed by etcd v3 leases and watches, with the
    MembershipHandler extras the agent uses."""

    def __init__(self, client: EtcdClient, settings: RendezvousSettings, *, secret: bytes | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: Callable[[], float] = random.random) -> None:
        self._client = client
        self.settings = settings
        self.keys = RunKeys(settings.run_id)
        self._clock = clock
        self._rng = rng
        self._signer = KeySigner(secret)
        self._run_lease = RunLease(client, self.keys, ttl_s=max(600.0, 2 * settings.store_timeout_s),
                                   wait_s=settings.lease_ttl_s / 6, clock=clock)
        self.health = EtcdHealth(node_id=settings.node_id, clock=clock)
        self._view = MembershipView(client, self.keys, node_id=settings.node_id, clock=clock, alive_puts=False)
        self._lease = NodeLease(
            client, self.keys, settings.node_id, ttl_s=settings.lease_ttl_s, health=self.health,
            info=alive_info(settings), local_addr=settings.local_addr, clock=clock,
            on_beat=self._follow_failover, on_granted=self._view.changed,
        )
        self._started = False
        self._lease_started = False
        self._claimed: Outcome | None = None  # claim_ahead()'s outcome, until claim_run
        self._peer_watch: PeerWatch | None = None
        self._monitor = MembershipMonitor(
            node_id=settings.node_id, view=self._view, health=self.health, lease_ttl_s=settings.lease_ttl_s,
            grace_s=settings.reregister_grace_s, max_nodes=settings.max_nodes, clock=clock,
            dead=lambda node: self._peer_watch is not None and self._peer_watch.dead(node),
            renewals_lost=lambda: self._lease.renewals_lost,
        )
        self._rounds = Rounds(client, self.keys, settings, self._view, lease_id=lambda: self._lease.lease_id,
                              on_formed=self._formed, incarnation=self._lease.incarnation, signer=self._signer,
                              claim_lease=lambda: self._run_lease.claim(self._known_run_lease),
                              settle_lease=self._run_lease.settle,
                              clock=clock, rng=rng)
        self.membership: Membership | None = None
        self._leader_look_at: float | None = None  # when keep-alives may move to the leader (_follow_failover)
        self._announced = -1  # the last round whose lost member this node announced (membership_change)

    # ---- RendezvousHandler API -------------------------------------------
    def get_backend(self) -> str:
        return "etcd-v3"

    def get_run_id(self) -> str:
        return self.settings.run_id

    def is_closed(self) -> bool:
        """The run has a `closed` marker that the job's secret signs (any, without a secret)."""
        if self._started:
            with self._view.mutex:
                return self._rounds.closed_trusted()
        kv, _ = self._io(self._client.get, self.keys.closed)
        return kv is not None and self._signer.refuses(kv) is None

    def set_closed(self) -> None:
        """Mark the job over: the `closed` marker (signed with the job's secret, with the job's fingerprint), on a
        lease of closed_ttl_s, unless a trusted one is there; retried while etcd does not answer, up to
        close_timeout_s."""
        key = self.keys.closed
        value = self._signer.seal(key, {"by": self.settings.node_id, "fingerprint": self.settings.fingerprint})

        def put(_deadline: float) -> None:
            kv, _ = self._client.get(key)
            if kv is not None and self._signer.refuses(kv) is None:
                return  # another node of the job marked it
            lease = self._client.grant_lease(self.settings.closed_ttl_s)
            ok, _ = self._client.compare_and_put(key, value, expected_mod_revision=kv.mod_revision if kv else None,
                                                 lease=lease)
            if not ok:
                self._client.revoke_lease(lease)
                raise EtcdUnavailableError(f"etcd key {key} changed while this node marked the run closed; again")

        self._retrying(put, self._clock() + self.settings.close_timeout_s)

    def round_running(self) -> bool:
        """A round has formed (its final is written) and the run is not closed; False when etcd does not
        answer or the keys do not read (the caller only decides whether to wait before joining)."""
        k = self.keys
        try:
            (current, closed), _, _ = self._client.read_many([k.round, k.closed], [])
            if current is None or closed is not None:
                return False
            final, _ = self._client.get(k.final(k.decode_round(current)))
        except (EtcdUnavailableError, RendezvousDataError):
            return False
        return final is not None

    def closed_by_this_launch(self) -> bool:
        """The run's trusted `closed` marker was written by a node of this very launch: the same job fingerprint,
        with a launch_id (a pod or a Slurm job restarted after its job finished, not a new launch of the
        command). False without a launch_id: nothing tells a restart from a re-run then."""
        from elastic_rt.rendezvous.claim import JobFingerprint

        mine = JobFingerprint.decode(self.settings.fingerprint) if self.settings.fingerprint else None
        if mine is None or not mine.launch_id:
            return False
        try:
            kv, _ = self._client.get(self.keys.closed)
        except EtcdUnavailableError:
            return False
        if kv is None or self._signer.refuses(kv) is not None:
            return False
        try:
            recorded = json.loads(kv.value.decode()).get("fingerprint", "")
        except (UnicodeDecodeError, ValueError, AttributeError):
            return False
        return isinstance(recorded, str) and JobFingerprint.decode(recorded) == mine

    def tidy(self) -> int:
        """After leave(), when the run is closed: if this was its last agent (no alive/ key left), delete every key
        of the run but the `closed` marker, which its lease removes closed_ttl_s later. Returns the keys deleted."""
        try:
            kv, _ = self._client.get(self.keys.closed)
            if kv is None or self._signer.refuses(kv) is not None:
                return 0
            removed = remove_run_keys(self._client, self.keys)
        except EtcdUnavailableError as exc:
            log.info("node %s: the finished run's keys were not removed (%s); `elastic-rt gc` removes them",
                     self.settings.node_id, exc)
            return 0
        if removed:
            log.info("node %s: the last agent of finished run %s: removed its %d keys; its closed marker stays "
                     "%g s", self.settings.node_id, self.settings.run_id, removed, self.settings.closed_ttl_s)
        return removed

    def shutdown(self) -> bool:
        """torch calls this when its agent exits: close the run and leave."""
        try:
            self.set_closed()
            self.leave()
            self.close()
            return True
        except RendezvousConnectionError as exc:
            log.warning("node %s: rendezvous shutdown failed: %s", self.settings.node_id, exc)
            return False

    def close(self) -> None:
        """Release the etcd connections (after leave(); the handler is unusable afterwards)."""
        self._view.stop()
        self._client.close()

    def leave(self) -> None:
        """Give up this node's liveness now, so peers re-form without waiting for the lease TTL."""
        if self._peer_watch is not None:
            self._peer_watch.stop()
            self._peer_watch = None
        self._view.stop()
        if self._lease_started:
            self._lease.stop(revoke=True)
            self._lease_started = False
        self._started = False
        self._claimed = None
        self._rounds.forget_opening()

    def num_nodes_waiting(self) -> int:
        return 1 if self.membership_change() else 0

    def next_rendezvous(self) -> RendezvousInfo:
        t0 = self._clock()
        deadline = t0 + self.settings.join_timeout_s

        def attempt(deadline: float) -> Membership:
            self._start()
            return self._rounds.next_round(self.membership, deadline)

        while True:
            self.membership = m = self._retrying(attempt, deadline)
            names = ring_neighbours(m.nodes, self.settings.node_id)
            # rank 0's own alive/ key is not needed: it checks the master address against its own
            wanted = names if m.rank == 0 else [*names, m.nodes[0]]
            found = self._retrying(lambda _d: self._registrations(wanted, m.revision), deadline)
            known = self.keys.run_lease in found  # else this node wrote the final and its view is behind it
            lease = self._retrying(lambda _d: self._run_lease.adopt(found.get(self.keys.run_lease), keeper=m.rank == 0,
                                                                    known=known), deadline)
            store = EtcdStore(self._client, self.keys.round_store(m.round),
                              timedelta(seconds=self.settings.store_timeout_s), lease=lease)
            rank0 = self.keys.alive(m.nodes[0])
            master, why = self._master(m, store, found.get(rank0))
            if why is not None and master is not None and m.rank != 0:
                # rank 0's registration as the view holds it may be behind its last put: etcd's decides
                (kv,), _, _ = self._retrying(lambda _d: self._client.read_many([rank0], []), deadline)
                self._view.learn({rank0: kv})
                why = master_refusal(master, m.nodes[0], registered_addr(kv))
            if why is None:
                break
            # a member of a refused round: next_round's B6 opens the next one
            log.warning("node %s: refusing round %d: its master %s:%s %s (a forged final?); opening round %d",
                        self.settings.node_id, m.round, master[0] if master else "?", master[1] if master else "?",
                        why, m.round + 1)
        bootstrap = RendezvousStoreInfo(master_addr=master[0], master_port=master[1])
        self._watch_neighbours(names, found)
        if m.rank == 0 and m.round >= 2 and self._rounds.history_deleted != m.round:  # before the previous: history
            try:  # (a final that rank 0 wrote itself deleted them in its transaction)
                self._client.delete_ranges(list(self.keys.history(m.round - 1)))
            except EtcdUnavailableError as exc:
                log.info("node %s: old rounds not cleaned up now: %s", self.settings.node_id, exc)
        if log.isEnabledFor(logging.INFO):  # the member list is N names: built only when it is logged
            log.info("node %s round %d: rank %d of %d nodes (%s) in %.2f s", self.settings.node_id, m.round, m.rank,
                     len(m.nodes), ",".join(m.nodes), self._clock() - t0)
        return RendezvousInfo(store, m.rank, len(m.nodes), bootstrap)

    # ---- etcd reachability (used by the agent) ----------------------------
    def add_etcd_listener(self, fn: Callable[[bool], None]) -> None:
        """fn(up) whenever etcd becomes unreachable (False) or reachable again (True)."""
        self.health.add_listener(fn)

    def etcd_reachable(self) -> bool:
        """etcd answers, this node's lease is current and its view is connected: decisions can be made."""
        if not self._started:
            return self.health.up
        return (self.health.up and self._view.connected
                and self._lease.unrenewed_for_s() <= self.settings.lease_ttl_s)

    def catch_up(self, timeout_s: float = 2.0) -> bool:
        """After an outage: read `round` once and wait until the view has seen it (so a decision made
        next sees what the others did meanwhile). False when etcd did not answer."""
        try:
            kv, _ = self._client.get(self.keys.round)
        except EtcdUnavailableError:
            return False
        deadline = self._clock() + timeout_s
        version = -1
        while True:
            with self._view.mutex:
                ok = kv is None or (self._view.round is not None
                                    and self._view.round.mod_revision >= kv.mod_revision)
                version = self._view.version
            if ok or self._clock() >= deadline:
                return ok
            self._view.wait(version, deadline - self._clock())

    def _known_run_lease(self) -> KeyValue | None:
        with self._view.mutex:
            return self._view.run_lease

    def _registrations(self, nodes: list[str], revision: int) -> dict[str, KeyValue | None]:
        """The alive/ keys of `nodes`, and the run lease's key as of the round's final (`revision`) where the view
        has delivered it, by key: what the membership view holds (MembershipView.registrations), the alive/ keys
        it lacks in one request, whose values the view keeps for the rounds after. The run lease's key is left out
        when the view is behind the final: its node wrote the final and the run lease's key with it."""
        wanted = [self.keys.alive(n) for n in dict.fromkeys(nodes)]
        with self._view.mutex:
            found = self._view.registrations([*wanted, self.keys.run_lease], revision)
        missing = [k for k in wanted if k not in found]
        if missing:
            values, _, _ = self._client.read_many(missing, [])
            read = dict(zip(missing, values))
            self._view.learn(read)
            found.update(read)
        return found

    def _master(self, m: Membership, store: EtcdStore,
                rank0: KeyValue | None) -> tuple[tuple[str, int] | None, str | None]:
        """(rank 0's store address, None) for this round, or (what was found, why it is refused). From the final
        when rank 0 closed the round; else rank 0 puts it in the round's store (signed with the job's secret)
        and the others read it there. It must be the address rank 0 registered in its alive/ key."""
        key = store.prefix + MASTER_KEY
        if m.master is not None:
            master = m.master
        elif m.rank == 0:
            master = (self.settings.local_addr, free_port())
            self._io(store.set, MASTER_KEY, self._signer.seal(key, {"addr": master[0], "port": master[1]}))
        else:
            value = store.get(MASTER_KEY)  # waits for rank 0 (up to the store timeout), as torch's bootstrap does
            why = self._signer.refusal(key, value)
            if why is not None:
                return None, f"(etcd key {key}) {why}"
            try:
                data = json.loads(value.decode())
                master = (str(data["addr"]), int(data["port"]))
            except (UnicodeDecodeError, ValueError, KeyError, TypeError):
                return None, f"(etcd key {key}) is not elastic-rt's"
        registered = self.settings.local_addr if m.rank == 0 else registered_addr(rank0)
        return master, master_refusal(master, m.nodes[0], registered)

    def fence_view(self) -> dict | None:
        """What checkpoint fencing needs (elastic_rt/checkpoint/fence.py): the round in the view, the
        launch (the `round` key's create revision: one per run prefix created), the lease's last
        confirmed renewal and how often it was found gone. None before the first round."""
        if self.membership is None or not self._started:
            return None
        last_renewed = self._lease.last_renewed  # before renewals_lost: a fresh renewal implies its loss count
        renewals_lost = self._lease.renewals_lost
        with self._view.mutex:
            kv = self._view.round
            rnd = self._view.current_round()
        return {"run_id": self.settings.run_id, "launch_id": str(kv.create_revision) if kv else "",
                "round": rnd if rnd is not None else -1, "last_renewed": last_renewed,
                "renewals_lost": renewals_lost, "lease_ttl_s": self.settings.lease_ttl_s,
                "reachable": self.etcd_reachable(), "etcd_up": self.health.up}

    def _follow_failover(self) -> None:
        """After a beat: if the keepalive failed over to another endpoint, move the watch there too
        (a hung member keeps a watch stream open and silent), or back to this node's own member once it answers
        again (EtcdClient.go_home); send keep-alives to the member that leads (EtcdClient.follow_leader), from
        LEADER_LOOK_TTLS lease TTLs (at random in that range) after this node was first in a round: off the meeting's
        path, where the looks' requests and the leaders' connections slowed 1,024 nodes down, and spread over the
        agents that met together; reopen a watch that no thread could be started to reopen; as rank 0, keep the run's
        lease alive."""
        self._run_lease.beat()
        self._view.revive()
        self._client.go_home(self.keys.round)
        if self.membership is not None:
            if self._leader_look_at is None:
                low, high = LEADER_LOOK_TTLS
                self._leader_look_at = self._clock() + (low + (high - low) * self._rng()) * self.settings.lease_ttl_s
            if self._clock() >= self._leader_look_at:
                self._client.follow_leader()
        endpoint = self._view.stream_endpoint
        if endpoint is not None and endpoint != self._client.current_endpoint:
            log.info("node %s: moving the membership watch to %s", self.settings.node_id,
                     self._client.current_endpoint)
            self._view.reconnect()

    # ---- membership watching (used by the agent's monitor loop) ------------
    def membership_change(self) -> RestartReason | None:
        """Why this node's current group must re-form, or None. Reads local state only.

        ROUND_ADVANCED: another node started a new round; PEER_LOST: a node of this
        round is gone (see the module docstring for when that is decided); SCALE_UP:
        nodes wait to join and there is room. None also while etcd is unreachable.
        """
        if self._lease.conflict is not None:
            return RestartReason.ROUND_ADVANCED  # another agent took this node id: the next rendezvous says so
        if self.membership is None or not self._started or not self.etcd_reachable():
            return None
        reason = self._monitor.change()
        if reason is RestartReason.PEER_LOST:
            self._announce(self.membership.round)
        return reason

    def _announce(self, rnd: int) -> None:
        """A member of round rnd is lost: open round rnd + 1 now (compare-and-set, no join), before this node's
        agent stops its workers. The other members see a lost member only if it is one of their ring neighbours
        (MembershipView.members_formed), and every one of them sees `round` move. Once per round; a lost race or
        an etcd that does not answer is left to the restart, whose next_rendezvous() opens it anyway."""
        if self._announced == rnd:
            return
        self._announced = rnd
        with self._view.mutex:
            try:
                held = self._view.round if self._view.current_round() == rnd else None
            except RendezvousDataError:
                held = None  # not a round number: the restart's next_rendezvous() says so
        if held is None:
            return  # another node opened the next round already
        try:
            opened, _ = self._client.compare_and_put(self.keys.round, str(rnd + 1).encode(),
                                                     expected_mod_revision=held.mod_revision)
        except EtcdUnavailableError as exc:
            log.info("node %s round %d: could not open round %d at once: %s", self.settings.node_id, rnd, rnd + 1, exc)
            return
        if opened:
            log.info("node %s round %d: opened round %d for the members to re-form", self.settings.node_id, rnd,
                     rnd + 1)

    # ---- the protocol -------------------------------------------------------
    def _io(self, fn, *args):
        try:
            return fn(*args)
        except EtcdUnavailableError as exc:
            raise RendezvousConnectionError(str(exc)) from exc

    def _retrying(self, fn, deadline: float):
        """Run fn(deadline); while etcd is unreachable, retry with jittered backoff until the deadline,
        saying every 10 s what it waits for."""
        backoff: Backoff | None = None  # made at the first failure: most calls succeed at once
        first: float | None = None
        said = 0.0
        while True:
            try:
                return fn(deadline)
            except EtcdUnavailableError as exc:
                lease_gone = isinstance(exc, LeaseGoneError)
                if lease_gone:
                    # etcd answers; this node's lease expired (a long outage, a starved process) or was
                    # revoked (evicted): register again at once rather than wait for the lease thread's beat
                    before = self._lease.lease_id
                    try:
                        self._lease.check_now()
                    except EtcdUnavailableError:
                        pass
                    if self._lease.lease_id != before:
                        continue  # registered again under a new lease: retry at once
                now = self._clock()
                backoff = backoff or Backoff(base_s=0.2, cap_s=2.0, rng=self._rng)
                wait = backoff.next()
                if now + wait >= deadline:
                    raise RendezvousConnectionError(str(exc)) from exc
                first = now if first is None else first
                if not lease_gone and now - said >= 10.0:
                    said = now
                    log.warning("node %s: waiting for etcd (%.0f s so far): %s", self.settings.node_id,
                                now - first, exc)
                time.sleep(wait)

    def _start(self) -> None:
        """Lease and alive key (refused for a node id another live agent holds), the job's claim on the run
        (refused for another job's live run), then the view (each once; a failed step is retried by the caller)."""
        if self._lease.conflict is not None:
            raise self._lease.conflict
        fingerprint = self.settings.fingerprint
        if not self._lease_started:  # the view's first read, the claim and round 0 go with the alive key: one request
            first = not self._started
            self._lease.start(read=self._view.first_read() if first else None,
                              when=self._with_registration if first else None)
            self._lease_started = True
            outcomes, revision, lease_id = self._lease.take_outcomes()  # lease_id: the one round 0's join is on (not
            if outcomes:  # lease_id(): the lease thread may have granted another one since)
                self._claimed = outcomes[0] if fingerprint else None
                self._rounds.opened(outcomes[-1], lease_id, revision)
        if fingerprint and not self._started:
            try:
                claim_run(self._client, self.keys, fingerprint, self.settings.node_id, ahead=self._claimed)
            except RunInUseError:
                self.leave()  # nothing of this node stays in the other job's run
                raise
            self._claimed = None
        self._view.start(self._lease.take_read())
        self._started = True

    def _with_registration(self, lease_id: int) -> tuple[IfAbsent, ...]:
        """What a first registration's request also does (NodeLease.start's `when`): the job's claim on the run, and
        round 0 with this node's join where the run has none (and, for a launched job, no fingerprint either: another
        job's run may be left with no round, and nothing of this node is put there before the claim is checked), or this
        node's join of round 0 where that round is open (for a launched job, in a run that held this job's fingerprint
        before the request)."""
        fingerprint = self.settings.fingerprint
        if not fingerprint:
            return (self._rounds.opening(lease_id),)
        keys = self.keys
        return claim_ahead(keys, fingerprint), self._rounds.opening(lease_id, absent=(keys.fingerprint,),
                                                                    held=((keys.fingerprint, fingerprint.encode()),))

    def _formed(self, m: Membership) -> None:
        """A round formed with this node: the view counts its members alive and from now on follows the alive/
        changes of its ring and the smallest (ranks 0 and 1: every one; until then it knew only who left), then the
        monitor remembers them."""
        self._view.members_formed(m.nodes, m.revision)
        self._monitor.formed(m.round, m.nodes, m.incarnations)

    def _evict(self, peer) -> None:
        log.info("node %s: node %s's agent is gone (liveness connection closed, then refused); evicting it",
                 self.settings.node_id, peer.node)
        self._client.revoke_lease(peer.lease)

    def _watch_neighbours(self, names: list[str], found: Mapping[str, KeyValue | None]) -> None:
        """Hold connections to the ring neighbours' liveness listeners (`names`; their alive/ keys as read with
        the round: the view may not hold their values): a dead agent is evicted the moment its connections
        close; its other neighbour and ranks 0 and 1 see it through etcd, and the rest when `round` moves."""
        peers = [p for n in names if (kv := found.get(self.keys.alive(n))) is not None
                 and (p := parse_peer(n, kv.value, kv.lease)) is not None]
        if self._peer_watch is None:
            if not peers:
                return
            self._peer_watch = PeerWatch(self._evict)
        self._peer_watch.watch(peers)
