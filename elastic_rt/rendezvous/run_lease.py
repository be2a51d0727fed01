"""The run's lease: the workers' c10d store keys of each round are put on it, so that they vanish by themselves at
most its TTL after the run's last agent stopped (a killed job leaves nothing behind for long)."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous.etcd_client import EtcdClient, KeyValue
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
    The node that closes a round makes sure the lease exists before it writes the final (ensure()), so the
    round's members find its key with the final and grant nothing; a member that still finds no lease (its key
    ran out meanwhile) grants one (create-only; a loser revokes its own and takes the winner's); the member
    ranked 0 keeps it alive, a keep-alive every ttl_s / 3 (beat() is called often and
    sends only when one is due). A lease that ran out during a long etcd outage is granted anew by rank 0; store
    writes that meet the old one fall back to no lease (EtcdStore)."""

    def __init__(self, client: EtcdClient, keys: RunKeys, *, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._keys = keys
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self.lease_id = 0
        self._keeper = False
        self._due = 0.0

    def adopt(self, kv: KeyValue | None, *, keeper: bool, known: bool = True) -> int:
        """The lease to put this round's store keys on, given the `lease` key as of the round's final (granted here
        when there is none); `keeper`: this node is the round's rank 0. `known=False`: `kv` is not known (this node
        wrote the final and its view has not delivered it yet): the lease it made sure of before (ensure()), or
        one read now. Raises EtcdUnavailableError."""
        with self._lock:
            self._keeper = keeper
            if known:
                self.lease_id = self._named_or_granted(kv)
            elif not self.lease_id:
                self.lease_id = self._found_or_granted()
            self._due = self._clock() + self.ttl_s / 3
            return self.lease_id

    def ensure(self, known: Callable[[], KeyValue | None]) -> None:
        """Before this node writes a round's final: the run's lease and its key exist (granted here when
        absent), unless this node already holds the run's lease; this node holds it from then on. `known()`: the
        key as this node's membership view has it (no read; a view a little behind costs at most a grant that
        loses the create-only put and is revoked). Raises EtcdUnavailableError."""
        with self._lock:
            if self.lease_id:
                return
            self.lease_id = self._named_or_granted(known())

    def _found_or_granted(self) -> int:
        """The lease named by the `lease` key as read now; granted here when the key names none."""
        kv, _ = self._client.get(self._keys.run_lease)
        return self._named_or_granted(kv)

    def _named_or_granted(self, kv: KeyValue | None) -> int:
        """The lease `kv` (the `lease` key) names; granted here when it names none."""
        return lease_of(kv) or self._grant(expected=kv.mod_revision if kv is not None else None)

    def _grant(self, *, expected: int | None) -> int:
        mine = self._client.grant_lease(self.ttl_s)
        ok, kv = self._client.compare_and_put(self._keys.run_lease, json.dumps({"id": mine}).encode(),
                                              expected_mod_revision=expected, lease=mine)
        if ok:
            return mine
        self._client.revoke_lease(mine)
        return lease_of(kv)

    def beat(self) -> None:
        """Rank 0 only: a keep-alive when one is due; a lease found gone is granted anew. Never raises."""
        with self._lock:
            if not self._keeper or self.lease_id == 0 or self._clock() < self._due:
                return
            try:
                if self._client.refresh_lease(self.lease_id, timeout_s=5.0, attempts=1) <= 0:
                    log.info("run %s: its lease ran out (a long etcd outage?); granting a new one",
                             self._keys.run_id)
                    self.lease_id = self._found_or_granted()
            except EtcdUnavailableError as exc:
                log.debug("run %s: run lease keep-alive failed: %s", self._keys.run_id, exc)
                return
            self._due = self._clock() + self.ttl_s / 3
