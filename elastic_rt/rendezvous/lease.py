"""This node's liveness: an etcd lease kept alive by a thread, and the alive key attached to it."""

from __future__ import annotations

import json
import logging
import threading

from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous.etcd_client import EtcdClient
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.liveness import LivenessListener

log = logging.getLogger(__name__)


class NodeLease:
    """Grants a lease of `ttl_s`, refreshes it every ttl_s/4, re-grants it if it was lost.

    Keys put with `lease_id` vanish `ttl_s` after this process stops refreshing
    (SIGKILL, partition, hang): that is how peers learn of a dead node, with no
    dependence on anybody's wall clock.
    """

    def __init__(self, client: EtcdClient, keys: RunKeys, node_id: str, *, ttl_s: float, info: dict) -> None:
        self._client = client
        self._keys = keys
        self._node_id = node_id
        self._ttl_s = ttl_s
        self._listener = LivenessListener()
        self._info = json.dumps({**info, "liveness_port": self._listener.port}).encode()
        self._lock = threading.Lock()
        self._lease_id = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewals_lost = 0  # times the lease expired under us (a long pause or partition)

    @property
    def lease_id(self) -> int:
        with self._lock:
            return self._lease_id

    def start(self) -> int:
        with self._lock:
            self._grant()
        self._thread = threading.Thread(target=self._run, name="elastic-rt-lease", daemon=True)
        self._thread.start()
        return self._lease_id

    def _grant(self) -> None:
        self._lease_id = self._client.grant_lease(self._ttl_s)
        self._client.put(self._keys.alive(self._node_id), self._info, lease=self._lease_id)

    def _run(self) -> None:
        interval = max(0.1, self._ttl_s / 4)
        while not self._stop.wait(interval):
            try:
                with self._lock:
                    ttl = self._client.refresh_lease(self._lease_id)
                    if ttl <= 0:
                        self.renewals_lost += 1
                        log.warning("node %s: liveness lease expired; re-registering", self._node_id)
                        self._grant()
            except EtcdUnavailableError as exc:
                log.warning("node %s: cannot refresh liveness lease: %s", self._node_id, exc)

    def stop(self, *, revoke: bool) -> None:
        """Stop refreshing; with revoke, peers see this node gone at once."""
        self._stop.set()
        self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if revoke and self._lease_id:
            try:
                self._client.revoke_lease(self._lease_id)
            except EtcdUnavailableError as exc:
                log.warning("node %s: could not revoke lease (%s); it expires in %g s", self._node_id, exc, self._ttl_s)
        self._lease_id = 0


