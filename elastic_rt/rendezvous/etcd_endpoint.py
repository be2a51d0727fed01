"""One etcd member as EtcdClient sees it (its connection, auth token and lease keep-alive stream), and the
membership watch stream. Requests and replies are etcd's protobuf messages (`etcd-sdk-python`'s generated
classes); they travel over connection.py, not gRPC Python."""

from __future__ import annotations

import collections
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from pyetcd import etcdrpc

from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous import pb
from elastic_rt.rendezvous.connection import DRAIN_S, Connection, Stream, Tick
from elastic_rt.rendezvous.wire import CallError

_REPLIES = {
    "KV/Range": etcdrpc.RangeResponse, "KV/Put": etcdrpc.PutResponse, "KV/DeleteRange": etcdrpc.DeleteRangeResponse,
    "KV/Txn": etcdrpc.TxnResponse, "Lease/LeaseGrant": etcdrpc.LeaseGrantResponse,
    "Lease/LeaseRevoke": etcdrpc.LeaseRevokeResponse, "Auth/Authenticate": etcdrpc.AuthenticateResponse,
    "Maintenance/Status": etcdrpc.StatusResponse,
}
_PATHS = {method: f"/etcdserverpb.{method}" for method in (*_REPLIES, "Lease/LeaseKeepAlive", "Watch/Watch")}


def label(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Endpoint:
    """A member: one connection, made on first use and again after it broke; `metadata` is the auth token
    (None: not authenticated yet; (): no auth)."""

    def __init__(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> None:
        self.host, self.port = host, port
        self.label = label(host, port)
        self._ssl = ssl_context
        self._conn: Connection | None = None
        self._conn_lock = threading.Lock()
        self._closed = False
        self.metadata: tuple | None = None
        self.auth_lock = threading.Lock()
        self.keepalive_lock = threading.Lock()
        self.keepalive: _KeepAliveStream | None = None  # opened by the first keep-alive, kept while it works
        self.busy: collections.deque[float] = collections.deque(maxlen=64)  # when etcd answered a keep-alive
        # that it timed out (monotonic): its leader was too far behind in applying to renew

    def connection(self, timeout_s: float) -> Connection:
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        with self._conn_lock:
            if self._closed:
                raise ValueError(f"etcd client for {self.label} is closed")
            conn = self._conn
            if conn is None or not conn.usable:
                if conn is not None:
                    conn.close()
                self._conn = None
                conn = self._conn = Connection(self.host, self.port, authority=self.label, ssl_context=self._ssl,
                                               timeout_s=timeout_s, name=self.label)
        return conn

    def call(self, method: str, request, timeout_s: float, metadata: tuple | None = None, tick: Tick | None = None,
             *, detach: bool = False):
        """One unary call; raises CallError (a grpc.RpcError). `request`: a protobuf message, or its bytes (pb.py).
        `tick`, `detach`: see Connection.unary."""
        body = self.connection(timeout_s).unary(_PATHS[method], request if type(request) is bytes
                                                else request.SerializeToString(), timeout_s,
                                                self.metadata or () if metadata is None else metadata, tick,
                                                detach=detach)
        return _REPLIES[method].FromString(body)

    def stream(self, method: str, timeout_s: float, metadata: tuple = (), first: tuple[bytes, ...] = (),
               on_item: Callable[[object], None] | None = None) -> Stream:
        """A streaming call; its `first` requests are written with its headers, in one write; `on_item`: its messages
        pushed (Connection.open)."""
        return self.connection(timeout_s).open(_PATHS[method], metadata, first=first, on_item=on_item)

    def keep_alive(self, lease_id: int, timeout_s: float, silent_s: float | None = None) -> Renewal | None:
        """One keep-alive on this member's long-lived LeaseKeepAlive stream (opened on first use and again after
        it broke or the auth token changed), and the answers etcd sent until timeout_s after it, to it or to earlier
        ones that came late: the newest renewal, or None when none came (or etcd said that it timed out: its
        leader is busy, and every member forwards to that leader). With `silent_s`, a member that owed an answer
        and sent this connection nothing for that long fails the call at once with DEADLINE_EXCEEDED; the stream
        stays: its requests may still reach etcd and renew the lease, and their late answers are matched to them
        here. A stream that broke is dropped."""
        with self.keepalive_lock:
            stream = self.keepalive
            if stream is None or stream.metadata is not self.metadata:
                if stream is not None:
                    stream.close()
                stream = self.keepalive = _KeepAliveStream(self, timeout_s)
            try:
                return stream.beat(lease_id, timeout_s, float("inf") if silent_s is None else silent_s)
            except BaseException as exc:
                late = isinstance(exc, CallError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if not late:  # the stream broke (or this call did): the next keep-alive opens a new one
                    stream.close()
                    self.keepalive = None
                    if isinstance(exc, CallError) and _busy(exc):
                        self.busy.append(time.monotonic())
                        return None
                raise

    def drop_keepalive(self) -> None:
        """Close this member's keep-alive stream (the client moved its calls to another member); the connection
        stays, and the next keep-alive here opens a new stream."""
        with self.keepalive_lock:
            if self.keepalive is not None:
                self.keepalive.close()
                self.keepalive = None

    def close(self, drain_s: float = DRAIN_S) -> None:
        """Close the connection, waiting up to drain_s for its detached calls (Connection.close)."""
        self.drop_keepalive()
        with self._conn_lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close(drain_s)
                self._conn = None


def _busy(exc: CallError) -> bool:
    """etcd answered that it timed out (its leader busy: "etcdserver: request timed out, waiting for the applied
    index took too long"): the member is there, another member would forward to the same leader."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and \
        (exc.details() or "").startswith("etcdserver: request timed out")


@dataclass(frozen=True)
class Renewal:
    """An answered keep-alive: the TTL etcd gave (0 or less: the lease is gone), when its request was sent,
    whether it answers the keep-alive just sent (else an earlier one's late answer), and the raft term of the member
    that answered (a new term: the leader may have changed)."""

    ttl: float
    sent_at: float  # monotonic
    own: bool
    term: int = 0


class _KeepAliveStream:
    """One LeaseKeepAlive stream held open, as etcd's own clients do: a keep-alive is a message on it, sent on
    schedule whether or not earlier ones were answered (the caller holds the endpoint's lock). etcd answers every
    request on the stream once, in order, so the n-th answer is the n-th request's: each answer renews from
    its own request's send time. Time is judged on the wire: a keep-alive's wait runs from when its request
    reached the kernel, and the member's silence from the last bytes this connection read from it (Stream.next
    reads what the kernel holds before a deadline fails)."""

    def __init__(self, ep: Endpoint, timeout_s: float) -> None:
        self.metadata = ep.metadata
        self._conn = ep.connection(timeout_s)
        self._stream: Stream | None = None  # opened by the first beat, which goes with its headers (one write)
        self._unanswered: collections.deque[float] = collections.deque()  # send times, oldest first
        self._owed_since = 0.0  # when the oldest unanswered keep-alive was sent to a member that owed nothing

    def beat(self, lease_id: int, timeout_s: float, silent_s: float) -> Renewal | None:
        try:
            self._conn.claim()  # this thread reads the answer: the reader thread is not woken for it
            return self._beat(lease_id, timeout_s, silent_s)
        finally:
            self._conn.unclaim()

    def _beat(self, lease_id: int, timeout_s: float, silent_s: float) -> Renewal | None:
        request = pb.lease_keep_alive(lease_id)
        if self._stream is None:
            self._stream = self._conn.open(_PATHS["Lease/LeaseKeepAlive"], self.metadata or (), first=(request,))
        else:
            self._stream.send(request)
        sent = self._stream.sent_at
        if not self._unanswered:
            self._owed_since = sent
        self._unanswered.append(sent)
        deadline = sent + timeout_s
        newest: Renewal | None = None
        while True:
            until = min(deadline, max(self._conn.heard_at, self._owed_since) + silent_s)
            try:
                reply = self._stream.next(max(0.0, until - time.monotonic()))
            except CallError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                now = time.monotonic()
                silent = now - max(self._conn.heard_at, self._owed_since) >= silent_s
                if silent and newest is None:
                    raise
                if silent or now >= deadline:
                    return newest  # late answers to earlier keep-alives, or none yet from a member that is there
                continue  # the member sent something meanwhile: wait on for this keep-alive's answer
            if reply is None:
                raise CallError(grpc.StatusCode.UNAVAILABLE, "etcd ended the keep-alive stream")
            resp = etcdrpc.LeaseKeepAliveResponse.FromString(reply)
            asked_at = self._unanswered.popleft() if self._unanswered else sent
            if resp.ID != lease_id:
                continue  # the answer to a keep-alive of a lease given up since
            if resp.TTL <= 0:
                return Renewal(0.0, asked_at, not self._unanswered, resp.header.raft_term)
            newest = Renewal(float(resp.TTL), asked_at, not self._unanswered, resp.header.raft_term)
            if newest.own:
                return newest

    def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()


class WatchCompacted(Exception):
    """A watch's start revision was compacted away: re-read, then watch from the new revision."""


def _create(key_range: tuple[str, bytes], start_revision: int, deletes_only: bool) -> bytes:
    """A WatchRequest that creates a watcher of `key_range` from `start_revision` (only its deletions, if so)."""
    return pb.watch_create(key_range[0].encode(), key_range[1], start_revision, no_put=deletes_only)


_FORGOTTEN = -1  # a pending create whose range forget() dropped


class WatchStream:
    """A Watch stream with one watcher per key range, its answers pushed to the caller on the connection's reader
    thread, in order: on_event(range index, events, created) for each (a create answered after forget() dropped its
    range comes as (-1, [], True)), then once on_end(error): None after close(); else EtcdUnavailableError (the stream
    broke, or etcd cancelled it or ended it), WatchCompacted, or what on_event raised. on_event and on_end must not
    wait on etcd: the thread that calls them is the one that reads etcd's answers.

    The stream asks etcd to cancel it when its member loses the raft leader ("hasleader"), so a member cut
    from its cluster cannot leave it silently stale. `decode(event)` turns each event into the caller's form.
    """

    def __init__(self, ep: Endpoint, ranges: list[tuple[str, bytes]], start_revisions: list[int], *,
                 deletes_only: frozenset[int], timeout_s: float, decode,
                 on_event: Callable[[int, list, bool], None], on_end: Callable[[Exception | None], None]) -> None:
        self.endpoint = ep.label
        self._decode = decode
        self._on_event, self._on_end = on_event, on_end
        self._lock = threading.Lock()  # creates are answered in the order they were sent
        self._index: dict[int, int] = {}  # etcd's watch id -> range index
        self._idle: set[int] = set()  # watchers forget() dropped without a cancel: cancelled at their first answer
        self._pending: collections.deque[int] = collections.deque()  # range indexes of creates not yet answered
        self._closed = False
        self._ended = False
        creates = [_create(r, rev, i in deletes_only) for i, (r, rev) in enumerate(zip(ranges, start_revisions))]
        self._pending.extend(range(len(creates)))  # the watchers go with the stream's headers, in one write
        try:
            with self._lock:  # its first answers wait for self._stream (_on_item)
                self._stream = ep.stream("Watch/Watch", timeout_s, tuple(ep.metadata or ()) + (("hasleader", "true"),),
                                         first=tuple(creates), on_item=self._on_item)
        except CallError as exc:
            raise EtcdUnavailableError(f"etcd at {ep.label}: cannot open the watch: {exc.details()}") from exc

    def add(self, index: int, key_range: tuple[str, bytes], start_revision: int, *, deletes_only: bool = False) -> None:
        """One more watcher on this stream; its events come as range `index`."""
        with self._lock:
            self._pending.append(index)
            try:
                self._stream.send(_create(key_range, start_revision, deletes_only))
            except CallError:
                pass  # the stream broke: on_end says so

    def forget(self, index: int, *, cancel: bool = True) -> None:
        """Ignore the events of range `index`'s watchers from now on, and ask etcd to cancel them (one whose
        create etcd has not answered yet is cancelled when it does: a later add() may reuse the index). With
        cancel=False a watcher etcd created is cancelled when it sends its first answer (an event), not now: one
        write and one answer fewer while it stays idle, for a watcher that sees next to nothing (the deletion of a
        key already gone: MembershipView), and never more than one answer from it."""
        with self._lock:
            for i, pending in enumerate(self._pending):
                if pending == index:
                    self._pending[i] = _FORGOTTEN
            dropped = [w for w, i in self._index.items() if i == index]
            for watch_id in dropped:
                del self._index[watch_id]
            if not cancel:
                self._idle.update(dropped)
        if cancel:
            for watch_id in dropped:
                self._cancel(watch_id)

    @property
    def idle_watchers(self) -> int:
        """Watchers forget(cancel=False) dropped that have sent nothing since (etcd still holds them)."""
        with self._lock:
            return len(self._idle)

    def _cancel(self, watch_id: int) -> None:
        self._send(etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch_id)))

    def _send(self, request) -> None:
        try:
            self._stream.send(request.SerializeToString())
        except CallError:
            pass  # the stream broke: on_end says so

    def _on_item(self, item) -> None:
        """One message of the stream, or its end (the connection's reader thread, in order)."""
        with self._lock:  # __init__ has set self._stream
            if self._ended:
                return
        try:
            if item is None:
                raise EtcdUnavailableError(f"etcd at {self.endpoint} ended the watch stream")
            if isinstance(item, CallError):
                raise EtcdUnavailableError(f"etcd watch at {self.endpoint} broke: {item.code().name} {item.details()}")
            self._answer(etcdrpc.WatchResponse.FromString(item))
        except Exception as exc:  # noqa: BLE001 - whatever ends the stream goes to on_end
            self._end(exc)

    def _answer(self, resp) -> None:
        if resp.created:
            with self._lock:
                index = self._pending.popleft()
                if index != _FORGOTTEN:
                    self._index[resp.watch_id] = index
            if index == _FORGOTTEN:
                self._cancel(resp.watch_id)
                self._on_event(_FORGOTTEN, [], True)  # a create answered all the same (the caller counts them)
                return
        index = self._index.get(resp.watch_id)
        if index is None:
            with self._lock:
                idle = resp.watch_id in self._idle and not resp.canceled
                self._idle.discard(resp.watch_id)
            if idle:
                self._cancel(resp.watch_id)  # a dropped watcher answered: it is cancelled now, at its first answer
            return  # a watcher forget() dropped: its cancel, its last events, a compaction of its start
        if resp.compact_revision:
            raise WatchCompacted(f"revision compacted up to {resp.compact_revision}")
        if resp.canceled:
            raise EtcdUnavailableError(f"etcd at {self.endpoint} cancelled the watch: "
                                       f"{resp.cancel_reason or 'no reason given'}")
        self._on_event(index, [self._decode(ev) for ev in resp.events], resp.created)

    def _end(self, error: Exception | None) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._stream.cancel()
        self._on_end(None if self._closed else error)

    def close(self) -> None:
        """End the stream: on_end(None) follows (at once, or on the reader thread, after what came before)."""
        self._closed = True
        self._stream.cancel()
