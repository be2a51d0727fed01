"""The round protocol of the etcd-v3 rendezvous (handler.py's docstring describes it): join the current
round or wait for the next, close a round, read its final; every decision made on the local view."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError
from torch.distributed.elastic.utils.distributed import get_free_port

from elastic_rt.errors import RendezvousDataError
from elastic_rt.rendezvous.etcd_client import EtcdClient, KeyValue
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.monitor import incarnation
from elastic_rt.rendezvous.view import MembershipView

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
    metrics_addr: str | None = None  # host:port of the agent's /metrics, advertised in alive/ (None: not served)

    @property
    def reregister_grace_s(self) -> float:
        """After an etcd outage, how long a peer whose lease expired has to register again: one TTL
        for its beats to find the lease gone, the keepalive backoff cap, one more beat."""
        return self.lease_ttl_s + 2.0 + self.lease_ttl_s / 3


@dataclass(frozen=True)
class Membership:
    """The outcome of one round, from this node's point of view."""

    round: int
    nodes: tuple[str, ...]
    rank: int
    master: tuple[str, int] | None = None  # rank 0's address and store port, when the final carries them
    incarnations: tuple[str | None, ...] = ()  # each member's agent process, as its join said (None: unknown)
    revision: int = 0  # the final's mod_revision: every member was alive then


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


class Rounds:
    """Rounds as this node takes part in them; `lease_id()` is the current lease to attach its keys to,
    `incarnation` this agent process's (its joins carry it, the final lists the members'), `on_formed(membership)`
    is told of every round it becomes a member of."""

    def __init__(self, client: EtcdClient, keys: RunKeys, settings: RendezvousSettings, view: MembershipView, *,
                 lease_id: Callable[[], int], on_formed: Callable[[Membership], None], incarnation: str = "",
                 clock: Callable[[], float] = time.monotonic, rng: Callable[[], float]) -> None:
        self._client = client
        self.keys = keys
        self.settings = settings
        self._view = view
        self._lease_id = lease_id
        self._on_formed = on_formed
        self._incarnation = incarnation
        self._clock = clock
        self._rng = rng

    def next_round(self, previous: Membership | None, deadline: float) -> Membership:
        """Join the current round (or wait for the next one) until a round forms with this node.
        Raises EtcdUnavailableError (the caller retries), RendezvousClosedError, RendezvousTimeoutError."""
        s, k, c, v = self.settings, self.keys, self._client, self._view
        said_waiting = None
        while True:
            self._check_deadline(deadline)
            with v.lock:
                version, closed, rnd_kv = v.version, v.closed, v.round
                rnd = v.current_round()
                final = v.finals.get(rnd) if rnd is not None else None
                waiting = v.waiting.get(s.node_id)
            if closed:
                raise RendezvousClosedError(f"run {s.run_id} is closed (the job finished); use a new --rdzv-id")
            if rnd is None:
                c.compare_and_put(k.round, b"0", expected_mod_revision=None)
                v.wait_for(lambda: v.round is not None, 1.0)
                continue
            if final is not None:
                _decode_json(final, "round membership")  # foreign data: one clear error, no waiting
            if final is None:
                result = self._join_and_wait(rnd, deadline)
                if result is not None:
                    if waiting is not None or s.node_id in v.waiting:
                        c.delete(k.waiting(s.node_id))
                    return result
                continue  # round closed without us: wait for the next one
            if previous is not None and previous.round == rnd:
                # Our own round is over: open the next one (one of the racing nodes wins).
                c.compare_and_put(k.round, str(rnd + 1).encode(), expected_mod_revision=rnd_kv.mod_revision)
                v.wait_for(lambda: v.current_round() != rnd, 1.0)
                continue
            # Round rnd runs without us: ask its members to make room, wait for rnd + 1.
            if waiting is None or waiting.lease != self._lease_id():
                c.put(k.waiting(s.node_id), b"", lease=self._lease_id())
            if said_waiting != rnd:
                said_waiting = rnd
                log.info("node %s: round %d is running; waiting for the next round", s.node_id, rnd)
            v.wait(version, max(0.0, min(deadline - self._clock(), 5.0)))

    def _join_and_wait(self, rnd: int, deadline: float) -> Membership | None:
        """Join round rnd and wait for its final (or for the round to end without us).

        The closer is the live node with the smallest id: it alone watches the round's joins and
        writes the final (once, create-only). A node whose view does not follow alive/ puts (not yet a
        member of any round) may not know a smaller node that registered after its snapshot: it acts as
        the closer until it sees that node's join, then steps down (a second final write fails: it is
        create-only). The others watch only `round`, `closed` and the final;
        if no final comes, they read the joins every `fallback_s` (jittered) and close the round
        themselves once it has been closable for as long."""
        s, k, c, v = self.settings, self.keys, self._client, self._view
        value = json.dumps({"addr": s.local_addr, "incarnation": self._incarnation}).encode()
        fallback_s = max(2.0, s.last_call_timeout_s)
        tracker: MembershipView | None = None
        read: dict[str, KeyValue] | None = None  # joins as last read by a node that is not the closer
        read_due = self._clock() + fallback_s * (1 + self._rng())
        closable_since: float | None = None
        min_seen_at: float | None = None
        joined_with = 0  # the lease our join key is attached to
        written: KeyValue | None = None  # the final as our own create-only write returned it
        smaller: str | None = None  # a node with a smaller id, learnt from its join while we acted as closer
        asked_at = 0  # the view's read count when it was asked to read again for `smaller`
        try:
            while True:
                with v.lock:
                    version = v.version, tracker.version if tracker else 0
                    closed, cur, final = v.closed, v.current_round(), v.finals.get(rnd) or written
                    closer = v.smallest_alive or s.node_id
                    # `smaller` stands until it leaves or, for a view that watches the smallest node only, until
                    # the view has read again (it then watches a live smaller node, or knows there is none)
                    if smaller is not None and (smaller in v.departed or (not v.alive_puts and v.reloads > asked_at)):
                        smaller = None
                    closer = min(closer, smaller) if smaller is not None else closer
                if closed:
                    self._unjoin(rnd, joined_with)
                    raise RendezvousClosedError(f"run {s.run_id} is closed (the job finished); use a new --rdzv-id")
                if final is not None:
                    data = _decode_json(final, "round membership")
                    nodes = tuple(data.get("nodes", ()))
                    if s.node_id not in nodes:
                        self._unjoin(rnd, joined_with)
                        return None
                    master = data.get("master")
                    master = (str(master[0]), int(master[1])) if isinstance(master, list) and len(master) == 2 else None
                    incs = data.get("incarnations")
                    incs = tuple(i if isinstance(i, str) else None for i in incs) \
                        if isinstance(incs, list) and len(incs) == len(nodes) else (None,) * len(nodes)
                    m = Membership(rnd, nodes, nodes.index(s.node_id), master, incs, final.mod_revision)
                    self._on_formed(m)
                    return m
                if cur != rnd:
                    self._unjoin(rnd, joined_with)
                    return None
                lease = self._lease_id()
                if joined_with != lease:  # not joined yet, or our lease was lost and granted anew
                    c.put(k.join(rnd, s.node_id), value, lease=lease)
                    joined_with = lease
                now = self._clock()
                if closer == s.node_id:
                    if tracker is None:
                        # A re-formation closes when every live node joined: a closer whose view does not follow
                        # alive/ (not a member yet) has its tracker follow alive/ too (one node, O(N) events).
                        ranges = [k.join_range(rnd)] + ([k.alive_range] if rnd > 0 and not v.alive_puts else [])
                        tracker = MembershipView(c, k, node_id=s.node_id, ranges=ranges, lock=v.lock,
                                                 clock=self._clock)
                        tracker.start()
                        continue
                    with v.lock:
                        joins = dict(tracker.joins.get(rnd, {}))
                    lower = [n for n in joins if n < s.node_id]
                    if lower:
                        smaller = min(lower)
                        with v.lock:
                            asked_at = v.reloads
                        v.refresh()  # a view that watches the smallest node only: find it again
                        continue
                else:
                    if tracker is not None:  # a node with a smaller id is alive now: it closes
                        tracker.stop()
                        tracker = None
                    if now >= read_due or (closable_since is not None and now - closable_since >= fallback_s):
                        (kvs,), _ = c.read_ranges([k.join_range(rnd)])
                        read = {k.parse(kv.key)[2]: kv for kv in kvs}
                        read_due = now + fallback_s * (1 + self._rng())
                    joins = read or {}
                alive_view = v if v.alive_puts else tracker  # a view that follows every alive/ change, if any
                members, wait_s = self._closable(rnd, joins, now, min_seen_at, alive_view)
                if members is not None or len(joins) >= s.min_nodes:
                    min_seen_at = min_seen_at or now
                if members is None:
                    closable_since = None
                elif closer == s.node_id or (closable_since is not None and now - closable_since >= fallback_s):
                    final_value = {"round": rnd, "nodes": members,
                                   "incarnations": [incarnation(joins[n]) for n in members]}
                    if members[0] == s.node_id:  # rank 0 closes: its store address travels with the final
                        final_value["master"] = [s.local_addr, get_free_port()]
                    _, written = c.compare_and_put(k.final(rnd), json.dumps(final_value).encode(),
                                                   expected_mod_revision=None)
                    continue
                else:
                    closable_since = closable_since or now
                    wait_s = closable_since + fallback_s - now
                if closer != s.node_id:
                    wait_s = min(wait_s, read_due - now)
                wait_s = min(wait_s, deadline - now)
                self._check_deadline(deadline, cleanup_key=k.join(rnd, s.node_id))
                v.wait_for(lambda: (v.version, tracker.version if tracker else 0) != version, max(wait_s, 0.01))
        finally:
            if tracker is not None:
                tracker.stop()

    def _closable(self, rnd: int, joins: dict[str, KeyValue], now: float, min_seen_at: float | None,
                  alive_view: MembershipView | None) -> tuple[list[str] | None, float]:
        """(the members, in rank order, if round rnd can close on these joins now, else None; how long
        until the last call ends). Ranks follow node ids, so rank 0 stays put across rounds.
        `alive_view` follows every alive/ change (None: no view here does; then only MAX joins or the
        last call close a round)."""
        s, v = self.settings, self._view
        if s.node_id not in joins or len(joins) < s.min_nodes:
            return None, float("inf")
        with v.lock:
            # waiting/ nodes too: one that registered after this view's first read is not in `alive`
            everyone = (rnd > 0 and alive_view is not None and all(n in joins for n in alive_view.alive)
                        and all(n in joins for n in v.waiting))
        last_call_left = (min_seen_at or now) + s.last_call_timeout_s - now
        if len(joins) < s.max_nodes and not everyone and last_call_left > 0:
            return None, last_call_left
        first = sorted(joins, key=lambda n: joins[n].create_revision)[: s.max_nodes]
        return sorted(first), 0.0

    def _unjoin(self, rnd: int, joined_with: int) -> None:
        if joined_with:
            self._client.delete(self.keys.join(rnd, self.settings.node_id))

    def _check_deadline(self, deadline: float, cleanup_key: str | None = None) -> None:
        if self._clock() < deadline:
            return
        if cleanup_key:
            self._client.delete(cleanup_key)
        s = self.settings
        raise RendezvousTimeoutError(
            f"rendezvous {s.run_id} did not gather {s.min_nodes} node(s) within "
            f"{s.join_timeout_s:g} s (join_timeout); are the other nodes started with the same --rdzv-id?"
        )
