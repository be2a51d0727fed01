"""A c10d Store on etcd v3: the whole torch.distributed.Store API, with TCPStore's semantics."""

from __future__ import annotations

import logging
import time
import uuid
from datetime import timedelta
from typing import Callable, TypeVar

import torch.distributed as dist

from elastic_rt.errors import EtcdUnavailableError, LeaseGoneError
from elastic_rt.rendezvous.etcd_client import EtcdClient

_DEFAULT_TIMEOUT = timedelta(seconds=300)
_TXN_OPS = 64  # etcd refuses transactions of more than 128 operations by default
T = TypeVar("T")
log = logging.getLogger(__name__)


def _to_bytes(value: str | bytes | bytearray | memoryview | list) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview, list)):  # a list: std::vector<uint8_t> from C++
        return bytes(value)
    raise TypeError(f"store values are str or bytes, not {type(value).__name__}")


class EtcdStore(dist.Store):
    """Keys live at `prefix + key`; values are raw bytes, as with TCPStore.

    Semantics follow TCPStore (tests/integration/test_store_contract.py runs the
    same cases against both): `get`, `multi_get`, `wait` and a blocking
    `queue_pop` wait up to the store timeout and then raise DistStoreError;
    `compare_set` on a missing key sets it only when `expected` is empty; `check`
    and `wait` also see a non-empty queue of that name. Queues live beside the
    keys, at `prefix[:-1] + ".queues/"`, so `num_keys` and `list_keys` count only
    keys, as TCPStore does. Unlike TCPStore, `num_keys` has no extra internal key.
    Every instance, clones included, may be used from any thread.

    torch's C++ wrappers (PrefixStore, process groups) hold a Python store without
    keeping its Python object alive: keep a reference to the store you pass them.
    A clone made through them (`PrefixStore.clone()`) is kept alive by its family:
    a store and all its clones live while any one of them is referenced.

    With `lease`, every key and queue item is put on that etcd lease (the run's: they vanish with it); a write
    that finds the lease gone is made again without one, and the family writes without it from then on.
    """

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = _DEFAULT_TIMEOUT,
                 *, lease: int = 0, _family: list[EtcdStore] | None = None) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._queues = self._prefix[:-1] + ".queues/"
        self._family = [] if _family is None else _family
        self._lease = [lease]  # shared with the clones (one list): a lease found gone is dropped by all
        self.set_timeout(timeout)

    def _leased(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, lease=..., **kwargs); without the lease once etcd says it is gone."""
        lease = self._lease[0]
        try:
            return fn(*args, lease=lease, **kwargs)
        except LeaseGoneError:
            if not lease:
                raise
            log.info("store %s: its lease %x is gone; writing without it", self._prefix, lease)
            self._lease[0] = 0
            return fn(*args, lease=0, **kwargs)

    @property
    def prefix(self) -> str:
        return self._prefix

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _q(self, key: str) -> str:
        return f"{self._queues}{key.encode().hex()}/"  # hex: queue "a" never sees the items of "a/b"

    def _guard(self, fn: Callable[..., T], *args, **kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except EtcdUnavailableError as exc:
            raise dist.DistStoreError(str(exc)) from exc

    def _until(self, probe: Callable[[], tuple[T | None, int]], keys: list[str], watch_keys: list[str],
               watch_prefixes: list[str], timeout: timedelta | None = None, what: str = "wait") -> T:
        """Re-run `probe` (result or None, revision read at) on every change until it answers or time runs out."""
        timeout_s = (self.timeout if timeout is None else timeout).total_seconds()
        deadline = time.monotonic() + timeout_s
        while True:
            result, rev = self._guard(probe)
            if result is not None:
                return result
            left = deadline - time.monotonic()
            if left <= 0 or not self._guard(self._client.wait_for_any, watch_keys, watch_prefixes,
                                            after_revision=rev, timeout_s=left):
                raise dist.DistStoreError(f"{what} timeout after {timeout_s * 1000:.0f}ms, keys: {', '.join(keys)}")

    def _cas_loop(self, key: str, update: Callable[[bytes | None], bytes]) -> bytes:
        """Write update(current value or None) by compare-and-set, retrying on a concurrent write."""
        while True:
            kv, _ = self._client.get(self._k(key))
            new = update(None if kv is None else kv.value)
            ok, _ = self._leased(self._client.compare_and_put, self._k(key), new,
                                 expected_mod_revision=None if kv is None else kv.mod_revision)
            if ok:
                return new

    # ---- the Store API: keys ----------------------------------------------
    def clone(self) -> EtcdStore:
        """A new store on the same keys and the same (thread-safe) client, with the current timeout."""
        twin = EtcdStore(self._client, self._prefix, self.timeout, _family=self._family)
        twin._lease = self._lease
        self._family.append(twin)  # C++ callers hold the clone without its Python object: keep it
        return twin

    def has_extended_api(self) -> bool:
        return True

    def set(self, key: str, value) -> None:
        self._guard(self._leased, self._client.put, self._k(key), _to_bytes(value))

    def multi_set(self, keys: list[str], values: list) -> None:
        if len(keys) != len(values):
            raise dist.DistStoreError(f"multi_set: {len(keys)} keys but {len(values)} values")
        items = list({self._k(k): _to_bytes(v) for k, v in zip(keys, values)}.items())  # last value wins
        for i in range(0, len(items), _TXN_OPS):
            self._guard(self._leased, self._client.put_many, items[i:i + _TXN_OPS])

    def add(self, key: str, amount: int) -> int:
        def bump(old: bytes | None) -> bytes:
            try:
                current = 0 if old is None else int(old)
            except ValueError:
                raise dist.DistStoreError(f"add({key!r}): the value {old[:32]!r} is not an integer") from None
            return str(current + int(amount)).encode()

        return int(self._guard(self._cas_loop, key, bump))

    def append(self, key: str, value) -> None:
        tail = _to_bytes(value)
        self._guard(self._cas_loop, key, lambda old: (old or b"") + tail)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._guard(self._compare_set, key, _to_bytes(expected), _to_bytes(desired))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        while True:
            kv, _ = self._client.get(self._k(key))
            if kv is None and expected:
                return expected  # TCPStore: a missing key with a non-empty expected value is left alone
            if kv is not None and kv.value != expected:
                return kv.value
            ok, _ = self._leased(self._client.compare_and_put, self._k(key), desired,
                                 expected_mod_revision=None if kv is None else kv.mod_revision)
            if ok:
                return desired
            # lost a race: decide again on what is there now

    def delete_key(self, key: str) -> bool:
        return self._guard(self._client.delete, self._k(key))

    def get(self, key: str) -> bytes:
        def probe() -> tuple[bytes | None, int]:
            kv, rev = self._client.get(self._k(key))
            return (None if kv is None else kv.value), rev

        return self._until(probe, [key], [self._k(key)], [])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        if not keys:
            return []
        full = [self._k(k) for k in keys]

        def probe() -> tuple[list[bytes] | None, int]:
            kvs, _, rev = self._client.read_many(full, [])
            return (None if any(kv is None for kv in kvs) else [kv.value for kv in kvs]), rev

        return self._until(probe, keys, full, [])

    def check(self, keys: list[str]) -> bool:
        return self._guard(self._present, keys)[0]

    def _present(self, keys: list[str]) -> tuple[bool, int]:
        """Whether every key is set or is a non-empty queue, and the revision that was read at."""
        if not keys:
            return True, 0
        counts, rev = self._client.count_many([self._k(k) for k in keys], [self._q(k) for k in keys])
        n = len(keys)
        return all(counts[i] or counts[n + i] for i in range(n)), rev

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if not keys:
            return

        def probe() -> tuple[bool | None, int]:
            ok, rev = self._present(keys)
            return (True if ok else None), rev

        self._until(probe, keys, [self._k(k) for k in keys], [self._q(k) for k in keys], timeout)

    def num_keys(self) -> int:
        return self._guard(self._client.count_prefix, self._prefix)

    def list_keys(self) -> list[str]:
        kvs, _ = self._guard(self._client.list_prefix, self._prefix, keys_only=True)
        return [kv.key[len(self._prefix):] for kv in kvs]

    # ---- the Store API: queues --------------------------------------------
    def queue_push(self, key: str, value) -> None:
        self._guard(self._leased, self._client.put, self._q(key) + uuid.uuid4().hex, _to_bytes(value))

    def queue_len(self, key: str) -> int:
        return self._guard(self._client.count_prefix, self._q(key))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest item (first pushed, by etcd revision); each item goes to exactly one caller."""
        def probe() -> tuple[bytes | None, int]:
            while True:
                oldest, rev = self._client.list_prefix(self._q(key), limit=1, oldest_first=True)
                if not oldest:
                    return None, rev
                if self._client.delete_if_unchanged(oldest[0].key, oldest[0].mod_revision):
                    return oldest[0].value, rev
                # another caller took it: look again

        if not block:
            value, _ = self._guard(probe)
            if value is None:
                raise dist.QueueEmptyError("queue is empty")
            return value
        return self._until(probe, [key], [], [self._q(key)])
