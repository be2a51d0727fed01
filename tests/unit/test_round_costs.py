"""What a node's round must not cost per member (benchmarks/round_profile.py found each of these in a profile):
an object and a key name per member when a round forms, a JSON parse of the final per look at it, a socketpair per
liveness loop. Pure logic: the view, decide() and the waker without etcd."""

from __future__ import annotations

import json
import selectors

import pytest

from elastic_rt.errors import RendezvousDataError
from elastic_rt.rendezvous import decide as decide_mod
from elastic_rt.rendezvous.decide import decode_final, malformed, membership
from elastic_rt.rendezvous.etcd_client import KeyValue
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.liveness import _Waker
from elastic_rt.rendezvous.monitor import incarnation
from elastic_rt.rendezvous.view import MembershipView


def test_a_formed_round_shares_one_placeholder_for_the_members_the_view_never_read():
    view = MembershipView(None, RunKeys("r"), node_id="n00001", alive_puts=True)  # no etcd: nothing is read
    read = KeyValue(RunKeys("r").alive("n00003"), b'{"incarnation": "abc"}', 90, 90, 7)
    view.alive["n00003"] = read
    view.departed.update({"n00007": 1.0, "n00009": 2.0})
    view._departed_rev.update({"n00007": 50, "n00009": 150})  # noqa: SLF001 - left before / after the final
    nodes = tuple(f"n{i:05d}" for i in range(5000))
    view.members_formed(nodes, 100)
    assert "n00007" in view.alive and "n00007" not in view.departed  # left, and was back to join
    assert "n00009" not in view.alive and "n00009" in view.departed  # left after the final
    assert view.alive["n00003"] is read  # what the view read stays
    placeholders = {id(kv) for node, kv in view.alive.items() if node != "n00003"}
    assert len(view.alive) == 4999 and len(placeholders) == 1  # one object, not one per member
    placeholder = view.alive["n00000"]
    assert placeholder.value == b"" and incarnation(placeholder) is None  # the monitor takes the final's
    assert view.smallest_alive == "n00000" and view.alive_puts


def _final(rnd: int, nodes: list, incs: list | None = None) -> KeyValue:
    value = {"round": rnd, "nodes": nodes, "incarnations": incs if incs is not None else ["i"] * len(nodes)}
    return KeyValue(RunKeys("r").final(rnd), json.dumps(value).encode(), 5, 5, 0)


def test_a_final_is_parsed_once_however_often_decide_reads_it(monkeypatch):
    calls = []
    loads = json.loads
    monkeypatch.setattr(decide_mod.json, "loads", lambda text: calls.append(1) or loads(text))
    decide_mod._parsed.cache_clear()  # noqa: SLF001
    final = _final(3, [f"n{i}" for i in range(300)])
    for _ in range(5):
        assert malformed(final) is None
        assert membership(3, "n7", final).rank == [f"n{i}" for i in range(300)].index("n7")
    assert len(calls) == 1


def test_the_checks_of_a_final_still_refuse_what_elastic_rt_did_not_write():
    decide_mod._parsed.cache_clear()  # noqa: SLF001
    assert malformed(_final(1, ["a", 2])) == "lists no members"
    assert malformed(_final(1, ["a", "b"], ["x"])) == "has no incarnation for each member"
    assert membership(1, "b", _final(1, ["a", "b"], ["x", None])).incarnations == ("x", None)
    bad = KeyValue(RunKeys("r").final(1), b"[1, 2]", 5, 5, 0)
    for _ in range(2):  # a cached parse does not hide the refusal
        with pytest.raises(RendezvousDataError):
            decode_final(bad)


def test_the_waker_wakes_a_select_once_drained_sleeps_and_is_harmless_after_close():
    sel = selectors.DefaultSelector()
    waker = _Waker(sel)
    try:
        assert sel.select(0) == []
        waker.wake()
        waker.wake()
        assert [key.data for key, _ in sel.select(1)] == [waker]
        waker.drain()
        assert sel.select(0) == []
    finally:
        sel.close()
        waker.close()
    waker.wake()  # after close: writes nowhere, raises nothing
    waker.close()
