"""One HTTP/2 connection to one etcd member: its socket and TLS session, every call on it, one reader thread.

Why not gRPC Python: a unary call there costs about 0.3 ms of CPU (a thread hand-off to gRPC's event
engine and back, five context switches, objects enough to run the garbage collector), a streaming call
a thread of its own that consumes the requests, and a keep-alive on a stream 0.3-0.8 ms. An agent makes
eleven requests a round and a keep-alive every TTL/3; at a thousand agents on one machine (the scale
benchmark), or beside a training job, that CPU is what runs out. Here a call is written to the socket by
the calling thread, and the thread that waits for the reply reads the socket itself (it holds the connection's
read token meanwhile): no thread hand-off for a reply. One reader thread per connection sleeps in epoll and reads
when no caller does; while a caller reads, the reader's interest in the socket is switched off (it is not woken for
the reply). Whoever reads parses the frames and hands each stream its messages on a queue; a stream opened with
`on_item` (the membership view's watch) is handed its messages by the reader thread (woken through an eventfd when
a caller read them), or, under delivering_here(), by the caller that read them: a thread that holds no lock across
a request that a receiver takes (the rounds' requests, whose watch events come with their answers).

Timing that survives a starved process: a call's deadline runs from the moment its request was handed to
the kernel, and before it fails the waiting thread reads whatever the kernel already holds for the
connection itself (the thread that reads may simply not have run). So a reply that arrived in time is never
taken for a silent member because this process could not run.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import queue
import select
import socket
import ssl
import struct
import termios
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from elastic_rt.rendezvous.daemon import Daemon
from elastic_rt.rendezvous.frames import ACK_DELAY_S, ACK_HOLD_S, Stream, StreamTable
from elastic_rt.rendezvous.wire import (
    MAX_WINDOW, PREFACE, CallError, client_settings, literal, message, request_prefix, rst_stream, timeout_field,
)

log = logging.getLogger(__name__)
SEND_TIMEOUT_S = 2.0  # a member that takes none of our bytes for this long: the connection is broken
DRAIN_S = 5.0  # how long close() waits for the ends of calls it abandoned (Connection.abandon)
_READ_MAX = 262144  # bytes one read takes from the kernel (into the connection's buffer: _pump)
_INT = struct.Struct("i")
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_here = threading.local()  # .on: this thread hands push streams their items itself (delivering_here)


class delivering_here:  # noqa: N801 - used as a function: `with delivering_here():`
    """While it waits for a reply, this thread hands the push streams (the membership view's watch) the items it
    reads itself, instead of waking the reader thread for them: for a thread that holds no lock across a request that
    a receiver takes (a receiver never waits on etcd: WatchStream). The rounds' requests (rounds.py): the watch events
    of a round's writes come with their answers, and the round waits for its view to show them next. (A class, not a
    generator: entered for every request of a round.)"""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        self._before = getattr(_here, "on", False)
        _here.on = True

    def __exit__(self, *exc) -> None:
        _here.on = self._before


@dataclass(frozen=True)
class Tick:
    """Something a caller does while it waits for a reply (Connection.unary): `fn()` every `every_s` seconds of the
    wait, counted from the request's send. A registration's put keeps its new lease alive with it (lease.py)."""

    every_s: float
    fn: Callable[[], None]

    def __post_init__(self) -> None:
        if not self.every_s > 0:
            raise ValueError(f"a tick every {self.every_s} s: must be > 0")


def _ticking(stream: Stream, timeout_s: float, tick: Tick, clock: Callable[[], float] = time.monotonic,
             ended: Callable[[], bool] = lambda: False) -> bytes | None:
    """stream.next() within timeout_s of the request's send, calling tick.fn() each tick.every_s of the wait.
    `ended()`: the call has ended (its end came: etcd's own deadline, say), so a deadline now is not this wait's."""
    deadline, due = stream.sent_at + timeout_s, stream.sent_at + tick.every_s
    while due < deadline:
        try:
            return stream.next(max(0.0, due - clock()))
        except CallError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            if ended():  # its reply, if one came just after this wait, else its end again: no more ticks
                return stream.next(0.0)
        tick.fn()
        now = clock()
        due = due + tick.every_s if due + tick.every_s > now else now + tick.every_s  # a late tick is not made up for
    return stream.next(max(0.0, deadline - clock()))


def _drain_eventfd(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:  # another thread drained it
        pass


def _numeric_family(host: str) -> int | None:
    """AF_INET or AF_INET6 for an address literal, else None (a name)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return family
        except OSError:
            pass
    return None


def _open_socket(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to host:port. An address literal (the usual --rdzv-endpoint) is connected to directly:
    socket.create_connection() would resolve it with getaddrinfo first (about 60 us of an agent's first round)."""
    family = _numeric_family(host)
    if family is None:
        return socket.create_connection((host, port), timeout=timeout_s)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class Connection(StreamTable):
    """A client connection (h2c, or h2 over TLS through a memory BIO, so that every thread that writes or reads
    shares one TLS session under one lock). Build it with a deadline for connecting; afterwards use it until
    `usable` is False (a broken connection fails every call on it with UNAVAILABLE)."""

    def __init__(self, host: str, port: int, *, authority: str, ssl_context: ssl.SSLContext | None,
                 timeout_s: float, name: str) -> None:
        super().__init__()
        self._authority, self._tls_on = authority, ssl_context is not None
        self._lock = threading.Lock()
        self._delivering = threading.Lock()  # held by the thread that hands push streams their items (_deliver)
        self._reading = threading.Lock()  # the read token: held by the one thread that reads the socket now
        self._claimed = 0  # the thread that took the token before its write (claim()), until its wait uses it
        self._closed = False  # the reader thread closed the socket and its descriptors (under the token and _lock)
        self._blocks: dict[tuple, bytes] = {}  # (path, timeout_s, metadata) -> the request's header block
        self._tls: ssl.SSLObject | None = None
        self._preface = b""  # what goes before the first request (_connect)
        self.heard_at = time.monotonic()  # when the member last sent this connection anything (monotonic)
        # Every read lands here first, under _lock, and is copied out at its size. recv(_READ_MAX) would allocate
        # _READ_MAX bytes per read and give most back: on a thread's malloc arena that memory is returned to the
        # kernel and faulted in again read after read (2 page faults and about 18 us more per small read, measured
        # on a 2-core VM where a fault costs several us). An anonymous mapping's pages cost nothing until a read
        # first reaches them, and then stay: the largest read so far is what the connection holds.
        self._rbuf = mmap.mmap(-1, _READ_MAX, flags=mmap.MAP_PRIVATE)  # anonymous, not shared with a fork
        self._sock = self._connect(host, port, ssl_context, timeout_s)
        self._fd = self._sock.fileno()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # the reader thread's doorbell
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # the read token holder's (_catch_up)
        self._epoll = select.epoll(2)
        self._epoll.register(self._fd, select.EPOLLIN)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._poller = select.poll()  # the read token holder's (one thread at a time)
        self._poller.register(self._fd, select.POLLIN)
        self._poller.register(self._bell, select.POLLIN)
        self._reader = Daemon(self._run, f"elastic-rt-etcd-{name}")
        self._reader.start()

    # ---- connecting ---------------------------------------------------------------------------------
    def _connect(self, host: str, port: int, ctx: ssl.SSLContext | None, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        try:
            sock = _open_socket(host, port, max(0.001, timeout_s))
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
            self._preface = PREFACE + client_settings()  # sent with the first request (_write)
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

    def close(self, drain_s: float = DRAIN_S) -> None:
        """Close it; detached calls (unary's `detach`) still waited for, or abandoned (abandon()) and not ended by etcd
        yet, are waited for up to drain_s first (their ends are read meanwhile): closing ends their contexts at etcd
        too."""
        deadline = time.monotonic() + drain_s
        while self.error is None and time.monotonic() < deadline and self._detached_open():
            time.sleep(0.01)
        with self._lock:
            self._fail(CallError(_UNAVAILABLE, "connection closed by the client"))
        self._deliver()

    def _detached_open(self) -> bool:
        with self._lock:
            return bool(self.abandoned) or any(s.detached for s in self._streams.values())

    # ---- calls ----------------------------------------------------------------------------------------
    def open(self, path: str, metadata: tuple = (), *, timeout_s: float | None = None,
             body: bytes | None = None, first: tuple[bytes, ...] = (),
             on_item: Callable[[object], None] | None = None) -> Stream:
        """Start a call: a unary one with `body` (its only request, sent with the headers), else a streaming one
        whose `first` requests go with the headers, in the same write (more follow with Stream.send).
        `timeout_s` goes to etcd as grpc-timeout. With `on_item`, the stream's messages and then its end are handed
        to on_item (Stream), not queued: on this connection's reader thread, no other thread to wake."""
        key = (path, timeout_s, metadata)
        fields = self._blocks.get(key)
        if fields is None:  # a call's header block depends on these alone: encoded once per connection
            fields = request_prefix(path, self._authority, tls=self._tls_on)
            if timeout_s is not None:
                fields += timeout_field(timeout_s)
            for name, value in metadata:
                fields += literal(name.encode(), value.encode() if isinstance(value, str) else value)
            if len(self._blocks) >= 256:
                self._blocks.clear()
            self._blocks[key] = fields
        with self._lock:
            if self.error is not None:
                raise self.error
            if not self.usable:
                raise CallError(_UNAVAILABLE, "etcd is closing this connection (GOAWAY)")
            stream = self._new_stream(on_item)
            out = self._header_frames(stream.id, fields)
            if body is not None:
                out += self._data(stream, message(body), end=True)
            elif first:
                out += self._data(stream, b"".join(map(message, first)), end=False)
            self._write(out)
            stream.sent_at = time.monotonic()
        return stream

    def unary(self, path: str, body: bytes, timeout_s: float, metadata: tuple = (), tick: Tick | None = None, *,
              detach: bool = False) -> bytes:
        """One request, one reply (bytes); raises CallError. The deadline runs from the send (Stream.next). With
        `tick`, tick.fn() is called every tick.every_s of the wait for the reply, by this thread. With `detach`, etcd
        is not told the deadline and the call is not reset when this side gives up: it is abandoned (its answer,
        when it comes, is dropped), and etcd's context for it never ends before its answer (see abandon())."""
        try:
            self.claim()
            stream = self.open(path, metadata, timeout_s=None if detach else timeout_s, body=body)
            stream.detached = detach
            try:
                reply = stream.next(timeout_s) if tick is None else _ticking(
                    stream, timeout_s, tick, ended=lambda: stream.id not in self._streams)
                if reply is None:
                    raise CallError(grpc.StatusCode.INTERNAL, "etcd ended the call without an answer")
                stream.next(max(0.0, stream.sent_at + timeout_s - time.monotonic()))  # its trailers: the status
                return reply
            except BaseException:  # a deadline passed, the tick failed, or the call ended: given up (nothing to
                (self.abandon if detach else self.cancel)(stream)  # cancel when it ended)
                raise
        finally:
            self.unclaim()

    def send(self, stream: Stream, data: bytes, *, end: bool) -> None:
        with self._lock:
            if self.error is not None:
                raise self.error
            if stream.id in self._streams:
                self._write(self._data(stream, data, end))
                stream.sent_at = time.monotonic()

    def cancel(self, stream: Stream) -> None:
        """End a call from this side (RST_STREAM CANCEL); its reader sees CANCELLED."""
        self._end(stream, reset=True)

    def abandon(self, stream: Stream) -> None:
        """Give a call up without ending it at etcd (no RST_STREAM); its reader sees CANCELLED, and what etcd sends
        for it later is read and dropped (the connection's window still counts it). For a read-only Txn: etcd
        3.5.0-3.5.4 crash (a panic, "unexpected error during txn") when such a call's context ends while its ranges
        are read, as a reset or a passed grpc-timeout ends it (etcd-io/etcd#14110, fixed in 3.5.5)."""
        self._end(stream, reset=False)

    def _end(self, stream: Stream, *, reset: bool) -> None:
        with self._lock:
            if self._streams.pop(stream.id, None) is None:
                return
            reset = reset or bool(stream.pending)  # a request not all sent: etcd has not begun it, and waits for
            # the rest (nothing else ends that stream at etcd)
            self._put(stream, CallError(grpc.StatusCode.CANCELLED, "cancelled by the client"))
            if not reset:
                self.abandoned.add(stream.id)
            elif self.error is None:
                try:
                    self._write(rst_stream(stream.id))
                except CallError:
                    pass
        self._deliver()

    def _write(self, data: bytes) -> None:
        if self._acks and time.monotonic() - self._acks_at >= ACK_HOLD_S:  # etcd's BDP pings' answers (frames.py)
            data = bytes(self._acks) + data
            self._acks.clear()
        if self._preface:  # this connection's preface and SETTINGS, before anything else, in its first request's
            data, self._preface = self._preface + data, b""  # write: one system call, and (plaintext) the member's
            # SETTINGS come with the answer, read by the caller, not by the reader thread woken for them
        try:
            if self._tls is not None:
                self._tls.write(data)
                data = self._out.read()
            self._sock.sendall(data)
        except (OSError, ssl.SSLError) as exc:
            self._read_refusal()
            error = self.error or self._broken(exc)
            self._fail(error)
            raise error from None

    def _broken(self, exc: Exception) -> CallError:
        """A connection that broke: before the member ever answered it is "Socket closed", as gRPC says of a
        TLS-only etcd that a plaintext client met (it closes, or resets when our preface was still unread),
        and worth a TLS check; after, an outage."""
        why = getattr(exc, "strerror", None) or exc
        if not self.answered:
            return CallError(_UNAVAILABLE, f"Socket closed before etcd answered ({why})")
        return CallError(_UNAVAILABLE, f"connection broken: {why}")

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
            self._put(stream, error)
        self._streams.clear()
        self._blocked.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ---- reading --------------------------------------------------------------------------------------
    def claim(self) -> None:
        """Take the read token before writing a request whose answer this thread will wait for (Stream.next), and
        switch the reader thread's interest in the socket off now. Switched off only once the wait began, after the
        write, the answer (a fraction of a millisecond later on a LAN) had often woken the reader thread already,
        which then waited for the GIL and the token only to find the socket empty: a wake-up, a dozen futex calls and
        an empty read per call. Nothing is taken when another thread reads now (it queues the answer) or the
        connection failed. Call it inside a try whose finally calls unclaim(): the caller's first wait uses the
        claim, and unclaim() gives back one that no wait used (a reply another thread's catch-up queued, a failed
        write); it does nothing where no claim of this thread is left."""
        if not self._reading.acquire(blocking=False):
            return
        mine = threading.get_ident()
        try:
            if self.error is None and not self._closed:
                self._epoll.modify(self._fd, 0)
                self._claimed = mine  # last: set, the token is the caller's to give back (unclaim, or its wait)
        finally:
            if self._claimed != mine:  # not taken: a failed connection, or an exception (a stop signal's) on the way
                if not self._closed:
                    self._epoll.modify(self._fd, select.EPOLLIN)
                self._reading.release()

    def unclaim(self) -> None:
        """Give back the token claim() took, unless a wait used it (the wait gave it back)."""
        if self._claimed != threading.get_ident():
            return
        self._claimed = 0
        try:
            self._epoll.modify(self._fd, select.EPOLLIN)  # open: the reader thread closes it only under the token
        finally:
            if self._deliveries and not self._closed:  # push streams' ends a failure queued while the token was
                os.eventfd_write(self._wake, 1)  # held: the reader thread hands them over, as after a wait
            self._reading.release()

    def wait(self, stream: Stream, timeout_s: float | None) -> bytes | CallError | None:
        """The next item for `stream`, whose queue is empty (Stream.next); raises CallError DEADLINE_EXCEEDED. The
        calling thread reads the socket itself when no other thread does (_read_for); else the thread that does
        queues the item. Before a deadline fails, what the kernel holds for the connection is read here: a reply
        that came in time counts even if the thread that reads did not run."""
        claimed = self._claimed == threading.get_ident()
        if claimed or self._reading.acquire(blocking=False):
            try:
                self._claimed = 0
                if self.error is None and not self._closed:
                    self._read_for(stream, timeout_s, switched_off=claimed)
                elif claimed:
                    self._epoll.modify(self._fd, select.EPOLLIN)  # open: the reader closes it under the token
            finally:
                if self._deliveries and not self._closed:  # what this thread read for the push streams
                    os.eventfd_write(self._wake, 1)
                self._reading.release()
        else:
            try:
                return stream.replies.get(timeout=timeout_s) if timeout_s is None or timeout_s > 0 \
                    else stream.replies.get_nowait()
            except queue.Empty:
                try:
                    self._catch_up(stream)
                finally:
                    self._deliver()
        try:
            return stream.replies.get_nowait()
        except queue.Empty:
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s:g} s") from None

    def _read_for(self, stream: Stream, timeout_s: float | None, switched_off: bool = False) -> None:
        """Read the socket on this thread, which holds the read token, until `stream` has an item, the connection
        failed or timeout_s passed (after a last read of what the kernel holds). Meanwhile the reader thread's epoll
        does not wake it for the socket's data (a hang-up still does: it then waits for the token), and a thread whose
        deadline passed while it waited on its queue may read the socket too (_catch_up): it rings this thread's bell.
        Items for the push streams are handed over by this thread under delivering_here(), else by the reader thread
        (woken for them). A BDP ping's answer read here goes with the next write (the lease's keep-alive writes every
        TTL/3), or when the reader thread next wakes (_run): never a wake-up of its own."""
        try:  # from the first line: an exception anywhere (a stop signal's) leaves the reader thread's interest on
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            here = getattr(_here, "on", False)
            if not switched_off:  # (claim() switched it off before the write)
                self._epoll.modify(self._fd, 0)
            while stream.replies.empty() and self.error is None:
                wait_ms = -1 if deadline is None else max(0, int(1000 * (deadline - time.monotonic()) + 0.999))
                ready = self._poller.poll(wait_ms)
                if not ready and wait_ms == 0:
                    self._pump()  # the deadline: one last read (a socket closed under this call fails it here)
                    return
                for fd, events in ready:
                    if fd == self._bell:
                        _drain_eventfd(self._bell)
                    elif events & select.POLLNVAL:  # its descriptor closed: the read fails the connection
                        self._pump()
                        return
                    else:
                        self._pump()
                if self._deliveries:
                    if here:
                        self._deliver()
                    else:
                        os.eventfd_write(self._wake, 1)
        finally:
            self._epoll.modify(self._fd, select.EPOLLIN)

    def _catch_up(self, stream: Stream) -> None:
        """Read what the kernel holds for this connection now, all of it (a backlog of other streams' data, a watch's,
        may be ahead of `stream`'s answer), or until `stream` has an item: at most as many bytes as it held when this
        began. A thread that holds the read token meanwhile is told (its bell): what it waits for may be among it."""
        try:
            held = _INT.unpack(fcntl.ioctl(self._sock.fileno(), termios.FIONREAD, bytes(_INT.size)))[0]
        except (OSError, ValueError):  # ValueError: the reader thread closed the socket (its descriptor is -1)
            held = 1  # unknown: one read (_pump: nothing on a failed connection, a clean failure on a closed socket)
        read = 0
        while held > 0 and stream.replies.empty():
            got = self._pump()
            if not got:
                break
            held -= got
            read += got
        if read:
            with self._lock:
                if not self._closed:
                    os.eventfd_write(self._bell, 1)

    def _run(self) -> None:
        try:
            while self.error is None:
                due = self._acks_at + ACK_DELAY_S - time.monotonic() if self._acks else None
                for fd, _ in self._epoll.poll(-1 if due is None else max(0.0, due) + 0.001):
                    if fd == self._wake:
                        _drain_eventfd(self._wake)
                    else:  # the socket: unless a caller reads it now (then this waits for it to be done)
                        with self._reading:
                            self._pump()
                self._deliver()
                if self._acks and time.monotonic() - self._acks_at >= ACK_DELAY_S:
                    self._send_acks()
        finally:
            with self._reading, self._lock:  # no thread polls or rings a descriptor while it is closed
                self._fail(CallError(_UNAVAILABLE, "the connection's reader stopped"))  # a no-op after a failure
                self._closed = True
                self._sock.close()
                self._epoll.close()
                os.close(self._wake)
                os.close(self._bell)
                self._rbuf.close()  # no read follows: _pump reads only while error is None
            self._deliver()  # the ends of the push streams that the failure ended

    def _send_acks(self) -> None:
        """Answer etcd's pending BDP pings now: nothing was written for ACK_DELAY_S that could take them."""
        with self._lock:
            if self._acks and self.error is None:
                try:
                    self._write(b"")
                except CallError:
                    pass  # the connection failed (every call was told)

    def _deliver(self) -> None:
        """Hand push streams (Stream.on_item) their items, in order, outside the connection's lock (an on_item may
        call into this connection, or take a lock whose holder writes on it): by one thread at a time, and a thread
        that finds another doing it leaves its items to that one (which looks again before it stops)."""
        while self._deliveries:
            if not self._delivering.acquire(blocking=False):
                return
            try:
                while True:
                    with self._lock:
                        items, self._deliveries = self._deliveries, []
                    if not items:
                        break
                    for on_item, item in items:
                        try:
                            on_item(item)
                        except Exception:  # noqa: BLE001 - the reader thread must outlive any one receiver
                            log.exception("etcd connection %s: a stream's receiver failed", self._authority)
            finally:
                self._delivering.release()

    def _pump(self) -> int:
        """One read of what the kernel holds (at most _READ_MAX bytes), handled; how many bytes it read."""
        with self._lock:
            if self.error is not None:
                return 0
            try:
                got = self._sock.recv_into(self._rbuf, _READ_MAX, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return 0
            except OSError as exc:
                self._fail(self._broken(exc))
                return 0
            if not got:
                self._fail(CallError(_UNAVAILABLE, "Socket closed" if not self.answered
                                     else "etcd closed the connection"))
                return 0
            self.heard_at = time.monotonic()
            try:
                self._receive(self._rbuf[:got])
            except CallError:
                pass  # the connection failed (every call was told)
            return got

    def _receive(self, data: bytes) -> None:
        if self._tls is not None:
            data = self._tls_read(data)
        self._receive_frames(data)

    def _tls_read(self, data: bytes) -> bytes:
        self._in.write(data)
        out = bytearray()
        try:
            while got := self._tls.read(_READ_MAX, self._rbuf):  # the read's bytes are in the BIO by now
                out += self._rbuf[:got]
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
