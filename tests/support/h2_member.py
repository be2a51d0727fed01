"""A loopback peer that speaks the server side of HTTP/2 just enough for tests of the etcd connection
(elastic_rt/rendezvous/connection.py): it reads the client's frames and sends what a test says."""

from __future__ import annotations

import socket
from contextlib import contextmanager
from typing import Iterator

from hpack import Encoder

from elastic_rt.rendezvous.wire import (
    DATA, END_HEADERS, END_STREAM, HEAD_SIZE, HEADERS, PREFACE, SETTINGS, frame, frame_head, message,
)


class Member:
    """A loopback peer that speaks just enough HTTP/2 server side (reads frames, sends what the test says)."""

    def __init__(self) -> None:
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self.sock: socket.socket | None = None
        self._buf = bytearray()
        self._preface_read = False

    def accept(self) -> None:
        """The client's connection (its preface comes with its first request: read before the first frame)."""
        self.sock, _ = self._srv.accept()
        self.sock.settimeout(10)

    def read_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError("the client closed the connection")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def next_frame(self) -> tuple[int, int, int, bytes]:
        if not self._preface_read:
            assert self.read_exactly(len(PREFACE)) == PREFACE
            self._preface_read = True
        length, ftype, flags, sid = frame_head(self.read_exactly(HEAD_SIZE), 0)
        return ftype, flags, sid, self.read_exactly(length)

    def close(self) -> None:
        for s in (self.sock, self._srv):
            if s is not None:
                s.close()


def answer(stream_id: int, *bodies: bytes, end: bool = True) -> bytes:
    """The frames of a gRPC answer on `stream_id`: its headers, a DATA frame of `bodies` and, with `end`, the trailers
    of an OK status (a fresh encoder each time: the client asks for no HPACK table)."""
    encoder = Encoder()
    encoder.header_table_size = 0
    out = frame(HEADERS, END_HEADERS, stream_id, encoder.encode([(":status", "200"),
                                                                 ("content-type", "application/grpc")]))
    if bodies:
        out += frame(DATA, 0, stream_id, b"".join(map(message, bodies)))
    if end:
        out += frame(HEADERS, END_HEADERS | END_STREAM, stream_id, encoder.encode([("grpc-status", "0")]))
    return out


def settings() -> bytes:
    return frame(SETTINGS, 0, 0)


@contextmanager
def connected(*, drain_s: float = 0.0) -> Iterator[tuple[Member, object]]:
    """A Member and a client Connection to it, accepted; closed after (the connection waits drain_s for its detached
    calls)."""
    from elastic_rt.rendezvous.connection import Connection

    member = Member()
    conn = Connection("127.0.0.1", member.port, authority="m", ssl_context=None, timeout_s=5, name="test")
    member.accept()
    try:
        yield member, conn
    finally:
        conn.close(drain_s=drain_s)
        member.close()
