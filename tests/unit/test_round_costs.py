"""What a node's round must not cost per member (benchmarks/round_profile.py found each of these in a profile):
an object and a key name per member when a round forms, a JSON parse of the final per look at it, a socketpair per
liveness loop, a write per watcher of a watch or per answer to etcd's BDP ping. The view, decide() and the waker
without etcd; the connection's writes against a loopback peer that speaks the server side of HTTP/2."""

from __future__ import annotations

import json
import selectors
import socket
import time

import pytest

from elastic_rt.errors import RendezvousDataError
from elastic_rt.rendezvous import connection as connection_mod
from elastic_rt.rendezvous import decide as decide_mod
from elastic_rt.rendezvous.connection import Connection
from elastic_rt.rendezvous.decide import decode_final, malformed, membership
from elastic_rt.rendezvous.etcd_client import KeyValue
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.liveness import _Waker
from elastic_rt.rendezvous.monitor import incarnation
from elastic_rt.rendezvous.view import MembershipView
from elastic_rt.rendezvous.wire import (
    ACK, DATA, END_HEADERS, END_STREAM, HEADERS, PING, PREFACE, SETTINGS, WINDOW_UPDATE, frame, message, split_messages,
)
from tests.support.h2_member import Member


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


# ---- writes on the etcd connection: each sendall is a system call and a GIL hand-off, per node per round -------
BDP_PING = bytes([2, 4, 16, 16, 9, 14, 7, 7])  # grpc-go's bandwidth-delay probe (etcd 3.4 and 3.5)

class _CountingSocket:
    """The connection's socket, with every sendall's bytes recorded."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self.sent = sock, []

    def sendall(self, data) -> None:
        self.sent.append(bytes(data))
        self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.fixture
def member_and_connection():
    member = Member()
    conn = Connection("127.0.0.1", member.port, authority="m", ssl_context=None, timeout_s=5, name="test")
    member.accept()
    conn._sock = counted = _CountingSocket(conn._sock)  # noqa: SLF001 - count what the connection writes from now
    try:
        yield member, conn, counted
    finally:
        conn.close()
        member.close()


def test_a_streaming_call_sends_its_first_requests_with_its_headers_in_one_write(member_and_connection):
    member, conn, counted = member_and_connection
    conn.open("/etcdserverpb.Watch/Watch", first=(b"a", b"bb", b"ccc"))
    assert len(counted.sent) == 1  # preface, SETTINGS, headers and three requests (the watch's watchers): one call
    assert counted.sent[0].startswith(PREFACE)  # nothing was written at connect: the preface went with the request
    while member.next_frame()[0] != WINDOW_UPDATE:  # the client's SETTINGS, then its window
        pass
    ftype, flags, sid, _ = member.next_frame()
    assert (ftype, flags & END_HEADERS, sid) == (HEADERS, END_HEADERS, 1)
    ftype, flags, sid, payload = member.next_frame()
    assert (ftype, flags & END_STREAM, sid) == (DATA, 0, 1)  # the stream stays open for more
    assert split_messages(bytearray(payload)) == [b"a", b"bb", b"ccc"]


def _bdp_ping_taken(member, conn) -> None:
    member.sock.sendall(frame(SETTINGS, 0, 0))
    while member.next_frame()[:2] != (SETTINGS, ACK):  # the reader answered the SETTINGS
        pass
    member.sock.sendall(frame(PING, 0, 0, BDP_PING))
    deadline = time.monotonic() + 10
    while not conn._acks:  # noqa: SLF001 - the reader thread took the ping (it writes nothing to say so)
        assert time.monotonic() < deadline, "the reader thread never handled the ping"
        time.sleep(0.005)


def test_etcds_bdp_ping_is_answered_with_a_write_once_held_and_any_other_ping_at_once(member_and_connection,
                                                                                      monkeypatch):
    member, conn, counted = member_and_connection
    monkeypatch.setattr(connection_mod, "ACK_HOLD_S", 0.0)  # held for no time: the next write takes the answer
    _bdp_ping_taken(member, conn)
    sent = len(counted.sent)
    conn.open("/etcdserverpb.KV/Range", timeout_s=5, body=b"q")
    assert len(counted.sent) == sent + 1  # the BDP ping's answer cost no write of its own
    assert counted.sent[-1].startswith(frame(PING, ACK, 0, BDP_PING))
    assert member.next_frame() == (PING, ACK, 0, BDP_PING)
    assert [member.next_frame()[0] for _ in range(2)] == [HEADERS, DATA]  # the request
    member.sock.sendall(frame(PING, 0, 0, b"keepaliv"))
    assert member.next_frame() == (PING, ACK, 0, b"keepaliv")  # at once, alone: grpc-go times keep-alive pings
    assert counted.sent[-1] == frame(PING, ACK, 0, b"keepaliv")


def test_the_preface_goes_first_even_behind_a_ping_answer_held_before_the_first_write(member_and_connection,
                                                                                      monkeypatch):
    """The preface waits for the first request; a BDP ping's answer held until then goes after it, not before it."""
    member, conn, counted = member_and_connection
    monkeypatch.setattr(connection_mod, "ACK_HOLD_S", 0.0)
    member.sock.sendall(frame(PING, 0, 0, BDP_PING))  # before the client wrote anything
    deadline = time.monotonic() + 10
    while not conn._acks:  # noqa: SLF001 - the reader thread took the ping (it writes nothing to say so)
        assert time.monotonic() < deadline, "the reader thread never handled the ping"
        time.sleep(0.005)
    conn.open("/etcdserverpb.KV/Range", timeout_s=5, body=b"q")
    assert counted.sent[0].startswith(PREFACE)
    assert [member.next_frame()[0] for _ in range(5)] == [SETTINGS, WINDOW_UPDATE, PING, HEADERS, DATA]


def test_a_bdp_pings_answer_is_held_back_from_the_writes_that_follow_it_at_once(member_and_connection, monkeypatch):
    """grpc-go sends its next BDP ping (and a WINDOW_UPDATE before it) after the answer: answered with the very
    next request, each request would wake the reader thread once more for nothing."""
    member, conn, counted = member_and_connection
    monkeypatch.setattr(connection_mod, "ACK_HOLD_S", 60.0)  # however slow this machine is today
    _bdp_ping_taken(member, conn)
    conn.open("/etcdserverpb.KV/Range", timeout_s=5, body=b"q")
    assert not counted.sent[-1].startswith(frame(PING, ACK, 0, BDP_PING))
    assert [member.next_frame()[0] for _ in range(2)] == [HEADERS, DATA]  # the request alone
    assert conn._acks  # noqa: SLF001 - still held


def test_a_bdp_pings_answer_goes_alone_when_nothing_is_written_for_a_while(member_and_connection, monkeypatch):
    monkeypatch.setattr(connection_mod, "ACK_DELAY_S", 0.05)
    member, conn, counted = member_and_connection
    member.sock.sendall(frame(SETTINGS, 0, 0) + frame(PING, 0, 0, BDP_PING))
    while (got := member.next_frame())[0] != PING:  # member.sock's timeout bounds the wait
        pass
    assert got == (PING, ACK, 0, BDP_PING)
    assert counted.sent[-1] == frame(PING, ACK, 0, BDP_PING)


# ---- a push stream: its answers handed over on the reader thread, outside the connection's lock, in order -------
def test_a_push_streams_items_come_in_order_on_the_reader_thread_and_may_call_back_into_the_connection(
        member_and_connection):
    import threading

    from hpack import Encoder

    from elastic_rt.rendezvous.daemon import thread_name
    from elastic_rt.rendezvous.wire import CallError

    member, conn, _ = member_and_connection
    got: list = []
    threads: set[str] = set()
    done = threading.Event()

    def on_item(item):
        threads.add(thread_name())
        got.append(item)
        if item == b"bb":
            conn.cancel(stream)  # back into the connection (its lock), from the thread that reads it
        if isinstance(item, CallError):
            done.set()

    stream = conn.open("/etcdserverpb.Watch/Watch", first=(b"w",), on_item=on_item)
    encoder = Encoder()
    encoder.header_table_size = 0  # as the client's SETTINGS ask
    headers = encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
    member.sock.sendall(frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, stream.id, headers)
                        + frame(DATA, 0, stream.id, message(b"a") + message(b"bb") + message(b"ccc")))
    assert done.wait(10)
    assert got[:2] == [b"a", b"bb"] and isinstance(got[-1], CallError)  # nothing after the end it asked for
    assert got[-1].code().name == "CANCELLED" and len(got) in (3, 4)  # b"ccc" came before the cancel, or not
    assert threads == {conn._reader.name}  # noqa: SLF001 - the reader thread's, no other
    assert stream.replies is None  # nothing queued for a thread to take
