"""The round's c10d store as the agent's round listeners see it (the collective probe, clock skew, the step-time
exchange): it ends with the round. Their threads outlive the call that started them; once the agent meets again or
leaves, every call they make raises RoundOverError, and end() waits for the writes in flight. So nothing of a round
is written to etcd after its agent left the run: the run's last agent removes the run's keys (claim.remove_run_keys),
and a check that wrote after that would leave keys behind until the run's lease ran out."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastic_rt.errors import RoundOverError


class RoundStore(dist.Store):
    """Delegates to `store` (the worker group's: torch's PrefixStore over the rendezvous store) until end(); the
    key-value calls only (the listeners use no queues).
    Keep a reference to it while a C++ wrapper uses it (as with any Python store)."""

    def __init__(self, store: dist.Store, *, round: int) -> None:
        super().__init__()
        self._store = store
        self.round = round
        self._lock = threading.Condition()
        self._over = False
        self._writing = 0

    def end(self, *, wait_s: float = 0.0) -> bool:
        """No call starts from now on; waits up to wait_s for the writes in flight. True when none is left."""
        with self._lock:
            self._over = True
            return self._lock.wait_for(lambda: self._writing == 0, timeout=max(0.0, wait_s))

    def _refuse(self, what: str) -> RoundOverError:
        return RoundOverError(f"round {self.round} is over: its store takes no {what}")

    def _read(self, name: str, *args: Any) -> Any:
        if self._over:
            raise self._refuse(name)
        return getattr(self._store, name)(*args)

    def _write(self, name: str, *args: Any) -> Any:
        with self._lock:
            if self._over:
                raise self._refuse(name)
            self._writing += 1
        try:
            return getattr(self._store, name)(*args)
        finally:
            with self._lock:
                self._writing -= 1
                self._lock.notify_all()

    # writes
    def set(self, key: str, value) -> None:
        self._write("set", key, value)

    def multi_set(self, keys: list[str], values: list) -> None:
        self._write("multi_set", keys, values)

    def add(self, key: str, amount: int) -> int:
        return self._write("add", key, amount)

    def append(self, key: str, value) -> None:
        self._write("append", key, value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._write("compare_set", key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._write("delete_key", key)

    # reads
    def get(self, key: str) -> bytes:
        return self._read("get", key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._read("multi_get", keys)

    def check(self, keys: list[str]) -> bool:
        return self._read("check", keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._read("wait", keys)
        else:
            self._read("wait", keys, timeout)

    def num_keys(self) -> int:
        return self._read("num_keys")

    def has_extended_api(self) -> bool:
        return self._store.has_extended_api()
