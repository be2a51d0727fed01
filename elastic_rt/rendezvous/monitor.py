"""Whether this node's running group must re-form, decided from local state only (the membership view,
this node's etcd reachability, its liveness evidence): the monitor tick costs etcd nothing."""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

from elastic_rt.decisions import RestartReason
from elastic_rt.rendezvous.etcd_client import KeyValue
from elastic_rt.rendezvous.etcd_reachability import EtcdHealth
from elastic_rt.rendezvous.view import MembershipView

log = logging.getLogger(__name__)


def incarnation(kv: KeyValue) -> str | None:
    """The agent process behind an alive/ or join key (it stays the same when the agent registers again)."""
    try:
        inc = json.loads(kv.value.decode()).get("incarnation")
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None
    return inc if isinstance(inc, str) else None


class MembershipMonitor:
    """The peer-loss rules of handler.py's docstring, for one round at a time.

    `dead(node)` is the liveness evidence (PeerWatch); `renewals_lost()` counts this node's
    own lease losses (a new one means: look again). Answers are cached per view version
    unless a member is inside its grace period, where time alone can change the answer.
    """

    def __init__(self, *, node_id: str, view: MembershipView, health: EtcdHealth, lease_ttl_s: float,
                 grace_s: float, max_nodes: int, dead: Callable[[str], bool], renewals_lost: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._node_id = node_id
        self._view = view
        self._health = health
        self._ttl_s = lease_ttl_s
        self._grace_s = grace_s
        self._max_nodes = max_nodes
        self._dead = dead
        self._renewals_lost = renewals_lost
        self._clock = clock
        self._round = -1
        self._nodes: tuple[str, ...] = ()
        self._incarnations: dict[str, str] = {}
        self._seen: dict[str, KeyValue | None] = {}  # the alive/ value last checked, per member
        self._restarted: set[str] = set()
        self._formed_at = 0.0
        self._quiet: tuple | None = None  # the state last found to need nothing
        self._reported: str | None = None

    def formed(self, rnd: int, nodes: tuple[str, ...], incarnations: tuple[str | None, ...] = ()) -> None:
        """A round formed with `nodes` whose agents are `incarnations` (from the final; None: unknown, then
        the first alive/ value seen counts). The view's lock must not be held. Costs no JSON decoding
        per member: an alive/ value is decoded only when it changes."""
        with self._view.mutex:
            self._seen = dict(zip(nodes, map(self._view.alive.get, nodes)))
        self._incarnations = {n: i for n, i in zip(nodes, incarnations) if i is not None}
        self._restarted = set()
        self._round, self._nodes = rnd, nodes
        self._formed_at = self._clock()
        self._quiet = None
        self._reported = None

    def change(self) -> RestartReason | None:
        """ROUND_ADVANCED, PEER_LOST, SCALE_UP or None (also None before a round formed)."""
        if not self._nodes:
            return None
        v = self._view
        with v.mutex:
            state = (v.version, self._renewals_lost(), self._health.last_recovery())
            if state == self._quiet:
                return None
            # a lost member first: the node that noticed first may already have opened the next round, and
            # this node's group is as broken as its (it stops at once, and the restart says what happened)
            lost, pending = self._lost_peer()
            if lost is not None:
                return RestartReason.PEER_LOST
            rnd = v.current_round()
            if rnd is not None and rnd > self._round:
                return RestartReason.ROUND_ADVANCED
            # a waiting/ key is on its node's lease: proof of life (the view may not have read its alive/ key)
            if len(self._nodes) < self._max_nodes and any(node not in self._nodes for node in v.waiting):
                return RestartReason.SCALE_UP
            self._quiet = None if pending else state
            return None

    def _lost_peer(self) -> tuple[str | None, bool]:
        """(a lost member or None, whether a member is missing but still in its grace period).
        The caller holds the view's lock."""
        v, now = self._view, self._clock()
        pending = False
        for node in self._nodes:
            if node == self._node_id:
                continue
            kv = v.alive.get(node)
            if node in self._restarted:
                return self._lost(node, "its agent restarted (new incarnation)"), False
            if kv is not None:
                if kv is not self._seen.get(node):  # a new value: the node registered again
                    self._seen[node] = kv
                    inc, known = incarnation(kv), self._incarnations.get(node)
                    if known is None and inc is not None:
                        self._incarnations[node] = inc
                    elif inc not in (None, known):
                        self._restarted.add(node)
                        return self._lost(node, "its agent restarted (new incarnation)"), False
                continue
            if self._dead(node):
                return self._lost(node, "lease gone and its liveness connection closed"), False
            gone_at = v.departed.get(node, self._formed_at)
            if not self._health.unreachable_since(gone_at - self._ttl_s):
                return self._lost(node, "lease gone while etcd answered this node"), False
            since = max(gone_at, self._health.last_recovery() or gone_at)
            if now - since > self._grace_s:
                return self._lost(node, f"not registered again within {self._grace_s:g} s after the etcd outage"), False
            pending = True
        return None, pending

    def _lost(self, node: str, why: str) -> str:
        if self._reported != node:
            self._reported = node
            log.warning("node %s round %d: node %s lost: %s", self._node_id, self._round, node, why)
        return node
