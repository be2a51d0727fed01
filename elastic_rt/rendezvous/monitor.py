"""Whether this node's running group must re-form, decided from local state only (the membership view,
this node's etcd reachability, its liveness evidence): the monitor tick costs etcd nothing."""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

from elastic_rt.rendezvous.etcd_client import KeyValue
from elastic_rt.rendezvous.health import EtcdHealth
from elastic_rt.rendezvous.view import MembershipView

log = logging.getLogger(__name__)


def incarnation(kv: KeyValue) -> str | None:
    """The agent process behind an alive/ key (it stays the same when the agent registers again)."""
    try:
        return json.loads(kv.value.decode()).get("incarnation")
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None


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
        self._incarnations: dict[str, str | None] = {}
        self._formed_at = 0.0
        self._quiet: tuple | None = None  # the state last found to need nothing
        self._reported: str | None = None

    def formed(self, rnd: int, nodes: tuple[str, ...]) -> None:
        """A round formed with `nodes`: remember their incarnations (the view's lock must not be held)."""
        with self._view.lock:
            self._incarnations = {n: incarnation(kv) for n in nodes if (kv := self._view.alive.get(n))}
        self._round, self._nodes = rnd, nodes
        self._formed_at = self._clock()
        self._quiet = None
        self._reported = None

    def change(self) -> str | None:
        """"round_advanced", "peer_lost", "scale_up" or None (also None before a round formed)."""
        if not self._nodes:
            return None
        v = self._view
        with v.lock:
            state = (v.version, self._renewals_lost(), self._health.last_recovery())
            if state == self._quiet:
                return None
            rnd = v.current_round()
            if rnd is not None and rnd > self._round:
                return "round_advanced"
            lost, pending = self._lost_peer()
            if lost is not None:
                return "peer_lost"
            if len(self._nodes) < self._max_nodes and any(
                node in v.alive and node not in self._nodes for node in v.waiting
            ):
                return "scale_up"
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
            if kv is not None:
                if node not in self._incarnations:  # not in the view yet when the round formed
                    self._incarnations[node] = incarnation(kv)
                    continue
                known = self._incarnations.get(node)
                if known is not None and incarnation(kv) not in (None, known):
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
