"""elastic-rt's rendezvous on etcd v3: lease-based membership, one key per node per round.

Protocol (keys from RunKeys):
  round            current round number R (created as 0)
  rounds/R/join/N  node N's join, attached to N's lease (vanishes when N dies)
  rounds/R/final   the membership of round R, written once by whoever closes it
  alive/N          node N's liveness key, attached to its lease, for the whole run
  waiting/N        a node that found round R already closed and waits for R+1
  closed           the job is over; late joiners exit instead of waiting

A round closes when MAX nodes joined, or when at least MIN joined and either
every live node (alive/*) has joined (re-formation rounds, R > 0: no last call
needed) or last_call_timeout_s passed since MIN were seen. A node of round R
that must re-rendezvous bumps `round` from R to R+1 by compare-and-set. Each
node writes O(1) keys per round; nobody rewrites a shared blob.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastic_rt.errors import EtcdUnavailableError, RendezvousDataError
from elastic_rt.rendezvous.etcd_client import EtcdClient, KeyValue
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.lease import NodeLease
from elastic_rt.rendezvous.liveness import PeerWatch, parse_peer, process_is_gone, ring_neighbours
from elastic_rt.rendezvous.store import EtcdStore

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Membership:
    """The outcome of one round, from this node's point of view."""

    round: int
    nodes: tuple[str, ...]
    rank: int


def _decode_json(kv: KeyValue, what: str) -> dict:
    try:
        value = json.loads(kv.value.decode())
        if not isinstance(value, dict):
            raise ValueError("not an object")
        return value
    except (UnicodeDecodeError, ValueError) as exc:
        raise RendezvousDataError(
            f"etcd key {kv.key} ({what}) holds {len(kv.value)} bytes that elastic-rt did not write "
            f"({exc}); remove the run's keys with `etcdctl del --prefix {kv.key.rsplit('/rounds/', 1)[0]}/` "
            "or use a new --rdzv-id"
        ) from exc


def _decode_round(kv: KeyValue | None) -> int | None:
    if kv is None:
        return None
    text = kv.value.decode(errors="replace")
    if not text.isdigit():
        raise RendezvousDataError(
            f"etcd key {kv.key} holds {kv.value[:32]!r}, not a round number; "
            "remove it (`etcdctl del` that key) or use a new --rdzv-id"
        )
    return int(text)


class EtcdRendezvousHandler(RendezvousHandler):
    """torch.distributed.elastic RendezvousHandler backed by etcd v3 leases and watches."""

    def __init__(self, client: EtcdClient, settings: RendezvousSettings) -> None:
        self._client = client
        self.settings = settings
        self.keys = RunKeys(settings.run_id)
        self._lease = NodeLease(
            client, self.keys, settings.node_id, ttl_s=settings.lease_ttl_s,
            info={"addr": settings.local_addr},
        )
        self._lease_started = False
        self._probed: dict[str, float] = {}
        self._peer_watch: PeerWatch | None = None
        self.membership: Membership | None = None

    # ---- RendezvousHandler API -------------------------------------------
    def get_backend(self) -> str:
        return "etcd-v3"

    def get_run_id(self) -> str:
        return self.settings.run_id

    def is_closed(self) -> bool:
        kv, _ = self._io(self._client.get, self.keys.closed)
        return kv is not None

    def set_closed(self) -> None:
        self._io(self._client.put, self.keys.closed, json.dumps({"by": self.settings.node_id}).encode())

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
        self._client.close()

    def leave(self) -> None:
        """Give up this node's liveness now, so peers re-form without waiting for the lease TTL."""
        if self._peer_watch is not None:
            self._peer_watch.stop()
            self._peer_watch = None
        if self._lease_started:
            self._lease.stop(revoke=True)
            self._lease_started = False

    def num_nodes_waiting(self) -> int:
        return 1 if self.membership_change() else 0

    def next_rendezvous(self) -> RendezvousInfo:
        t0 = time.monotonic()
        self.membership = self._retrying(self._next_round, t0 + self.settings.join_timeout_s)
        m = self.membership
        store = EtcdStore(self._client, self.keys.round_store(m.round),
                          timedelta(seconds=self.settings.store_timeout_s))
        bootstrap = self._io(RendezvousStoreInfo.build, m.rank, store, self.settings.local_addr)
        try:
            self._watch_neighbours(m.nodes)
        except EtcdUnavailableError as exc:
            log.warning("node %s: not watching neighbours this round: %s", self.settings.node_id, exc)
        if m.rank == 0 and m.round >= 2:  # rounds before the previous one are history
            self._io(self._client.delete_range, self.keys.rounds_prefix, self.keys.round_prefix(m.round - 1))
        log.info(
            "node %s round %d: rank %d of %d nodes (%s) in %.2f s",
            self.settings.node_id, m.round, m.rank, len(m.nodes), ",".join(m.nodes), time.monotonic() - t0,
        )
        return RendezvousInfo(store, m.rank, len(m.nodes), bootstrap)

    # ---- membership watching (used by the agent's monitor loop) ------------
    def membership_change(self) -> str | None:
        """Why this node's current group must re-form, or None.

        "round_advanced": another node started a new round; "peer_lost": a node of
        this round lost its lease; "scale_up": nodes wait to join and there is room.
        """
        m = self.membership
        if m is None:
            return None
        k = self.keys
        (rnd_kv,), (alive, waiting), _ = self._io(
            self._client.read_many, [k.round], [k.alive_prefix, k.waiting_prefix]
        )
        rnd = _decode_round(rnd_kv)
        if rnd is not None and rnd > m.round:
            return "round_advanced"
        alive_nodes = {kv.key[len(k.alive_prefix):] for kv in alive}
        if any(node not in alive_nodes for node in m.nodes):
            return "peer_lost"
        if len(m.nodes) < self.settings.max_nodes and any(
            kv.key[len(k.waiting_prefix):] in alive_nodes for kv in waiting
        ):
            return "scale_up"
        return None

    # ---- the protocol -------------------------------------------------------
    def _io(self, fn, *args):
        try:
            return fn(*args)
        except EtcdUnavailableError as exc:
            raise RendezvousConnectionError(str(exc)) from exc

    def _retrying(self, fn, deadline: float):
        """Run fn(deadline); while etcd is unreachable, retry until the join deadline."""
        warned = False
        while True:
            try:
                return fn(deadline)
            except EtcdUnavailableError as exc:
                if time.monotonic() + 1.0 >= deadline:
                    raise RendezvousConnectionError(str(exc)) from exc
                if not warned:
                    log.warning("node %s: %s; retrying until the join timeout", self.settings.node_id, exc)
                    warned = True
                time.sleep(1.0)

    def _ensure_lease(self) -> None:
        if not self._lease_started:
            self._lease.start()
            self._lease_started = True

    def _next_round(self, deadline: float) -> Membership:
        s, k, c = self.settings, self.keys, self._client
        previous = self.membership
        self._ensure_lease()
        while True:
            self._check_deadline(deadline)
            (rnd_kv, closed), _, rev = c.read_many([k.round, k.closed], [])
            if closed is not None:
                raise RendezvousClosedError(f"run {s.run_id} is closed (the job finished); use a new --rdzv-id")
            rnd = _decode_round(rnd_kv)
            if rnd is None:
                c.compare_and_put(k.round, b"0", expected_mod_revision=None)
                continue
            final, _ = c.get(k.final(rnd))
            if final is not None:
                _decode_json(final, "round membership")  # foreign data: one clear error, no waiting
            if final is None:
                result = self._join_and_wait(rnd, deadline)
                if result is not None:
                    c.delete(k.waiting(s.node_id))
                    return result
                continue  # round closed without us: wait for the next one
            if previous is not None and previous.round == rnd:
                # Our own round is over: open the next one (one of the racing nodes wins).
                c.compare_and_put(k.round, str(rnd + 1).encode(), expected_mod_revision=rnd_kv.mod_revision)
                continue
            # Round rnd runs without us: ask its members to make room, wait for rnd + 1.
            c.put(k.waiting(s.node_id), b"", lease=self._lease.lease_id)
            log.info("node %s: round %d is running; waiting for the next round", s.node_id, rnd)
            c.wait_for_change(k.round, after_revision=rev, timeout_s=max(0.0, deadline - time.monotonic()))

    def _join_and_wait(self, rnd: int, deadline: float) -> Membership | None:
        s, k, c = self.settings, self.keys, self._client
        c.put(k.join(rnd, s.node_id), json.dumps({"addr": s.local_addr}).encode(), lease=self._lease.lease_id)
        min_seen_at: float | None = None
        while True:
            (final, rnd_kv, closed), (joins, alive), rev = c.read_many(
                [k.final(rnd), k.round, k.closed], [k.join_prefix(rnd), k.alive_prefix]
            )
            if closed is not None:
                c.delete(k.join(rnd, s.node_id))
                raise RendezvousClosedError(f"run {s.run_id} is closed (the job finished); use a new --rdzv-id")
            if final is not None:
                nodes = tuple(_decode_json(final, "round membership").get("nodes", ()))
                if s.node_id in nodes:
                    return Membership(rnd, nodes, nodes.index(s.node_id))
                c.delete(k.join(rnd, s.node_id))
                return None
            if _decode_round(rnd_kv) != rnd:
                c.delete(k.join(rnd, s.node_id))
                return None
            joined = [kv.key[len(k.join_prefix(rnd)):] for kv in sorted(joins, key=lambda kv: kv.create_revision)]
            if s.node_id not in joined:  # our lease was lost and re-granted: join again
                c.put(k.join(rnd, s.node_id), json.dumps({"addr": s.local_addr}).encode(), lease=self._lease.lease_id)
                continue
            now = time.monotonic()
            if len(joined) >= s.min_nodes and min_seen_at is None:
                min_seen_at = now
            alive_nodes = {kv.key[len(k.alive_prefix):] for kv in alive}
            if rnd > 0 and self._evict_dead(alive, set(joined)):
                continue
            wait_s = deadline - now
            if len(joined) >= s.max_nodes:
                close = True
            elif len(joined) >= s.min_nodes:
                everyone = rnd > 0 and alive_nodes <= set(joined)
                last_call_left = min_seen_at + s.last_call_timeout_s - now
                close = everyone or last_call_left <= 0
                wait_s = min(wait_s, max(last_call_left, 0.0))
            else:
                close = False
            if close:
                members = joined[: s.max_nodes]
                c.compare_and_put(
                    k.final(rnd), json.dumps({"round": rnd, "nodes": members}).encode(), expected_mod_revision=None
                )
                continue
            self._check_deadline(deadline, cleanup_key=k.join(rnd, s.node_id))
            c.wait_for_change(k.base, after_revision=rev, timeout_s=max(wait_s, 0.01), prefix=True)

    def _evict_dead(self, alive: list[KeyValue], joined: set[str]) -> bool:
        """Revoke the lease of live-looking nodes whose agent process is gone (checked at most
        once a second each), so a re-forming round need not wait for their TTL."""
        evicted = False
        now = time.monotonic()
        for kv in alive:
            node = kv.key[len(self.keys.alive_prefix):]
            if node in joined or now - self._probed.get(node, 0.0) < 1.0:
                continue
            self._probed[node] = now
            peer = parse_peer(node, kv.value, kv.lease)
            if kv.lease and peer is not None and process_is_gone(peer):
                self._evict(peer)
                evicted = True
        return evicted

    def _evict(self, peer) -> None:
        log.info("node %s: node %s's agent is gone (liveness port closed); evicting it",
                 self.settings.node_id, peer.node)
        self._client.revoke_lease(peer.lease)

    def _watch_neighbours(self, nodes: tuple[str, ...]) -> None:
        """Hold connections to the ring neighbours' liveness listeners: a dead agent is evicted
        the moment its connections close, and the other nodes see it through etcd."""
        names = ring_neighbours(nodes, self.settings.node_id)
        if not names:
            if self._peer_watch is not None:
                self._peer_watch.watch([])
            return
        _, (alive,), _ = self._client.read_many([], [self.keys.alive_prefix])
        peers = []
        for kv in alive:
            node = kv.key[len(self.keys.alive_prefix):]
            if node in names and (peer := parse_peer(node, kv.value, kv.lease)) is not None:
                peers.append(peer)
        if self._peer_watch is None:
            self._peer_watch = PeerWatch(self._evict)
        self._peer_watch.watch(peers)

    def _check_deadline(self, deadline: float, cleanup_key: str | None = None) -> None:
        if time.monotonic() < deadline:
            return
        if cleanup_key:
            self._client.delete(cleanup_key)
        s = self.settings
        raise RendezvousTimeoutError(
            f"rendezvous {s.run_id} did not gather {s.min_nodes} node(s) within "
            f"{s.join_timeout_s:g} s (join_timeout); are the other nodes started with the same --rdzv-id?"
        )
