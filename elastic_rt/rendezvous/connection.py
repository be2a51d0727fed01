"""One HTTP/2 connection to one etcd member: every gRPC call and stream of one client to it, one reader thread.

Why not gRPC Python: a unary call there costs about 0.3 ms of CPU (a thread hand-off to gRPC's event
engine and back, five context switches, objects enough to run the garbage collector), a streaming call
a thread of its own that consumes the requests, and a keep-alive on a stream 0.3-0.8 ms. An agent makes
eleven requests a round and a keep-alive every TTL/3; at a thousand agents on one machine (the scale
benchmark), or beside a training job, that CPU is what runs out. Here a call is written to the socket by
the calling thread, and one reader thread per connection (it sleeps in poll() until the member sends
something) parses the frames and hands each stream its messages on a queue: one hand-off per reply.

Timing that survives a starved process: a call's deadline runs from the moment its request was handed to
the kernel, and before it fails the waiting thread reads whatever the kernel already holds for the
connection itself (the reader thread may simply not have run). So a reply that arrived in time is never
taken for a silent member because this process could not run.
"""

from __future__ import annotations

import queue
import select
import socket
import ssl
import struct
import threading
import time

import grpc

from elastic_rt.rendezvous.wire import (
    ACK, CONTINUATION, DATA, DEFAULT_MAX_FRAME, DEFAULT_WINDOW, END_HEADERS, END_STREAM, GOAWAY, HEAD_SIZE, HEADERS,
    MAX_WINDOW, PING, PREFACE, PRIORITY_FLAG, RST_STREAM, SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE, WINDOW_UPDATE, CallError, HeaderDecoder, client_settings, frame, frame_head,
    http_status_error, literal, message, parse_settings, request_prefix, reset_error, rst_stream, split_messages,
    timeout_field, trailer_status, u32, unpad, window_update,
)

SEND_TIMEOUT_S = 2.0  # a member that takes none of our bytes for this long: the connection is broken
_REPLENISH = 1 << 30  # consumed receive window given back once this much arrived (the windows are 2^31 - 1)
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class Stream:
    """One gRPC call on a Connection. Its messages arrive in order on `replies`, then its end: None (OK) or a
    CallError. `sent_at` is when its last request message was handed to the kernel (monotonic)."""

    __slots__ = ("conn", "id", "send_window", "pending", "end_pending", "inbuf", "unacked", "headers_seen",
                 "replies", "sent_at")

    def __init__(self, conn: "Connection", stream_id: int, window: int) -> None:
        self.conn, self.id, self.send_window = conn, stream_id, window
        self.pending, self.end_pending = bytearray(), False
        self.inbuf, self.unacked, self.headers_seen = bytearray(), 0, False
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        self.sent_at = 0.0

    def send(self, body: bytes) -> None:
        """One more request message (a streaming call)."""
        self.conn.send(self, message(body), end=False)

    def next(self, timeout_s: float | None) -> bytes | None:
        """The next message, or None once the call ended OK; raises CallError (DEADLINE_EXCEEDED when nothing
        came within timeout_s, None: wait as long as it takes). Before a timeout fails, what the kernel holds
        for the connection is read here: a reply that came in time counts even if the reader thread did not run."""
        try:
            item = self.replies.get(timeout=timeout_s) if timeout_s is None or timeout_s > 0 \
                else self.replies.get_nowait()
        except queue.Empty:
            self.conn.pump()
            try:
                item = self.replies.get_nowait()
            except queue.Empty:
                raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s:g} s") from None
        if item is None or isinstance(item, CallError):
            self.replies.put(item)  # the end stays the answer to every later call
            if item is not None:
                raise item
        return item

    def cancel(self) -> None:
        self.conn.cancel(self)


class Connection:
    """A client connection (h2c, or h2 over TLS through a memory BIO, so that the calling threads and the
    reader share one TLS session under one lock). Build it with a deadline for connecting; afterwards use it
    until `usable` is False (a broken connection fails every call on it with UNAVAILABLE)."""

    def __init__(self, host: str, port: int, *, authority: str, ssl_context: ssl.SSLContext | None,
                 timeout_s: float, name: str) -> None:
        self._authority, self._tls_on = authority, ssl_context is not None
        self._lock = threading.Lock()
        self._streams: dict[int, Stream] = {}
        self._blocked: list[Stream] = []  # streams with request bytes waiting for a send window
        self._next_id = 1
        self._window, self._initial, self._max_frame = DEFAULT_WINDOW, DEFAULT_WINDOW, DEFAULT_MAX_FRAME
        self._unacked = 0
        self._buf = bytearray()
        self._block: tuple[int, int, bytearray] | None = None  # a header block waiting for its CONTINUATION
        self._decoder = HeaderDecoder()
        self._prefixes: dict[str, bytes] = {}
        self.error: CallError | None = None
        self.goaway = False
        self.answered = False  # the member sent its SETTINGS
        self._tls: ssl.SSLObject | None = None
        self._sock = self._connect(host, port, ssl_context, timeout_s)
        self._reader = threading.Thread(target=self._run, name=f"elastic-rt-etcd-{name}", daemon=True)
        self._reader.start()

    # ---- connecting ---------------------------------------------------------------------------------
    def _connect(self, host: str, port: int, ctx: ssl.SSLContext | None, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=max(0.001, timeout_s))
        except socket.timeout:
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"connect: no answer within {timeout_s:g} s") from None
        except OSError as exc:
            raise CallError(_UNAVAILABLE, f"connect: {exc.strerror or exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ctx is not None:
                self._handshake(sock, ctx, host, deadline)
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0))
            self._sock = sock
            with self._lock:
                self._write(PREFACE + client_settings())
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket, ctx: ssl.SSLContext, host: str, deadline: float) -> None:
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ctx.wrap_bio(self._in, self._out, server_hostname=host)
        try:
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    if self._out.pending:
                        sock.sendall(self._out.read())
                    sock.settimeout(max(0.001, deadline - time.monotonic()))
                    data = sock.recv(65536)
                    if not data:
                        raise CallError(_UNAVAILABLE, "Socket closed during the TLS handshake") from None
                    self._in.write(data)
            if self._out.pending:
                sock.sendall(self._out.read())
        except ssl.SSLCertVerificationError as exc:
            raise CallError(_UNAVAILABLE, f"handshake failed: CERTIFICATE_VERIFY_FAILED {exc.verify_message}") from None
        except ssl.SSLError as exc:
            raise CallError(_UNAVAILABLE, f"handshake failed: {exc.reason or exc}") from None
        except socket.timeout:
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "TLS handshake: no answer in time") from None
        except OSError as exc:
            raise CallError(_UNAVAILABLE, f"TLS handshake: {exc.strerror or exc}") from None
        if tls.selected_alpn_protocol() != "h2":
            raise CallError(_UNAVAILABLE, "handshake failed: the server did not agree to HTTP/2 (ALPN h2)")
        self._tls = tls

    @property
    def usable(self) -> bool:
        return self.error is None and not self.goaway and self._next_id < MAX_WINDOW - 2

    def close(self) -> None:
        with self._lock:
            self._fail(CallError(_UNAVAILABLE, "connection closed by the client"))

    # ---- calls ----------------------------------------------------------------------------------------
    def open(self, path: str, metadata: tuple = (), *, timeout_s: float | None = None,
             body: bytes | None = None) -> Stream:
        """Start a call: a unary one with `body` (its only request, sent with the headers), else a streaming one
        (messages follow with Stream.send). `timeout_s` goes to etcd as grpc-timeout."""
        fields = self._prefixes.get(path)
        if fields is None:
            fields = self._prefixes[path] = request_prefix(path, self._authority, tls=self._tls_on)
        if timeout_s is not None:
            fields += timeout_field(timeout_s)
        for name, value in metadata:
            fields += literal(name.encode(), value.encode() if isinstance(value, str) else value)
        with self._lock:
            if self.error is not None:
                raise self.error
            if not self.usable:
                raise CallError(_UNAVAILABLE, "etcd is closing this connection (GOAWAY)")
            stream = Stream(self, self._next_id, self._initial)
            self._next_id += 2
            self._streams[stream.id] = stream
            out = self._header_frames(stream.id, fields)
            if body is not None:
                out += self._data(stream, message(body), end=True)
            self._write(out)
            stream.sent_at = time.monotonic()
        return stream

    def unary(self, path: str, body: bytes, timeout_s: float, metadata: tuple = ()) -> bytes:
        """One request, one reply (bytes); raises CallError. The deadline runs from the send (Stream.next)."""
        stream = self.open(path, metadata, timeout_s=timeout_s, body=body)
        try:
            reply = stream.next(timeout_s)
            if reply is None:
                raise CallError(grpc.StatusCode.INTERNAL, "etcd ended the call without an answer")
            stream.next(max(0.0, stream.sent_at + timeout_s - time.monotonic()))  # its trailers: the status
            return reply
        except CallError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.cancel(stream)
            raise

    def send(self, stream: Stream, data: bytes, *, end: bool) -> None:
        with self._lock:
            if self.error is not None:
                raise self.error
            if stream.id in self._streams:
                self._write(self._data(stream, data, end))
                stream.sent_at = time.monotonic()

    def cancel(self, stream: Stream) -> None:
        """End a call from this side (RST_STREAM CANCEL); its reader sees CANCELLED."""
        with self._lock:
            if self._streams.pop(stream.id, None) is None:
                return
            stream.replies.put(CallError(grpc.StatusCode.CANCELLED, "cancelled by the client"))
            if self.error is None:
                try:
                    self._write(rst_stream(stream.id))
                except CallError:
                    pass

    # ---- writing (the caller holds the lock) ------------------------------------------------------------
    def _header_frames(self, stream_id: int, block: bytes) -> bytes:
        size = self._max_frame
        if len(block) <= size:
            return frame(HEADERS, END_HEADERS, stream_id, block)
        parts = [block[i:i + size] for i in range(0, len(block), size)]
        return frame(HEADERS, 0, stream_id, parts[0]) + b"".join(
            frame(CONTINUATION, END_HEADERS if i == len(parts) - 1 else 0, stream_id, p)
            for i, p in enumerate(parts) if i)

    def _data(self, stream: Stream, data: bytes, end: bool) -> bytes:
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

    def _write(self, data: bytes) -> None:
        try:
            if self._tls is not None:
                self._tls.write(data)
                data = self._out.read()
            self._sock.sendall(data)
        except (OSError, ssl.SSLError) as exc:
            self._read_refusal()
            error = self.error or CallError(_UNAVAILABLE, f"connection broken: {exc}")
            self._fail(error)
            raise error from None

    def _read_refusal(self) -> None:
        """Before the member answered, a write that broke may follow a TLS alert the kernel already holds (etcd
        refused our certificate after a TLS 1.3 handshake and closed): read it, so that the call fails with
        the refusal and not as an outage."""
        if self._tls is None or self.answered or self.error is not None:
            return
        try:
            data = self._sock.recv(65536, socket.MSG_DONTWAIT)
        except OSError:
            return
        if data:
            self._tls_read(data)

    def _fail(self, error: CallError) -> None:
        """Every call on this connection ends with `error`; the reader thread closes the socket."""
        if self.error is not None:
            return
        self.error = error
        for stream in self._streams.values():
            stream.replies.put(error)
        self._streams.clear()
        self._blocked.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ---- reading --------------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        try:
            while self.error is None:
                poller.poll()
                self.pump()
        finally:
            self._sock.close()

    def pump(self) -> None:
        """Read what the kernel holds for this connection and handle every complete frame in it."""
        with self._lock:
            if self.error is not None:
                return
            try:
                data = self._sock.recv(262144, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._fail(CallError(_UNAVAILABLE, f"connection broken: {exc.strerror or exc}"))
                return
            if not data:
                self._fail(CallError(_UNAVAILABLE, "Socket closed" if not self.answered
                                     else "etcd closed the connection"))
                return
            try:
                self._receive(data)
            except CallError:
                pass  # the connection failed (every call was told)

    def _receive(self, data: bytes) -> None:
        if self._tls is not None:
            data = self._tls_read(data)
        buf = self._buf
        buf += data
        off, n = 0, len(buf)
        while n - off >= HEAD_SIZE:
            length, ftype, flags, sid = frame_head(buf, off)
            end = off + HEAD_SIZE + length
            if end > n:
                break
            payload = bytes(buf[off + HEAD_SIZE:end])
            off = end
            self._frame(ftype, flags, sid, payload)
            if self.error is not None:
                return
        del buf[:off]

    def _tls_read(self, data: bytes) -> bytes:
        self._in.write(data)
        out = bytearray()
        try:
            while chunk := self._tls.read(262144):
                out += chunk
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            self._fail(CallError(_UNAVAILABLE, "etcd closed the TLS session"))
        except ssl.SSLError as exc:  # an alert as the first record: the server refused our certificate
            why = f"handshake failed: {exc.reason or exc}" if not self.answered else f"TLS error: {exc.reason or exc}"
            self._fail(CallError(_UNAVAILABLE, why))
        if self._out.pending and self.error is None:
            self._sock.sendall(self._out.read())
        return bytes(out)

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == HEADERS:
            payload = unpad(flags, payload)
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
            self._write(frame(PING, ACK, 0, payload))
        elif ftype == SETTINGS and not flags & ACK:
            self._on_settings(payload)
        elif ftype == RST_STREAM:
            stream = self._streams.pop(sid, None)
            if stream is not None:
                stream.replies.put(reset_error(payload))
        elif ftype == GOAWAY:
            self.goaway = True
            last = u32(payload) if len(payload) >= 4 else 0
            for stream_id in [s for s in self._streams if s > last]:
                self._streams.pop(stream_id).replies.put(CallError(_UNAVAILABLE, "etcd went away (GOAWAY)"))

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        self._unacked += len(payload)
        if self._unacked >= _REPLENISH:
            self._write(window_update(0, self._unacked))
            self._unacked = 0
        stream = self._streams.get(sid)
        if stream is None:
            return
        stream.unacked += len(payload)
        if stream.unacked >= _REPLENISH:
            self._write(window_update(sid, stream.unacked))
            stream.unacked = 0
        stream.inbuf += unpad(flags, payload)
        for body in split_messages(stream.inbuf):
            stream.replies.put(body)
        if flags & END_STREAM:
            del self._streams[sid]
            stream.replies.put(CallError(grpc.StatusCode.INTERNAL, "etcd ended the call without a status"))

    def _on_headers(self, sid: int, flags: int, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block)
        except Exception as exc:  # noqa: BLE001 - hpack's errors: the connection's header state is lost
            self._fail(CallError(grpc.StatusCode.INTERNAL, f"undecodable headers from etcd: {exc!r}"))
            return
        stream = self._streams.get(sid)
        if stream is None:
            return
        if not stream.headers_seen:
            stream.headers_seen = True
            error = http_status_error(headers)
            if error is not None:
                del self._streams[sid]
                stream.replies.put(error)
                self._write(rst_stream(sid))
                return
            if not flags & END_STREAM:
                return
        if flags & END_STREAM:  # the trailers (or a trailers-only answer): the call's status
            del self._streams[sid]
            stream.replies.put(trailer_status(headers))

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
