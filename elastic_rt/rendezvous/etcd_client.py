"""The only module that talks to etcd: a small v3 client over gRPC with endpoint failover.

It uses the generated stubs of `etcd-sdk-python` (import name `pyetcd`), the
maintained fork of python-etcd3, and nothing else of it, so that every call has
an explicit deadline, every read returns the header revision that watches start
from, and every gRPC error is translated here into EtcdUnavailableError.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

# gRPC's C core logs failed TLS handshakes and refused client certificates on stderr (at INFO and
# ERROR: "Corruption detected", "Decryption error: TSI_DATA_CORRUPTED"); every failure of a call is
# reported here as one line instead. gRPC reads GRPC_VERBOSITY when it is imported: NONE for that
# import only, so that workers inherit the agent's environment unchanged. An explicit
# GRPC_VERBOSITY (e.g. ERROR or DEBUG, to see gRPC's own lines) still wins.
_GRPC_QUIET = "GRPC_VERBOSITY" not in os.environ
if _GRPC_QUIET:
    os.environ["GRPC_VERBOSITY"] = "NONE"
try:
    import grpc  # noqa: E402
finally:
    if _GRPC_QUIET:
        del os.environ["GRPC_VERBOSITY"]
from pyetcd import etcdrpc  # noqa: E402

from elastic_rt.errors import ConfigError, EtcdUnavailableError, LeaseGoneError  # noqa: E402
from elastic_rt.rendezvous.etcd_access import access_error, check_tls, needs_tls_check  # noqa: E402

log = logging.getLogger(__name__)

# gRPC's default reconnect backoff grows to two minutes: an etcd member that comes
# back would stay unused that long. Rendezvous needs it within a second.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}

# A thread reading a gRPC response stream (the membership watch) waits on a condition that gRPC
# notifies on every message, cancellation and end of the call, but it also wakes every 0.1 s to look
# (grpc._common.MAXIMUM_WAIT_TIMEOUT, kept from when such waits could not be interrupted): ten
# pointless GIL acquisitions a second per stream, which in one process holding hundreds of handlers
# (benchmarks/rendezvous_scale.py) is most of the idle CPU. A wait with a timeout still ends on time
# (gRPC waits min(remaining, this)); a missed notification would cost up to 1 s instead of 0.1 s.
GRPC_WAIT_SLICE_S = 1.0


def _lengthen_grpc_wait_slice() -> None:
    common = getattr(grpc, "_common", None)
    if common is not None and getattr(common, "MAXIMUM_WAIT_TIMEOUT", GRPC_WAIT_SLICE_S) < GRPC_WAIT_SLICE_S:
        common.MAXIMUM_WAIT_TIMEOUT = GRPC_WAIT_SLICE_S


_lengthen_grpc_wait_slice()


@dataclass(frozen=True, kw_only=True)
class EtcdConfig:
    """How to reach etcd: endpoints tried in order, TLS and credentials.

    TLS is used when `tls` is set (https:// endpoints) or any TLS file is given;
    without ca_cert the server is verified against gRPC's default root certificates.
    """

    endpoints: tuple[tuple[str, int], ...]
    request_timeout_s: float = 5.0
    tls: bool = False
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("etcd client certificate: give both cert= and key= in --rdzv-conf (or neither)")

    @property
    def secure(self) -> bool:
        return bool(self.tls or self.ca_cert or self.cert)

    def describe(self) -> str:
        return ",".join(_label(h, p) for h, p in self.endpoints)

    def __repr__(self) -> str:  # never print the password
        return (f"EtcdConfig(endpoints={self.describe()}, secure={self.secure}, user={self.user!r}, "
                f"password={'***' if self.password else None})")


def _label(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    deleted: bool
    kv: KeyValue  # for a delete: the key and the revision it was deleted at, no value


class WatchCompacted(Exception):
    """A watch's start revision was compacted away: re-read, then watch from the new revision."""


def _kv(kv) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.lease)


def _is_deadline(exc: grpc.RpcError) -> bool:
    """A stream that ran out its deadline (etcd reports some as UNKNOWN 'context deadline exceeded')."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    return code == grpc.StatusCode.DEADLINE_EXCEEDED or (
        code == grpc.StatusCode.UNKNOWN and "deadline" in details
    )


def prefix_end(prefix: str) -> bytes:
    """The range end that selects every key starting with `prefix`."""
    b = bytearray(prefix.encode())
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


class _Endpoint:
    def __init__(self, host: str, port: int, config: EtcdConfig, creds: grpc.ChannelCredentials | None) -> None:
        self.host, self.port = host, port
        self.label = _label(host, port)
        if creds is not None:
            self.channel = grpc.secure_channel(self.label, creds, options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(self.label, options=_CHANNEL_OPTIONS)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.auth = etcdrpc.AuthStub(self.channel)
        self.maintenance = etcdrpc.MaintenanceStub(self.channel)
        self.metadata: tuple | None = None  # the auth token; None: not authenticated yet
        self.auth_lock = threading.Lock()
        self.keepalive_lock = threading.Lock()
        self.keepalive: _KeepAliveStream | None = None  # opened by the first keep-alive, kept while it works

    def keep_alive(self, lease_id: int, timeout_s: float) -> float:
        """One keep-alive on this endpoint's long-lived LeaseKeepAlive stream (opened on first use and
        again after it broke or the auth token changed); returns the remaining TTL. A reply that does not
        come within timeout_s fails this call, and the stream stays: the request may still reach etcd
        and renew the lease (cancelling would drop it wherever it waits, in a loaded client too), and
        its late reply is skipped by the next keep-alive here. A stream that broke is dropped."""
        with self.keepalive_lock:
            stream = self.keepalive
            if stream is None or stream.metadata is not self.metadata:
                if stream is not None:
                    stream.close()
                stream = self.keepalive = _KeepAliveStream(self)
            try:
                return stream.beat(lease_id, timeout_s)
            except BaseException as exc:
                late = isinstance(exc, _StreamFailure) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if not late:  # the stream broke (or this call did): the next keep-alive opens a new one
                    stream.close()
                    self.keepalive = None
                raise

    def close(self) -> None:
        with self.keepalive_lock:
            if self.keepalive is not None:
                self.keepalive.close()
                self.keepalive = None
        self.channel.close()


class _StreamFailure(grpc.RpcError):
    """A long-lived stream's reply did not come in time, or the stream ended: reported to EtcdClient._call
    like the same failure of a unary call (DEADLINE_EXCEEDED, UNAVAILABLE), so it fails over alike."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _KeepAliveStream:
    """One LeaseKeepAlive stream held open, as etcd's own clients do: a keep-alive is a message on it,
    not a new stream (a new stream costs gRPC a thread and ~4x the CPU of a message). One keep-alive
    at a time (the caller holds the endpoint's lock); a thread reads the replies. etcd answers every
    request on the stream once, in order, so the reply to the n-th request is the n-th reply: replies
    to requests that timed out earlier are skipped."""

    def __init__(self, ep: _Endpoint) -> None:
        self.metadata = ep.metadata
        self._requests: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self._closed = False
        self._sent = self._received = 0
        self._stream = ep.lease.LeaseKeepAlive(self._outgoing(), metadata=self.metadata)
        self._reader = threading.Thread(target=self._read, name=f"elastic-rt-keepalive-{ep.label}", daemon=True)
        self._reader.start()

    def _outgoing(self):
        while (req := self._requests.get()) is not None:
            yield req

    def _read(self) -> None:
        try:
            for resp in self._stream:
                self._replies.put(resp)
            self._replies.put(_StreamFailure(grpc.StatusCode.UNAVAILABLE, "etcd ended the keep-alive stream"))
        except grpc.RpcError as exc:
            self._replies.put(exc)

    def beat(self, lease_id: int, timeout_s: float) -> float:
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        self._sent += 1
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise _StreamFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s:g} s") from None
            if isinstance(reply, BaseException):
                raise reply
            self._received += 1
            if self._received == self._sent:  # the reply to this request (earlier ones' came late)
                return float(reply.TTL) if reply.ID == lease_id else 0.0

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._requests.put(None)
            self._stream.cancel()


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _credentials(config: EtcdConfig) -> grpc.ChannelCredentials | None:
    if not config.secure:
        return None
    try:
        return grpc.ssl_channel_credentials(_read(config.ca_cert), _read(config.key), _read(config.cert))
    except OSError as exc:
        raise ConfigError(f"cannot read etcd TLS file {exc.filename}: {exc.strerror}; see --rdzv-conf") from exc


def _expired_token(code, details: str) -> bool:
    return code == grpc.StatusCode.UNAUTHENTICATED and "invalid auth token" in details


class EtcdClient:
    """Thread-safe etcd v3 client: KV, transactions, leases, one-shot watches."""

    def __init__(self, config: EtcdConfig) -> None:
        if not config.endpoints:
            raise ConfigError("no etcd endpoint given; see --rdzv-endpoint")
        self.config = config
        creds = _credentials(config)
        self._endpoints = [_Endpoint(h, p, config, creds) for h, p in config.endpoints]
        self._current = 0
        self._lock = threading.Lock()

    # ---- plumbing -------------------------------------------------------
    @property
    def current_endpoint(self) -> str:
        """The endpoint calls go to first (it changes on failover)."""
        with self._lock:
            return self._endpoints[self._current].label

    def close(self) -> None:
        for ep in self._endpoints:
            ep.close()

    def _call(self, fn: Callable[[_Endpoint, float], object], timeout_s: float | None = None,
              attempts: int | None = None):
        """Run fn on the current endpoint; on an unreachable one, fail over to the next.

        With `attempts`, at most that many endpoints are tried; the next call starts at the
        one after the last that failed (the lease keepalive tries one endpoint per beat).
        """
        timeout = self.config.request_timeout_s if timeout_s is None else timeout_s
        errors: list[str] = []
        with self._lock:
            start = self._current
        tries = len(self._endpoints) if attempts is None else max(1, min(attempts, len(self._endpoints)))
        for i in range(tries):
            idx = (start + i) % len(self._endpoints)
            ep = self._endpoints[idx]
            try:
                result = self._authenticated(ep, fn, timeout)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                access = self._refusal(ep, code, (exc.details() if hasattr(exc, "details") else "") or "", timeout)
                if access is not None:
                    raise access from None
                if code in _RETRYABLE:
                    why = "no answer within %g s" % timeout if code == grpc.StatusCode.DEADLINE_EXCEEDED \
                        else "unavailable"
                    errors.append(f"{ep.label}: {why}")
                    continue
                details = exc.details() if hasattr(exc, "details") else exc
                error = LeaseGoneError if code == grpc.StatusCode.NOT_FOUND and "lease not found" in str(details) \
                    else EtcdUnavailableError
                raise error(
                    f"etcd at {ep.label} refused the request: {code.name if code else 'error'} {details}"
                ) from exc
            if idx != start:
                with self._lock:
                    self._current = idx
                log.info("etcd: failed over to %s", ep.label)
            return result
        if tries < len(self._endpoints):
            with self._lock:
                if self._current == start:
                    self._current = (start + tries) % len(self._endpoints)
        raise EtcdUnavailableError(
            f"etcd at {self.config.describe()} is not reachable "
            f"({'; '.join(errors)}); is it running? see --rdzv-endpoint"
        )

    def _refusal(self, ep: _Endpoint, code, details: str, timeout: float):
        """The EtcdAccessError this failure proves (TLS, auth, permission), else None: retry or fail over."""
        access = access_error(ep.label, self.config, code, details)
        if access is None and needs_tls_check(code, details, secure=self.config.secure):
            access = check_tls(ep.host, ep.port, ep.label, self.config, min(timeout, 5.0))
        return access

    def _authenticated(self, ep: _Endpoint, fn: Callable[[_Endpoint, float], object], timeout: float):
        """fn with a valid token; an expired token is replaced once and the call retried."""
        self._authenticate(ep, timeout)
        try:
            return fn(ep, timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if self.config.user is None or not _expired_token(code, exc.details() or ""):
                raise
        log.info("etcd at %s: auth token of user %s expired; authenticating again", ep.label, self.config.user)
        self._authenticate(ep, timeout, stale=ep.metadata)
        return fn(ep, timeout)

    def _authenticate(self, ep: _Endpoint, timeout: float, stale: tuple | None = None) -> None:
        if self.config.user is None:
            return
        with ep.auth_lock:
            if ep.metadata is not None and ep.metadata is not stale:
                return  # authenticated (again) by another thread meanwhile
            try:
                resp = ep.auth.Authenticate(
                    etcdrpc.AuthenticateRequest(name=self.config.user, password=self.config.password or ""),
                    timeout=timeout,
                )
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in (exc.details() or ""):
                    log.warning("etcd at %s: authentication is not enabled; user %s is not used",
                                ep.label, self.config.user)
                    ep.metadata = ()
                    return
                raise
            ep.metadata = (("token", resp.token),)

    # ---- KV ---------------------------------------------------------------
    def get(self, key: str) -> tuple[KeyValue | None, int]:
        """The key (or None) and the store revision it was read at."""
        req = etcdrpc.RangeRequest(key=key.encode())
        resp = self._call(lambda ep, t: ep.kv.Range(req, timeout=t, metadata=ep.metadata))
        kv = _kv(resp.kvs[0]) if resp.kvs else None
        return kv, resp.header.revision

    def count_prefix(self, prefix: str) -> int:
        req = etcdrpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix), count_only=True)
        resp = self._call(lambda ep, t: ep.kv.Range(req, timeout=t, metadata=ep.metadata))
        return int(resp.count)

    def put(self, key: str, value: bytes, *, lease: int = 0, timeout_s: float | None = None) -> int:
        req = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease)
        resp = self._call(lambda ep, t: ep.kv.Put(req, timeout=t, metadata=ep.metadata), timeout_s)
        return resp.header.revision

    def delete(self, key: str) -> bool:
        req = etcdrpc.DeleteRangeRequest(key=key.encode())
        resp = self._call(lambda ep, t: ep.kv.DeleteRange(req, timeout=t, metadata=ep.metadata))
        return resp.deleted > 0

    def compare_and_put(
        self, key: str, value: bytes, *, expected_mod_revision: int | None, lease: int = 0,
        timeout_s: float | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Put if the key's mod_revision is `expected` (None: only if absent).

        Returns (succeeded, the key as it is after the transaction).
        """
        if expected_mod_revision is None:
            cmp = etcdrpc.Compare(
                result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.CREATE,
                key=key.encode(), create_revision=0,
            )
        else:
            cmp = etcdrpc.Compare(
                result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.MOD,
                key=key.encode(), mod_revision=expected_mod_revision,
            )
        get = etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key.encode()))
        put = etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease))
        req = etcdrpc.TxnRequest(compare=[cmp], success=[put, get], failure=[get])
        resp = self._call(lambda ep, t: ep.kv.Txn(req, timeout=t, metadata=ep.metadata), timeout_s)
        rng = resp.responses[-1].response_range
        return bool(resp.succeeded), (_kv(rng.kvs[0]) if rng.kvs else None)

    def delete_range(self, start: str, end: str) -> int:
        """Delete every key k with start <= k < end."""
        req = etcdrpc.DeleteRangeRequest(key=start.encode(), range_end=end.encode())
        resp = self._call(lambda ep, t: ep.kv.DeleteRange(req, timeout=t, metadata=ep.metadata))
        return int(resp.deleted)

    def delete_ranges(self, ranges: list[tuple[str, str]]) -> int:
        """Delete every key k with start <= k < end, for each (start, end), in one transaction."""
        ops = [etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=a.encode(), range_end=b.encode()))
               for a, b in ranges]
        req = etcdrpc.TxnRequest(compare=[], success=ops, failure=[])
        resp = self._call(lambda ep, t: ep.kv.Txn(req, timeout=t, metadata=ep.metadata))
        return sum(int(r.response_delete_range.deleted) for r in resp.responses)

    def delete_ranges_if_empty(self, ranges: list[tuple[str, str]], *, empty: tuple[str, bytes]) -> int:
        """delete_ranges, in a transaction that does it only while no key k with start <= k < end of `empty`
        exists (etcd compares an empty range as one key of version 0). Returns the keys deleted (0: not done)."""
        cmp = etcdrpc.Compare(result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.VERSION,
                              key=empty[0].encode(), range_end=empty[1], version=0)
        ops = [etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=a.encode(), range_end=b.encode()))
               for a, b in ranges]
        req = etcdrpc.TxnRequest(compare=[cmp], success=ops, failure=[])
        resp = self._call(lambda ep, t: ep.kv.Txn(req, timeout=t, metadata=ep.metadata))
        return sum(int(r.response_delete_range.deleted) for r in resp.responses) if resp.succeeded else 0

    def read_many(self, keys: list[str], prefixes: list[str]) -> tuple[list[KeyValue | None], list[list[KeyValue]], int]:
        """Read several keys and prefixes in one round trip, at one revision."""
        ops = [etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=k.encode())) for k in keys]
        ops += [
            etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=p.encode(), range_end=prefix_end(p)))
            for p in prefixes
        ]
        req = etcdrpc.TxnRequest(compare=[], success=ops, failure=[])
        resp = self._call(lambda ep, t: ep.kv.Txn(req, timeout=t, metadata=ep.metadata))
        ranges = [r.response_range for r in resp.responses]
        singles = [(_kv(r.kvs[0]) if r.kvs else None) for r in ranges[: len(keys)]]
        multis = [[_kv(kv) for kv in r.kvs] for r in ranges[len(keys):]]
        return singles, multis, resp.header.revision

    def read_ranges(self, ranges: list[tuple[str, bytes]], *, keys_only: frozenset[int] = frozenset(),
                    first_only: frozenset[int] = frozenset()) -> tuple[list[list[KeyValue]], int]:
        """Every key k with start <= k < end, for each (start, end), in one round trip at one revision;
        the ranges whose indexes are in `keys_only` come without values (b""), those in `first_only` as
        their smallest key only, or none (a limit etcd applies while it reads: O(1), where the greatest
        key would cost it a sort of the whole range)."""
        ops = [etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
                   key=a.encode(), range_end=b, keys_only=i in keys_only, limit=1 if i in first_only else 0))
               for i, (a, b) in enumerate(ranges)]
        req = etcdrpc.TxnRequest(compare=[], success=ops, failure=[])
        resp = self._call(lambda ep, t: ep.kv.Txn(req, timeout=t, metadata=ep.metadata))
        return [[_kv(kv) for kv in r.response_range.kvs] for r in resp.responses], resp.header.revision

    # ---- leases -----------------------------------------------------------
    def grant_lease(self, ttl_s: float, *, timeout_s: float | None = None) -> int:
        req = etcdrpc.LeaseGrantRequest(TTL=max(1, int(round(ttl_s))))
        resp = self._call(lambda ep, t: ep.lease.LeaseGrant(req, timeout=t, metadata=ep.metadata), timeout_s)
        return int(resp.ID)

    def refresh_lease(self, lease_id: int, *, timeout_s: float | None = None, attempts: int | None = None) -> float:
        """Send one keep-alive; returns the remaining TTL (0 or less: the lease is gone).

        A message on the endpoint's long-lived keep-alive stream. The lease thread passes a
        deadline of at most a third of the TTL and one attempt, so a hung member costs one beat,
        and the next beat goes to the next endpoint (on a stream of its own).
        """
        return self._call(lambda ep, t: ep.keep_alive(lease_id, t), timeout_s=timeout_s, attempts=attempts)

    def revoke_lease(self, lease_id: int) -> None:
        req = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self._call(lambda ep, t: ep.lease.LeaseRevoke(req, timeout=t, metadata=ep.metadata))
        except EtcdUnavailableError as exc:
            if "NOT_FOUND" not in str(exc):
                raise

    # ---- watches ----------------------------------------------------------
    def status_latency_s(self) -> tuple[str, float]:
        """Round trip of one Status call to the current endpoint: (version, seconds)."""
        t0 = time.monotonic()
        resp = self._call(
            lambda ep, t: ep.maintenance.Status(etcdrpc.StatusRequest(), timeout=t, metadata=ep.metadata)
        )
        return resp.version, time.monotonic() - t0

    # ---- used by the c10d Store (EtcdStore) ---------------------------------
    def list_prefix(self, prefix: str, *, keys_only: bool = False, limit: int = 0,
                    oldest_first: bool = False) -> tuple[list[KeyValue], int]:
        """Keys under `prefix` (by key, or oldest created first) and the revision they were read at."""
        req = etcdrpc.RangeRequest(
            key=prefix.encode(), range_end=prefix_end(prefix), keys_only=keys_only, limit=limit,
            sort_order=etcdrpc.RangeRequest.ASCEND if oldest_first else etcdrpc.RangeRequest.NONE,
            sort_target=etcdrpc.RangeRequest.CREATE if oldest_first else etcdrpc.RangeRequest.KEY,
        )
        resp = self._call(lambda ep, t: ep.kv.Range(req, timeout=t, metadata=ep.metadata))
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    def count_many(self, keys: list[str], prefixes: list[str]) -> tuple[list[int], int]:
        """How many keys exist at each key, then under each prefix, in one round trip at one revision."""
        ranges = [etcdrpc.RangeRequest(key=k.encode(), count_only=True) for k in keys]
        ranges += [etcdrpc.RangeRequest(key=p.encode(), range_end=prefix_end(p), count_only=True) for p in prefixes]
        req = etcdrpc.TxnRequest(compare=[], success=[etcdrpc.RequestOp(request_range=r) for r in ranges], failure=[])
        resp = self._call(lambda ep, t: ep.kv.Txn(req, timeout=t, metadata=ep.metadata))
        return [int(r.response_range.count) for r in resp.responses], resp.header.revision

    def put_many(self, items: list[tuple[str, bytes]], *, lease: int = 0) -> int:
        """Put every (key, value) in one transaction (keys must be distinct)."""
        ops = [etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=k.encode(), value=v, lease=lease))
               for k, v in items]
        req = etcdrpc.TxnRequest(compare=[], success=ops, failure=[])
        resp = self._call(lambda ep, t: ep.kv.Txn(req, timeout=t, metadata=ep.metadata))
        return resp.header.revision

    def delete_if_unchanged(self, key: str, mod_revision: int) -> bool:
        """Delete `key` only if its mod_revision is still `mod_revision`; True if this call deleted it."""
        cmp = etcdrpc.Compare(result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.MOD,
                              key=key.encode(), mod_revision=mod_revision)
        delete = etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key.encode()))
        req = etcdrpc.TxnRequest(compare=[cmp], success=[delete], failure=[])
        resp = self._call(lambda ep, t: ep.kv.Txn(req, timeout=t, metadata=ep.metadata))
        return bool(resp.succeeded) and resp.responses[0].response_delete_range.deleted > 0

    def wait_for_any(self, keys: list[str], prefixes: list[str], *, after_revision: int, timeout_s: float) -> bool:
        """Block until a key or a key under a prefix changes after `after_revision` (True), or timeout_s passes
        (False); one watch stream for all of them. A compacted history also returns True: re-read."""
        if timeout_s <= 0:
            return False
        creates = [etcdrpc.WatchCreateRequest(key=k.encode(), start_revision=after_revision + 1) for k in keys]
        creates += [etcdrpc.WatchCreateRequest(key=p.encode(), range_end=prefix_end(p), start_revision=after_revision + 1)
                    for p in prefixes]
        requests = [etcdrpc.WatchRequest(create_request=c) for c in creates]

        def watch(ep: _Endpoint, t: float) -> bool:
            stream = ep.watch.Watch(iter(requests), timeout=t, metadata=ep.metadata)
            try:
                for resp in stream:
                    if resp.compact_revision or resp.events:
                        return True  # a change, or history compacted: the caller re-reads either way
                    if resp.canceled:
                        raise EtcdUnavailableError(f"etcd cancelled a watch: {resp.cancel_reason}")
                return False
            except grpc.RpcError as exc:
                if _is_deadline(exc):
                    return False
                raise
            finally:
                stream.cancel()

        return self._call(watch, timeout_s=timeout_s)
    def open_watch(self, ranges: list[tuple[str, bytes]], start_revisions: list[int], *,
                   deletes_only: frozenset[int] = frozenset()) -> "WatchStream":
        """One Watch stream on the current endpoint, a watcher per (start, end) range from its revision;
        the watchers of the range indexes in `deletes_only` get no put events (etcd's NOPUT filter)."""
        with self._lock:
            ep = self._endpoints[self._current]
        try:
            self._authenticate(ep, self.config.request_timeout_s)
        except grpc.RpcError as exc:
            raise EtcdUnavailableError(f"etcd at {ep.label}: cannot authenticate the watch: {exc.code().name}") from exc
        return WatchStream(ep, ranges, start_revisions, deletes_only=deletes_only)


class WatchStream:
    """A gRPC Watch stream with one watcher per key range; iterate it for (range index, events).

    The stream asks etcd to cancel it when its member loses the raft leader
    ("hasleader"), so a member cut from its cluster cannot leave it silently stale.
    Iteration ends with EtcdUnavailableError (stream broken or cancelled),
    WatchCompacted, or normally after close().
    """

    def __init__(self, ep: _Endpoint, ranges: list[tuple[str, bytes]], start_revisions: list[int], *,
                 deletes_only: frozenset[int] = frozenset()) -> None:
        self.endpoint = ep.label
        self._requests: queue.Queue = queue.Queue()
        self._index: dict[int, int] = {}  # etcd's watch id -> range index (ids come back in create order)
        self._pending: collections.deque[int] = collections.deque()  # range indexes of creates not yet answered
        for i, ((start, end), rev) in enumerate(zip(ranges, start_revisions)):
            self.add(i, (start, end), rev, deletes_only=i in deletes_only)
        self._closed = False
        metadata = tuple(ep.metadata or ()) + (("hasleader", "true"),)
        self._stream = ep.watch.Watch(self._outgoing(), metadata=metadata)

    def add(self, index: int, key_range: tuple[str, bytes], start_revision: int, *, deletes_only: bool = False) -> None:
        """One more watcher on this stream; its events come as range `index`."""
        filters = [etcdrpc.WatchCreateRequest.NOPUT] if deletes_only else []
        create = etcdrpc.WatchCreateRequest(key=key_range[0].encode(), range_end=key_range[1],
                                            start_revision=start_revision, filters=filters)
        self._pending.append(index)
        self._requests.put(etcdrpc.WatchRequest(create_request=create))

    def forget(self, index: int) -> None:
        """Ignore the events of range `index`'s watchers from now on, and ask etcd to cancel them."""
        for watch_id in [w for w, i in self._index.items() if i == index]:
            del self._index[watch_id]
            self._requests.put(etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch_id)))

    def _outgoing(self):
        while True:
            req = self._requests.get()
            if req is None:
                return
            yield req

    def __iter__(self):
        try:
            for resp in self._stream:
                if resp.created:
                    self._index[resp.watch_id] = self._pending.popleft()
                if resp.compact_revision:
                    raise WatchCompacted(f"revision compacted up to {resp.compact_revision}")
                if resp.canceled and resp.watch_id not in self._index:
                    continue  # a watcher forget() cancelled
                if resp.canceled:
                    raise EtcdUnavailableError(f"etcd at {self.endpoint} cancelled the watch: "
                                               f"{resp.cancel_reason or 'no reason given'}")
                index = self._index.get(resp.watch_id)
                if index is None:
                    continue
                events = [WatchEvent(ev.type == 1, _kv(ev.kv)) for ev in resp.events]
                yield index, events, resp.created
        except grpc.RpcError as exc:
            if self._closed:
                return
            code = exc.code() if hasattr(exc, "code") else None
            raise EtcdUnavailableError(
                f"etcd watch at {self.endpoint} broke: {code.name if code else 'error'}"
            ) from exc
        finally:
            self._requests.put(None)
        if not self._closed:
            raise EtcdUnavailableError(f"etcd at {self.endpoint} ended the watch stream")

    def close(self) -> None:
        self._closed = True
        self._requests.put(None)
        self._stream.cancel()
