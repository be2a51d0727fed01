"""RoundStore: the round listeners' store passes calls through until the round ends, then refuses every call, and
end() waits for the writes in flight."""

from __future__ import annotations

import threading

import pytest

from elastic_rt.agent.round_store import RoundStore
from elastic_rt.errors import RoundOverError


class _DictStore:
    """The key-value calls of a store, in a dict; set() of the key "slow" blocks until `release` is set."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.entered = threading.Event()
        self.release = threading.Event()

    def set(self, key, value):
        if key == "slow":
            self.entered.set()
            assert self.release.wait(30)
        self.data[key] = value if isinstance(value, bytes) else value.encode()

    def get(self, key):
        return self.data[key]

    def add(self, key, amount):
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def check(self, keys):
        return all(k in self.data for k in keys)


def test_calls_pass_through_until_the_round_ends_then_each_is_refused():
    inner = _DictStore()
    store = RoundStore(inner, round=7)
    store.set("k", "v")
    assert store.get("k") == b"v" and store.check(["k"]) and store.add("n", 2) == 2
    assert store.end() is True
    for call in (lambda: store.set("k2", "v"), lambda: store.get("k"), lambda: store.add("n", 1),
                 lambda: store.check(["k"])):
        with pytest.raises(RoundOverError, match="round 7 is over"):
            call()
    assert inner.data == {"k": b"v", "n": b"2"}  # nothing reached the store after end()


def test_end_waits_for_a_write_in_flight_and_no_write_starts_after_it():
    inner = _DictStore()
    store = RoundStore(inner, round=3)
    writer = threading.Thread(target=store.set, args=("slow", "v"))
    writer.start()
    assert inner.entered.wait(30)
    assert store.end(wait_s=0.05) is False  # still writing
    with pytest.raises(RoundOverError):
        store.set("late", "v")
    inner.release.set()
    assert store.end(wait_s=30) is True
    writer.join(30)
    assert inner.data == {"slow": b"v"}
