"""Who reads the etcd connection (connection.py): the thread that waits for a reply reads it itself, with no hand-off
from the reader thread; the reader thread reads when no caller does, and hands the push streams their items unless
the caller that read them does so under delivering_here(); a thread whose deadline passed while another held the
read token may read the socket too, and then wakes that one. Against a loopback peer that speaks the server side
of HTTP/2 (tests/support/h2_member.py)."""

from __future__ import annotations

import fcntl
import struct
import termios
import threading
import time

import pytest

from elastic_rt.rendezvous.connection import Connection, delivering_here
from elastic_rt.rendezvous.daemon import thread_name
from elastic_rt.rendezvous.wire import CallError
from tests.support.h2_member import Member, answer, connected, settings

KV_RANGE = "/etcdserverpb.KV/Range"
WATCH = "/etcdserverpb.Watch/Watch"


@pytest.fixture
def member_and_connection():
    with connected() as pair:
        yield pair


class _Readers:
    """Which threads took bytes from the connection's socket (Connection._pump), and how many."""

    def __init__(self, conn: Connection) -> None:
        self.bytes: dict[str, int] = {}
        pump = conn._pump  # noqa: SLF001

        def counted() -> int:
            got = pump()
            if got:
                name = thread_name()
                self.bytes[name] = self.bytes.get(name, 0) + got
            return got

        conn._pump = counted  # noqa: SLF001


def _held(conn: Connection) -> int:
    """Bytes the kernel holds for the connection's socket, unread."""
    return struct.unpack("i", fcntl.ioctl(conn._sock.fileno(), termios.FIONREAD, bytes(4)))[0]  # noqa: SLF001


def _settled(member: Member, conn: Connection) -> None:
    """The member's SETTINGS sent and answered (read by the reader thread: no call was waiting)."""
    member.sock.sendall(settings())
    deadline = time.monotonic() + 10
    while not conn.answered:
        assert time.monotonic() < deadline, "the reader thread never read the member's SETTINGS"
        time.sleep(0.005)


def _answer_when_asked(member: Member, conn: Connection, frames) -> threading.Thread:
    """A thread that waits for the client's next request (HEADERS and DATA of one stream), until the caller holds
    the read token, then sends frames(stream_id) in one write."""

    def run() -> None:
        while True:
            ftype, _, sid, _ = member.next_frame()
            if ftype == 1:  # HEADERS: the request's; its DATA follows in the same write
                break
        member.next_frame()
        deadline = time.monotonic() + 10
        while not conn._reading.locked():  # noqa: SLF001 - the caller waits on the socket itself
            assert time.monotonic() < deadline
            time.sleep(0.001)
        member.sock.sendall(frames(sid))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_unary_reply_is_read_by_the_thread_that_waits_for_it_not_the_reader_thread(member_and_connection):
    member, conn = member_and_connection
    _settled(member, conn)
    readers = _Readers(conn)
    peer = _answer_when_asked(member, conn, lambda sid: answer(sid, b"reply"))
    assert conn.unary(KV_RANGE, b"q", 10) == b"reply"
    peer.join(10)
    assert set(readers.bytes) == {thread_name()}  # the caller read every byte of it
    assert conn._reader.name not in readers.bytes  # noqa: SLF001


def test_the_reader_thread_reads_what_comes_while_no_call_waits(member_and_connection):
    member, conn = member_and_connection
    _settled(member, conn)
    got, done = [], threading.Event()
    stream = conn.open(WATCH, first=(b"w",), on_item=lambda item: (got.append((item, thread_name())),
                                                                  done.set()))
    member.sock.sendall(answer(stream.id, b"event", end=False))
    assert done.wait(10)
    assert got == [(b"event", conn._reader.name)]  # noqa: SLF001


@pytest.mark.parametrize("here", [False, True])
def test_a_push_item_read_by_a_caller_is_handed_over_by_the_reader_thread_unless_the_caller_delivers_here(
        member_and_connection, here):
    member, conn = member_and_connection
    _settled(member, conn)
    got, done = [], threading.Event()
    watch = conn.open(WATCH, first=(b"w",), on_item=lambda item: (got.append((item, thread_name())),
                                                                 done.set()))
    while member.next_frame()[0] != 0:  # the watch's headers, then its DATA (type 0): read before the call's
        pass
    readers = _Readers(conn)
    # the call's answer and a watch event in one write: both read by the caller
    peer = _answer_when_asked(member, conn, lambda sid: answer(watch.id, b"event", end=False) + answer(sid, b"reply"))
    if here:
        with delivering_here():
            assert conn.unary(KV_RANGE, b"q", 10) == b"reply"
        assert got == [(b"event", thread_name())]  # before the reply was returned
    else:
        assert conn.unary(KV_RANGE, b"q", 10) == b"reply"
        assert done.wait(10)
        assert got == [(b"event", conn._reader.name)]  # noqa: SLF001 - never a caller's thread
    peer.join(10)
    assert set(readers.bytes) == {thread_name()}


def test_a_thread_that_reads_the_socket_past_its_deadline_wakes_the_token_holder_whose_reply_it_took(
        member_and_connection):
    """Thread A holds the read token and waits for its reply. Thread B's deadline passes while it waits on its queue;
    before it fails, B reads what the kernel holds, A's reply among it. A must not sleep on to its own deadline."""
    member, conn = member_and_connection
    _settled(member, conn)
    a = conn.open(KV_RANGE, timeout_s=30, body=b"a")
    b = conn.open(KV_RANGE, timeout_s=30, body=b"b")
    polling, go = threading.Event(), threading.Event()
    poller = conn._poller  # noqa: SLF001

    class _Held:  # A's poll() starts only once B has read A's reply (as if A had not been scheduled meanwhile)
        def poll(self, timeout_ms):
            polling.set()
            go.wait(10)
            return poller.poll(timeout_ms)

    conn._poller = _Held()  # noqa: SLF001
    result: dict = {}

    def wait_a() -> None:
        started = time.monotonic()
        result["reply"] = a.next(20.0)
        result["waited_s"] = time.monotonic() - started

    thread_a = threading.Thread(target=wait_a, daemon=True)
    thread_a.start()
    assert polling.wait(10) and conn._reading.locked()  # noqa: SLF001 - A holds the token
    member.sock.sendall(answer(a.id, b"for a"))
    deadline = time.monotonic() + 10
    while _held(conn) < len(answer(a.id, b"for a")):  # all of it with the kernel
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with pytest.raises(CallError) as failed:
        b.next(0.05)  # B: its queue stays empty; past its deadline it reads the socket: A's reply
    assert failed.value.code().name == "DEADLINE_EXCEEDED"
    assert not a.replies.empty()  # B queued A's reply
    go.set()
    thread_a.join(20)
    assert result["reply"] == b"for a"
    assert result["waited_s"] < 10  # woken by B, not by its own deadline of 20 s


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the bug, on purpose
def test_a_reader_thread_that_stops_on_a_bug_fails_the_connection_so_it_is_replaced(member_and_connection,
                                                                                    monkeypatch):
    member, conn = member_and_connection
    receive = conn._receive  # noqa: SLF001

    def broken(data: bytes) -> None:
        if conn._reader.is_current():  # noqa: SLF001
            raise RuntimeError("a bug in the frame parser")
        receive(data)

    monkeypatch.setattr(conn, "_receive", broken)
    member.sock.sendall(settings())  # read by the reader thread, which dies of it
    conn._reader.join(10)  # noqa: SLF001
    assert not conn._reader.is_alive()  # noqa: SLF001
    assert not conn.usable and conn.error.code().name == "UNAVAILABLE"  # the endpoint connects anew
    with pytest.raises(CallError) as failed:
        conn.unary(KV_RANGE, b"q", 1)
    assert failed.value.code().name == "UNAVAILABLE"


def test_a_read_lands_in_the_connections_own_buffer_not_a_new_read_sized_allocation(member_and_connection):
    """recv(_READ_MAX) allocated 256 KiB per read and gave most of it back, which a thread's malloc arena returns to the
    kernel and faults in again read after read. A small reply is read without any allocation near _READ_MAX, and one
    of 40,192 bytes (three DATA frames, several reads) comes out whole through the same buffer."""
    import tracemalloc

    from elastic_rt.rendezvous.connection import _READ_MAX

    member, conn = member_and_connection
    _settled(member, conn)
    peer = _answer_when_asked(member, conn, lambda sid: answer(sid, b"reply"))
    tracemalloc.start()
    try:
        assert conn.unary(KV_RANGE, b"q", 10) == b"reply"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    peer.join(10)
    assert peak < _READ_MAX // 2, peak  # the test member's own recv(65536) is traced too
    big = bytes(range(256)) * 157
    peer = _answer_when_asked(member, conn, lambda sid: answer(sid, big))
    assert conn.unary(KV_RANGE, b"q", 10) == big
    peer.join(10)


def test_an_exception_right_after_claim_switched_the_reader_off_gives_the_token_back(member_and_connection):
    """A stop signal's exception (stop_signal.py raises it in the main thread, at any call's return) that lands just
    after claim() switched the reader thread's interest off: the call fails with it, the read token is free, the
    interest is on again, and the next call is answered at once (a token left held made every later call wait for
    its whole deadline)."""
    member, conn = member_and_connection
    _settled(member, conn)
    real = conn._epoll  # noqa: SLF001

    class Interrupting:
        def __init__(self) -> None:
            self.armed = True

        def modify(self, fd, events) -> None:
            real.modify(fd, events)
            if events == 0 and self.armed:
                self.armed = False
                raise KeyboardInterrupt

        def __getattr__(self, name):
            return getattr(real, name)

    conn._epoll = Interrupting()  # noqa: SLF001
    with pytest.raises(KeyboardInterrupt):
        conn.unary(KV_RANGE, b"q", 10)
    assert not conn._reading.locked() and conn._claimed == 0  # noqa: SLF001

    def respond() -> None:  # every request at once, whichever thread reads the answer (the interrupted call's
        try:  # request went out if the exception came in its wait, not in claim())
            while True:
                ftype, _, sid, _ = member.next_frame()
                if ftype == 1:  # a request's HEADERS; its DATA came in the same write
                    member.next_frame()
                    member.sock.sendall(answer(sid, b"reply"))
        except Exception:  # noqa: BLE001 - the test is over: the socket closed
            pass

    peer = threading.Thread(target=respond, daemon=True)
    peer.start()
    started = time.monotonic()
    assert conn.unary(KV_RANGE, b"q", 10) == b"reply"
    assert time.monotonic() - started < 5
