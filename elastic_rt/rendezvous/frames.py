"""An HTTP/2 client's streams: their flow-control windows, the frames a request becomes, what each frame read means.

The protocol half of connection.py, without sockets, TLS or threads: a Connection subclasses StreamTable, holds
its lock around every method here, and supplies `_write` (bytes to the member) and `_fail` (the connection is
broken). A stream's messages, and then its end, go to the stream through `_put`.
"""

from __future__ import annotations

import queue
import time
from typing import Callable

import grpc

from elastic_rt.rendezvous.wire import (
    ACK, CONTINUATION, DATA, DEFAULT_MAX_FRAME, DEFAULT_WINDOW, END_HEADERS, END_STREAM, GOAWAY, HEAD_SIZE, HEADERS,
    MAX_WINDOW, PADDED, PING, PRIORITY_FLAG, RST_STREAM, SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE,
    WINDOW_UPDATE, CallError, HeaderDecoder, frame, http_status_error, message, parse_settings, reset_error, rst_stream,
    split_messages, trailer_status, u32, unpack_head, unpad, window_update,
)

_REPLENISH = 1 << 30  # consumed receive window given back once this much arrived (the windows are 2^31 - 1)
# grpc-go's bandwidth-delay probe: etcd sends it (with a WINDOW_UPDATE) after the first request data that follows
# the last one's answer. Answered with the very next request, it came back once per request, and each time woke the
# reader thread for nothing; so its answer is held ACK_HOLD_S, then goes with the connection's next write (or on its
# own ACK_DELAY_S after it came, when nothing was written): at most about one probe per ACK_HOLD_S. Any other PING is
# answered at once.
BDP_PING = bytes([2, 4, 16, 16, 9, 14, 7, 7])
ACK_HOLD_S = 0.5
ACK_DELAY_S = 2.0
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class Stream:
    """One gRPC call on a Connection. Its messages arrive in order on `replies`, then its end: None (OK) or a
    CallError; or, for a stream opened with `on_item`, are handed to on_item in that order, by the connection's
    reader thread (Connection._deliver: without the connection's lock, one item at a time). `sent_at` is when its
    last request message was handed to the kernel (monotonic)."""

    __slots__ = ("conn", "id", "send_window", "pending", "end_pending", "inbuf", "unacked", "headers_seen",
                 "replies", "on_item", "sent_at", "detached")

    def __init__(self, conn, stream_id: int, window: int, on_item: Callable[[object], None] | None = None) -> None:
        self.conn, self.id, self.send_window = conn, stream_id, window
        self.pending, self.end_pending = bytearray(), False
        self.inbuf, self.unacked, self.headers_seen = bytearray(), 0, False
        self.replies: queue.SimpleQueue | None = queue.SimpleQueue() if on_item is None else None
        self.on_item = on_item
        self.sent_at = 0.0
        self.detached = False  # a call etcd must not see end before its answer (Connection.unary's `detach`)

    def send(self, body: bytes) -> None:
        """One more request message (a streaming call)."""
        self.conn.send(self, message(body), end=False)

    def next(self, timeout_s: float | None) -> bytes | None:
        """The next message, or None once the call ended OK; raises CallError (DEADLINE_EXCEEDED when nothing
        came within timeout_s, None: wait as long as it takes); see Connection.wait."""
        replies = self.replies  # read by this stream's caller alone: not empty stays so until it takes the item
        item = replies.get_nowait() if not replies.empty() else self.conn.wait(self, timeout_s)
        if item is None or isinstance(item, CallError):
            self.replies.put(item)  # the end stays the answer to every later call
            if item is not None:
                raise item
        return item

    def cancel(self) -> None:
        self.conn.cancel(self)


class StreamTable:
    """The streams of one HTTP/2 connection and its send and receive windows. Every method runs under the
    connection's lock."""

    def __init__(self) -> None:
        self._streams: dict[int, Stream] = {}
        self.abandoned: set[int] = set()  # calls given up without a reset whose end etcd has not sent yet
        self._blocked: list[Stream] = []  # streams with request bytes waiting for a send window
        self._next_id = 1
        self._window, self._initial, self._max_frame = DEFAULT_WINDOW, DEFAULT_WINDOW, DEFAULT_MAX_FRAME
        self._unacked = 0
        self._buf = bytearray()
        self._block: tuple[int, int, bytearray] | None = None  # a header block waiting for its CONTINUATION
        self._decoder = HeaderDecoder()
        self._acks = bytearray()  # PING ACK frames that go with the next write
        self._acks_at = 0.0  # when the oldest of them was due (monotonic)
        self._deliveries: list[tuple[Callable[[object], None], object]] = []  # on_item calls, in order
        self.error: CallError | None = None
        self.goaway = False
        self.answered = False  # the member sent its SETTINGS

    # ---- supplied by the connection -------------------------------------------------------------------
    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def _fail(self, error: CallError) -> None:
        raise NotImplementedError

    def _put(self, stream: Stream, item) -> None:
        """Hand a stream a message or its end (None / CallError): on its queue, or, for a stream with on_item, to
        the deliveries that go out once the connection's lock is released."""
        if stream.on_item is None:
            stream.replies.put(item)
        else:
            self._deliveries.append((stream.on_item, item))

    # ---- requests ------------------------------------------------------------------------------------
    def _new_stream(self, on_item: Callable[[object], None] | None = None) -> Stream:
        stream = Stream(self, self._next_id, self._initial, on_item)
        self._next_id += 2
        self._streams[stream.id] = stream
        return stream

    def _header_frames(self, stream_id: int, block: bytes) -> bytes:
        size = self._max_frame
        if len(block) <= size:
            return frame(HEADERS, END_HEADERS, stream_id, block)
        parts = [block[i:i + size] for i in range(0, len(block), size)]
        return frame(HEADERS, 0, stream_id, parts[0]) + b"".join(
            frame(CONTINUATION, END_HEADERS if i == len(parts) - 1 else 0, stream_id, p)
            for i, p in enumerate(parts) if i)

    def _data(self, stream: Stream, data: bytes, end: bool) -> bytes:
        n = len(data)
        if 0 < n <= self._max_frame and n <= self._window and n <= stream.send_window and not stream.pending:
            self._window -= n  # a request that fits the windows and a frame (each of a round's): one frame, as
            stream.send_window -= n  # _drain() would write it
            stream.end_pending = stream.end_pending or end
            return frame(DATA, END_STREAM if stream.end_pending else 0, stream.id, data)
        stream.pending += data
        stream.end_pending = stream.end_pending or end
        return self._drain(stream)

    def _drain(self, stream: Stream) -> bytes:
        """DATA frames for as much of the stream's pending bytes as the send windows allow."""
        out, pending = [], stream.pending
        while pending:
            n = min(len(pending), self._window, stream.send_window, self._max_frame)
            if n <= 0:
                break
            chunk = bytes(pending[:n])
            del pending[:n]
            self._window -= n
            stream.send_window -= n
            out.append(frame(DATA, END_STREAM if not pending and stream.end_pending else 0, stream.id, chunk))
        if pending and stream not in self._blocked:
            self._blocked.append(stream)
        return b"".join(out)

    def _unblock(self) -> None:
        out = b""
        for stream in list(self._blocked):
            if stream.id in self._streams:
                out += self._drain(stream)
            if not stream.pending or stream.id not in self._streams:
                self._blocked.remove(stream)
        if out:
            self._write(out)

    # ---- what the member sent ------------------------------------------------------------------------
    def _receive_frames(self, data: bytes) -> None:
        """Add `data` to what was read and handle every complete frame in it."""
        buf = self._buf
        buf += data
        off, n = 0, len(buf)
        while n - off >= HEAD_SIZE:
            lt, flags, sid = unpack_head(buf, off)  # wire.frame_head, inline: a round reads a few frames per reply
            end = off + HEAD_SIZE + (lt >> 8)
            if end > n:
                break
            payload = bytes(buf[off + HEAD_SIZE:end])
            off = end
            self._frame(lt & 0xFF, flags, sid & MAX_WINDOW, payload)
            if self.error is not None:
                return
        del buf[:off]

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == HEADERS:
            payload = unpad(flags, payload) if flags & PADDED else payload
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            if flags & END_HEADERS:
                self._on_headers(sid, flags, payload)
            else:
                self._block = (sid, flags, bytearray(payload))
        elif ftype == CONTINUATION and self._block is not None and self._block[0] == sid:
            self._block[2].extend(payload)
            if flags & END_HEADERS:
                sid, first_flags, block = self._block
                self._block = None
                self._on_headers(sid, first_flags, bytes(block))
        elif ftype == WINDOW_UPDATE:
            stream = self._streams.get(sid) if sid else None
            if sid == 0:
                self._window += u32(payload)
            elif stream is not None:
                stream.send_window += u32(payload)
            self._unblock()
        elif ftype == PING and not flags & ACK:
            if payload != BDP_PING:
                self._write(frame(PING, ACK, 0, payload))
            else:
                if not self._acks:
                    self._acks_at = time.monotonic()
                self._acks += frame(PING, ACK, 0, payload)
        elif ftype == SETTINGS and not flags & ACK:
            self._on_settings(payload)
        elif ftype == RST_STREAM:
            self.abandoned.discard(sid)
            stream = self._streams.pop(sid, None)
            if stream is not None:
                self._put(stream, reset_error(payload))
        elif ftype == GOAWAY:
            self.goaway = True
            last = u32(payload) if len(payload) >= 4 else 0
            for stream_id in [s for s in self._streams if s > last]:
                self._put(self._streams.pop(stream_id), CallError(_UNAVAILABLE, "etcd went away (GOAWAY)"))
            self.abandoned -= {s for s in self.abandoned if s > last}  # never to be answered

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        self._unacked += len(payload)
        if self._unacked >= _REPLENISH:
            self._write(window_update(0, self._unacked))
            self._unacked = 0
        stream = self._streams.get(sid)
        if stream is None:
            if flags & END_STREAM:
                self.abandoned.discard(sid)
            return
        stream.unacked += len(payload)
        if stream.unacked >= _REPLENISH:
            self._write(window_update(sid, stream.unacked))
            stream.unacked = 0
        stream.inbuf += unpad(flags, payload) if flags & PADDED else payload
        for body in split_messages(stream.inbuf):
            self._put(stream, body)
        if flags & END_STREAM:
            del self._streams[sid]
            self._put(stream, CallError(grpc.StatusCode.INTERNAL, "etcd ended the call without a status"))

    def _on_headers(self, sid: int, flags: int, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block)
        except Exception as exc:  # noqa: BLE001 - hpack's errors: the connection's header state is lost
            self._fail(CallError(grpc.StatusCode.INTERNAL, f"undecodable headers from etcd: {exc!r}"))
            return
        stream = self._streams.get(sid)
        if stream is None:
            if flags & END_STREAM:
                self.abandoned.discard(sid)
            return
        if not stream.headers_seen:
            stream.headers_seen = True
            error = http_status_error(headers)
            if error is not None:
                del self._streams[sid]
                self._put(stream, error)
                self._write(rst_stream(sid))
                return
            if not flags & END_STREAM:
                return
        if flags & END_STREAM:  # the trailers (or a trailers-only answer): the call's status
            del self._streams[sid]
            self._put(stream, trailer_status(headers))

    def _on_settings(self, payload: bytes) -> None:
        values = parse_settings(payload)
        if SETTINGS_INITIAL_WINDOW_SIZE in values:
            delta = values[SETTINGS_INITIAL_WINDOW_SIZE] - self._initial
            self._initial = values[SETTINGS_INITIAL_WINDOW_SIZE]
            for stream in self._streams.values():
                stream.send_window += delta
        if SETTINGS_MAX_FRAME_SIZE in values:
            self._max_frame = values[SETTINGS_MAX_FRAME_SIZE]
        self.answered = True
        self._write(frame(SETTINGS, ACK, 0))
        self._unblock()
