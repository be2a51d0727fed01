"""A detached call (Connection.unary's `detach`: the read-only Txns etcd 3.5.0-3.5.4 crash on when their context ends
early, etcd-io/etcd#14110): it tells etcd no deadline, is abandoned without a reset when the caller gives up, its late
answer is read and dropped, and close() waits for it; one whose request was not all sent is reset (etcd has not begun
it). Against a loopback peer that speaks the server side of HTTP/2 (tests/support/h2_member.py)."""

from __future__ import annotations

import struct
import threading
import time

import grpc
import pytest
from hpack import Decoder

from elastic_rt.rendezvous.connection import Connection
from elastic_rt.rendezvous.wire import (
    ACK, HEADERS, PING, RST_STREAM, SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE, CallError, frame,
)
from tests.support.h2_member import Member, answer, connected, settings

KV_TXN = "/etcdserverpb.KV/Txn"


@pytest.fixture
def member_and_connection():
    with connected() as pair:
        yield pair


def _settled(member: Member, conn: Connection, payload: bytes = b"") -> None:
    member.sock.sendall(frame(SETTINGS, 0, 0, payload) if payload else settings())
    _until(lambda: conn.answered, "the member's SETTINGS were never read")


def _until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _request(member: Member) -> tuple[int, dict[bytes, bytes]]:
    """The next request's stream id and header fields (its DATA is read too)."""
    while True:
        ftype, flags, sid, payload = member.next_frame()
        if ftype == HEADERS:
            fields = dict(Decoder().decode(payload, raw=True))
            member.next_frame()  # its DATA
            return sid, fields


def _frames_until_ping_ack(member: Member) -> list[int]:
    """The frame types the client sends before it answers a PING sent now (what it wrote before reading it)."""
    member.sock.sendall(frame(PING, 0, 0, b"12345678"))
    types = []
    while True:
        ftype, flags, _, _ = member.next_frame()
        if ftype == PING and flags & ACK:
            return types
        types.append(ftype)


def test_a_detached_call_tells_no_deadline_and_is_abandoned_not_reset(member_and_connection):
    member, conn = member_and_connection
    _settled(member, conn)
    errors: list[CallError] = []
    caller = threading.Thread(target=lambda: _expect_error(conn, errors, 0.2), daemon=True)
    caller.start()
    sid, fields = _request(member)
    assert b"grpc-timeout" not in fields and fields[b":path"] == KV_TXN.encode()
    caller.join(10)
    assert errors and errors[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert RST_STREAM not in _frames_until_ping_ack(member)  # no reset: etcd's context for it goes on
    assert conn.abandoned == {sid}
    member.sock.sendall(answer(sid, b"late"))  # the answer after the caller gave up: read and dropped
    _until(lambda: not conn.abandoned, "the abandoned call's end was never read")
    assert not conn.error


def _expect_error(conn: Connection, errors: list, timeout_s: float) -> None:
    try:
        conn.unary(KV_TXN, b"read", timeout_s, detach=True)
    except CallError as exc:
        errors.append(exc)


def test_close_waits_for_a_detached_call_to_end(member_and_connection):
    member, conn = member_and_connection
    _settled(member, conn)
    replies: list[bytes] = []
    caller = threading.Thread(target=lambda: replies.append(conn.unary(KV_TXN, b"read", 10, detach=True)),
                              daemon=True)
    caller.start()
    sid, _ = _request(member)
    closer = threading.Thread(target=conn.close, kwargs={"drain_s": 10}, daemon=True)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # the call has no answer yet: close() waits
    member.sock.sendall(answer(sid, b"reply"))
    closer.join(10)
    caller.join(10)
    assert not closer.is_alive() and replies == [b"reply"]


def test_a_call_given_up_before_its_request_was_all_sent_is_reset(member_and_connection):
    member, conn = member_and_connection
    _settled(member, conn, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, 4))  # 4 bytes a stream, then wait
    errors: list[CallError] = []
    _expect_error(conn, errors, 0.1)  # the rest of its body waits for a window etcd never gives
    assert errors and errors[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert RST_STREAM in _frames_until_ping_ack(member)
    assert not conn.abandoned
