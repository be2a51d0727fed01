"""A c10d Store on etcd v3: blocking calls wait on watches, counters are compare-and-set loops."""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous.etcd_client import EtcdClient

_DEFAULT_TIMEOUT = timedelta(seconds=300)


def _to_bytes(value: str | bytes | bytearray | list) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):  # c10d passes std::vector<uint8_t> as a list of ints
        return bytes(value)
    return bytes(value)


class EtcdStore(dist.Store):
    """Keys live under `prefix`; values are raw bytes, as with TCPStore.

    Semantics follow TCPStore (the store contract tests run the same cases
    against both): `get` waits for a missing key up to the store timeout,
    `compare_set` on a missing key sets it only when `expected` is empty, and
    timeouts raise torch.distributed.DistStoreError.
    """

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        return self._prefix

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _timeout_s(self, timeout: timedelta | None) -> float:
        t = self.timeout if timeout is None else timeout
        return t.total_seconds()

    def _guard(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EtcdUnavailableError as exc:
            raise dist.DistStoreError(str(exc)) from exc

    # ---- writes -----------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._guard(self._client.put, self._k(key), _to_bytes(value))

    def multi_set(self, keys: list[str], values: list) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def add(self, key: str, amount: int) -> int:
        return self._guard(self._add, key, int(amount))

    def _add(self, key: str, amount: int) -> int:
        while True:
            kv, _ = self._client.get(self._k(key))
            current = int(kv.value) if kv is not None else 0
            new = current + amount
            ok, _ = self._client.compare_and_put(
                self._k(key), str(new).encode(),
                expected_mod_revision=kv.mod_revision if kv is not None else None,
            )
            if ok:
                return new

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._guard(self._compare_set, key, _to_bytes(expected), _to_bytes(desired))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        while True:
            kv, _ = self._client.get(self._k(key))
            if kv is None:
                if expected:
                    return expected
                ok, now = self._client.compare_and_put(self._k(key), desired, expected_mod_revision=None)
            elif kv.value != expected:
                return kv.value
            else:
                ok, now = self._client.compare_and_put(
                    self._k(key), desired, expected_mod_revision=kv.mod_revision
                )
            if ok:
                return desired
            # lost a race: decide again on what is there now

    def delete_key(self, key: str) -> bool:
        return self._guard(self._client.delete, self._k(key))

    # ---- reads ------------------------------------------------------------
    def get(self, key: str) -> bytes:
        self.wait([key])
        kv, _ = self._guard(self._client.get, self._k(key))
        if kv is None:  # deleted between wait and get: wait again
            return self.get(key)
        return kv.value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def check(self, keys: list[str]) -> bool:
        return all(self._guard(self._client.get, self._k(k))[0] is not None for k in keys)

    def num_keys(self) -> int:
        return self._guard(self._client.count_prefix, self._prefix)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout_s = self._timeout_s(timeout)
        deadline = time.monotonic() + timeout_s
        for key in keys:
            while True:
                kv, rev = self._guard(self._client.get, self._k(key))
                if kv is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0 or not self._guard(
                    self._client.wait_for_change, self._k(key), after_revision=rev, timeout_s=left
                ):
                    raise dist.DistStoreError(
                        f"wait timeout after {timeout_s * 1000:.0f}ms, keys: {', '.join(keys)}"
                    )
