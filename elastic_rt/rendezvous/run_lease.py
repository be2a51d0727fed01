"""The run's lease: the workers' c10d store keys of each round are put on it, so that they vanish by themselves at
most its TTL after the run's last agent stopped (a killed job leaves nothing behind for long)."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous.etcd_client import EtcdClient, GuardedPut, KeyValue, Put
from elastic_rt.rendezvous.keys import RunKeys

log = logging.getLogger(__name__)


def lease_of(kv: KeyValue | None) -> int:
    """The run lease's id from its key (0: no key, or not elastic-rt's)."""
    if kv is None:
        return 0
    try:
        value = json.loads(kv.value.decode()).get("id")
    except (UnicodeDecodeError, ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0


class RunLease:
    """One lease per run, shared by its agents: its id is in the key `lease`, which lives on the lease itself.
    The node that closes a round makes sure the lease exists with the final it writes (claim() before, settle()
    after: a lease granted before and its key put in the final's transaction), so the round's members find its key
    with the final and grant nothing; a member that still finds no lease (its key
    ran out meanwhile) grants one (create-only; a loser revokes its own and takes the winner's); the member
    ranked 0 keeps it alive, a keep-alive every ttl_s / 3 (beat() is called often and
    sends only when one is due). A lease that ran out during a long etcd outage is granted anew by rank 0; store
    writes that meet the old one fall back to no lease (EtcdStore)."""

    def __init__(self, client: EtcdClient, keys: RunKeys, *, ttl_s: float, wait_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._keys = keys
        self.ttl_s = ttl_s
        self._wait_s = wait_s  # a keep-alive's wait for its answer: beat() runs on the node lease's own thread
        self._clock = clock
        self._lock = threading.Lock()
        self.lease_id = 0
        self._keeper = False
        self._due = 0.0
        self._granted = 0  # a lease granted by claim() whose key is not settled yet
        self._claimed: GuardedPut | None = None

    def adopt(self, kv: KeyValue | None, *, keeper: bool, known: bool = True) -> int:
        """The lease to put this round's store keys on, given the `lease` key as of the round's final (granted here
        when there is none); `keeper`: this node is the round's rank 0. `known=False`: `kv` is not known (this node
        wrote the final and its view has not delivered it yet): the lease it claimed with the final (claim(), settle()), or
        one read now. Raises EtcdUnavailableError."""
        with self._lock:
            self._keeper = keeper
            if known:
                self.lease_id = self._named_or_granted(kv)
            elif not self.lease_id:
                self.lease_id = self._found_or_granted()
            self._drop_claim()
            self._due = self._clock() + self.ttl_s / 3
            return self.lease_id

    def ensure(self, known: Callable[[], KeyValue | None]) -> None:
        """The run's lease and its key exist (granted here when absent), unless this node already holds the run's
        lease; this node holds it from then on: claim(), and the claim's put on its own. Raises
        EtcdUnavailableError."""
        if self.claim(known) is not None:
            self.settle(None)

    def claim(self, known: Callable[[], KeyValue | None]) -> GuardedPut | None:
        """Before this node writes a round's final: None when this node holds the run's lease, or `known()` (the
        `lease` key as this node's membership view has it: no read) names one, which it holds from then on; else a
        lease granted now (once: a claim not settled yet is claimed again) and the put of its key, to go in the
        final's transaction (EtcdClient.create_with). Tell settle() what came of it. A view a little behind costs at
        most a grant that loses the create-only put and is revoked. Raises EtcdUnavailableError."""
        with self._lock:
            if self.lease_id:
                return None
            kv = known()
            named = lease_of(kv)
            if named:
                self.lease_id = named
                return None
            return self._claim_new(kv)

    def _claim_new(self, kv: KeyValue | None) -> GuardedPut:
        """A lease granted now (or the one an unsettled claim holds) and the create-only put of its key over `kv`."""
        if not self._granted:
            self._granted = self._client.grant_lease(self.ttl_s)
        self._claimed = GuardedPut(Put(self._keys.run_lease, json.dumps({"id": self._granted}).encode(),
                                       self._granted), kv.mod_revision if kv is not None else None)
        return self._claimed

    def settle(self, outcome: tuple[bool, KeyValue | None] | None) -> None:
        """What came of the last claim's put: (made, the `lease` key after it) from the final's transaction; None when
        the final was not written (another node's was there), and the put is made now, on its own. A lost put
        revokes the lease granted for it and takes the one the key names. Raises EtcdUnavailableError."""
        with self._lock:
            self._settle(outcome)

    def _settle(self, outcome: tuple[bool, KeyValue | None] | None) -> None:
        claimed, mine = self._claimed, self._granted
        if claimed is None or not mine:
            return
        if outcome is None:
            outcome = self._client.compare_and_put(claimed.put.key, claimed.put.value, lease=mine,
                                                   expected_mod_revision=claimed.expected_mod_revision)
        self._claimed, self._granted = None, 0
        ok, kv = outcome
        if ok:
            self.lease_id = mine
            return
        self._client.revoke_lease(mine)
        self.lease_id = lease_of(kv)

    def _drop_claim(self) -> None:
        """A claim never settled (its final's request failed, and a final came from elsewhere): its lease, unless the
        run's, is revoked (best effort: with nothing on it, it runs out by itself)."""
        mine, self._granted, self._claimed = self._granted, 0, None
        if mine and mine != self.lease_id:
            try:
                self._client.revoke_lease(mine)
            except EtcdUnavailableError:
                pass

    def _found_or_granted(self) -> int:
        """The lease named by the `lease` key as read now; granted here when the key names none."""
        kv, _ = self._client.get(self._keys.run_lease)
        return self._named_or_granted(kv)

    def _named_or_granted(self, kv: KeyValue | None) -> int:
        """The lease `kv` (the `lease` key) names; else a claim settled at once: granted here, its key put
        create-only (a loser revokes its own and takes the winner's)."""
        named = lease_of(kv)
        if named:
            return named
        self._claim_new(kv)
        self._settle(None)
        return self.lease_id

    def beat(self) -> None:
        """Rank 0 only: a keep-alive when one is due; a lease found gone is granted anew. Never raises.

        It runs on the node lease's thread (NodeLease's on_beat), so it waits at most `wait_s` for an answer: a busy
        etcd renews on the request and answers late, and waiting for that answer (up to a request deadline) held back
        the node lease's next beats until its TTL ran out. No answer yet: the next beat sends another keep-alive (etcd
        answers each; a late one that says the lease lives counts)."""
        with self._lock:
            if not self._keeper or self.lease_id == 0 or self._clock() < self._due:
                return
            try:
                renewal = self._client.keep_alive(self.lease_id, every_s=self._wait_s, silent_s=float("inf"))
                if renewal is None:
                    return
                if renewal.ttl <= 0:
                    log.info("run %s: its lease ran out (a long etcd outage?); granting a new one",
                             self._keys.run_id)
                    self.lease_id = self._found_or_granted()
            except EtcdUnavailableError as exc:
                log.debug("run %s: run lease keep-alive failed: %s", self._keys.run_id, exc)
                return
            self._due = self._clock() + self.ttl_s / 3
