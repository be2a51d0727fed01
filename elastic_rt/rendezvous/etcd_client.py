"""The only module that talks to etcd: a small v3 client with endpoint failover.

It uses the protobuf messages of `etcd-sdk-python` (import name `pyetcd`), the maintained fork
of python-etcd3, and nothing else of it (the requests of a round are encoded by pb.py, byte for byte the same): calls travel over connection.py (gRPC's protocol on
one HTTP/2 connection per member, a fraction of gRPC Python's CPU per call), every call has an
explicit deadline, every read returns the header revision that watches start from, and every
failure is translated here into EtcdUnavailableError (or EtcdAccessError, LeaseGoneError).
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable

import grpc  # StatusCode: connection.py reports failures as gRPC statuses
from pyetcd import etcdrpc

from elastic_rt.errors import ConfigError, ElasticRTError, EtcdUnavailableError, LeaseGoneError
from elastic_rt.rendezvous import pb
from elastic_rt.rendezvous.etcd_access import access_error, check_tls, needs_tls_check, tls_context
from elastic_rt.rendezvous.connection import (  # noqa: F401 - Tick, delivering_here: the client's API too (rounds.py)
    DRAIN_S, Tick, delivering_here,
)
from elastic_rt.rendezvous.etcd_endpoint import Endpoint, Renewal, WatchCompacted, WatchStream, label
from elastic_rt.rendezvous.wire import CallError

__all__ = ["EtcdClient", "EtcdConfig", "IfAbsent", "IfHeld", "KeyValue", "Put", "RangeRead", "Renewal",
           "WatchCompacted", "WatchEvent", "WatchStream", "prefix_end"]

log = logging.getLogger(__name__)
LEADER_RETRY_S = 10.0  # follow_leader: after a look that found no leader among the endpoints, or keep-alives to the
# leader that failed, look again this long after (give or take a quarter), unless a keep-alive says the term changed
LEADER_MISSES = 3  # beats in a row the leader answered none of its own keep-alives: keep-alives leave it


@dataclass(frozen=True, kw_only=True)
class EtcdConfig:
    """How to reach etcd: endpoints tried in order from `first` (an index into `endpoints`; failover goes on to the
    next ones, wrapping round), TLS and credentials.

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
    first: int = 0
    home_retry_s: float = 30.0  # after a failover away from `first`: how often to see whether it answers again
    keepalive_to_leader: bool = True  # lease keep-alives go to the member that leads (follow_leader), where known

    def __post_init__(self) -> None:
        if self.endpoints and not 0 <= self.first < len(self.endpoints):
            raise ConfigError(f"etcd endpoint index {self.first} is not one of the {len(self.endpoints)} endpoints")
        if bool(self.cert) != bool(self.key):
            raise ConfigError("etcd client certificate: give both cert= and key= in --rdzv-conf (or neither)")

    @property
    def secure(self) -> bool:
        return bool(self.tls or self.ca_cert or self.cert)

    def describe(self) -> str:
        return ",".join(label(h, p) for h, p in self.endpoints)

    def __repr__(self) -> str:  # never print the password
        return (f"EtcdConfig(endpoints={self.describe()}, secure={self.secure}, user={self.user!r}, "
                f"password={'***' if self.password else None})")


def spread_first(spread_key: str, endpoints: int) -> int:
    """The endpoint (index) an agent named `spread_key` talks to first: a stable hash of its name, so that a job's
    agents spread evenly over etcd's members and an agent restarted under the same --node-id goes back to the same
    one."""
    return zlib.crc32(spread_key.encode()) % endpoints if endpoints > 1 else 0


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


def _kv(kv) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.lease)


def _event(ev) -> WatchEvent:
    return WatchEvent(ev.type == 1, _kv(ev.kv))


@dataclass(frozen=True)
class RangeRead:
    """Ranges to read in one request (EtcdClient.read_ranges' arguments): (start, end) each, the indexes of those
    read without values and of those read as their smallest key only."""

    ranges: list[tuple[str, bytes]]
    keys_only: frozenset[int] = frozenset()
    first_only: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Put:
    """One more key that a transaction puts (compare_and_put_then_read's `also`, put_then_read)."""

    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class GuardedPut:
    """A put that another transaction makes only while its key's mod_revision is `expected_mod_revision` (None: only
    while the key is absent): EtcdClient.create_with's `guarded`."""

    put: Put
    expected_mod_revision: int | None


@dataclass(frozen=True)
class IfHeld:
    """compare_and_put_else's and IfAbsent's `otherwise`: where their compare fails, `puts` are made in the same
    request (a transaction nested in the failure branch: etcd 3.3 and later) while `key` holds `value` (and each key
    of `also` its value) and no key of `absent` exists."""

    key: str
    value: bytes
    absent: tuple[str, ...] = ()
    puts: tuple[Put, ...] = ()
    also: tuple[tuple[str, bytes], ...] = ()

    def txn(self) -> bytes:
        held = [(self.key, self.value), *self.also]
        compare = [*(pb.compare_value(k.encode(), v) for k, v in held), *(_compare_mod(k, None) for k in self.absent)]
        return pb.txn_op(pb.txn(compare, [*map(_put_op, self.puts)], []))

    def outcome(self, resp) -> bool:
        """Whether its puts were made, from this transaction's answer (etcd's TxnResponse)."""
        made = bool(resp.succeeded)
        _expect_results(resp, len(self.puts) if made else 0)
        return made


# IfAbsent.outcome(): its puts made, the ranges it read, its `otherwise`'s puts made
Outcome = tuple[bool, list[list[KeyValue]], bool]


@dataclass(frozen=True)
class IfAbsent:
    """compare_and_put_then_read's `when`: where its compare succeeds, `puts` are made in the same request (a
    transaction nested in the success branch: etcd 3.3 and later) while no key of `absent` exists (as the request
    found them: etcd judges every compare of a request before any of its writes), then `made_read` is read; where a
    key of `absent` exists, `held_read` is read instead, and `otherwise`'s puts are made where its condition holds (a
    transaction nested in this one's failure branch: it may put a key that `puts` has, as only one branch is taken)."""

    absent: tuple[str, ...]
    puts: tuple[Put, ...]
    made_read: RangeRead = RangeRead([])
    held_read: RangeRead = RangeRead([])
    otherwise: IfHeld | None = None

    def txn(self) -> bytes:
        failure = _range_ops(self.held_read)
        if self.otherwise is not None:
            failure.append(self.otherwise.txn())
        return pb.txn_op(pb.txn([_compare_mod(k, None) for k in self.absent],
                                [*map(_put_op, self.puts), *_range_ops(self.made_read)], failure))

    def outcome(self, resp) -> Outcome:
        """(puts made, the ranges read, otherwise's puts made) from this transaction's answer (etcd's TxnResponse)."""
        made = bool(resp.succeeded)
        read, puts = (self.made_read, len(self.puts)) if made else (self.held_read, 0)
        nested = 0 if made or self.otherwise is None else 1
        _expect_results(resp, puts + len(read.ranges) + nested)
        ranges = [[_kv(kv) for kv in r.response_range.kvs] for r in resp.responses[puts:puts + len(read.ranges)]]
        return made, ranges, bool(nested) and self.otherwise.outcome(resp.responses[-1].response_txn)


def _compare_mod(key: str, expected_mod_revision: int | None) -> bytes:
    """The compare of a key's mod_revision with `expected_mod_revision` (None: the key is absent)."""
    if expected_mod_revision is None:
        return pb.compare_created(key.encode())
    return pb.compare_mod(key.encode(), expected_mod_revision)


def _put_op(put: Put) -> bytes:
    return pb.put_op(put.key.encode(), put.value, put.lease)


def _delete_ops(ranges) -> list[bytes]:
    """A DeleteRange operation of every key k with start <= k < end, for each (start, end)."""
    return [pb.delete_op(a.encode(), b.encode()) for a, b in ranges]


def _expect_results(resp, operations: int) -> None:
    """A transaction's answer has one result per operation of the branch etcd took (else EtcdUnavailableError)."""
    if len(resp.responses) != operations:
        raise EtcdUnavailableError(f"etcd answered a transaction of {operations} operations with "
                                   f"{len(resp.responses)} results")


def _range_ops(read: RangeRead) -> list[bytes]:
    return [pb.range_op(a.encode(), b, keys_only=i in read.keys_only, limit=1 if i in read.first_only else 0)
            for i, (a, b) in enumerate(read.ranges)]


def prefix_end(prefix: str) -> bytes:
    """The range end that selects every key starting with `prefix`."""
    b = bytearray(prefix.encode())
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


def _ssl_context(config: EtcdConfig) -> ssl.SSLContext | None:
    if not config.secure:
        return None
    try:
        for path in (config.ca_cert, config.cert, config.key):
            if path:  # ssl's loaders report a missing file without its name
                with open(path, "rb"):
                    pass
        return tls_context(config, verify=True)
    except OSError as exc:
        raise ConfigError(f"cannot read etcd TLS file {exc.filename}: {exc.strerror}; see --rdzv-conf") from exc
    except ssl.SSLError as exc:
        raise ConfigError(f"etcd TLS files (ca_cert=, cert=, key=) are not usable: {exc.reason or exc}; "
                          "see --rdzv-conf") from exc


def _expired_token(code, details: str) -> bool:
    return code == grpc.StatusCode.UNAUTHENTICATED and "invalid auth token" in details


class EtcdClient:
    """Thread-safe etcd v3 client: KV, transactions, leases, one-shot watches."""

    def __init__(self, config: EtcdConfig, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        if not config.endpoints:
            raise ConfigError("no etcd endpoint given; see --rdzv-endpoint")
        self.config = config
        ctx = _ssl_context(config)
        self._endpoints = [Endpoint(h, p, ctx) for h, p in config.endpoints]
        self._current = config.first
        self._clock = clock  # how long a failure took (_call), when to try the first endpoint again (go_home)
        self._rng = rng or random.Random()
        self._home_due = 0.0  # go_home() tries the first endpoint again from then on
        self._lock = threading.Lock()
        self._leader: int | None = None  # the endpoint that leads, where keep-alives go (follow_leader)
        self._leader_term = 0  # the raft term it was found to lead in
        self._leader_due = 0.0  # follow_leader looks for the leader from then on (a new term: at once)
        self._member_ids: dict[int, int] = {}  # endpoint index: its member id, as its Status said
        self._leader_misses = 0  # beats in a row the leader did not answer its own keep-alive
        self._leader_gen = 0  # times keep-alives left a leader: a look begun before does not put it back
        self._status_refused = False  # etcd refused this agent's user the Status request: keep-alives stay put

    # ---- plumbing -------------------------------------------------------
    @property
    def current_endpoint(self) -> str:
        """The endpoint calls go to first (it changes on failover)."""
        with self._lock:
            return self._endpoints[self._current].label

    @property
    def keepalive_endpoint(self) -> str:
        """The endpoint keep-alives go to: the leader where follow_leader found it, else the current one."""
        with self._lock:
            return self._endpoints[self._keepalive_target()].label

    def _keepalive_target(self) -> int:
        """(the caller holds _lock)"""
        return self._current if self._leader is None else self._leader

    def close(self) -> None:
        """Close every member's connection; their detached reads are waited for up to DRAIN_S in all (one deadline
        for the members, not one each: a member that hangs costs it once)."""
        deadline = time.monotonic() + DRAIN_S
        for ep in self._endpoints:
            ep.close(max(0.0, deadline - time.monotonic()))

    def _call(self, fn: Callable[[Endpoint, float], object], timeout_s: float | None = None,
              attempts: int | None = None):
        """Run fn on the current endpoint; on an unreachable one, fail over to the next.

        With `attempts`, at most that many endpoints are tried whose failure took time (the lease keepalive tries
        one a beat); one that failed at once (UNAVAILABLE within a quarter of the deadline: refused, reset, no
        leader: a dead member) is passed over without counting, so a dead member costs a keep-alive no beat. The
        next call starts at the one after the last that failed.
        """
        timeout = self.config.request_timeout_s if timeout_s is None else timeout_s
        errors: list[str] = []
        with self._lock:
            start = self._current
        count = len(self._endpoints)
        tries = count if attempts is None else max(1, min(attempts, count))
        spent = tried = 0
        while spent < tries and tried < count:
            idx = (start + tried) % count
            ep = self._endpoints[idx]
            tried += 1
            began = self._clock()
            try:
                result = self._authenticated(ep, fn, timeout)
            except grpc.RpcError as exc:
                errors.append(f"{ep.label}: {self._failure(ep, exc, timeout)}")
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or self._clock() - began >= timeout / 4:
                    spent += 1
                continue
            if idx != start:
                with self._lock:
                    self._current = idx
                    self._away()
                log.info("etcd: failed over to %s", ep.label)
            return result
        if tried < count:
            with self._lock:
                if self._current == start:
                    self._current = (start + tried) % count
                    self._away()
        raise EtcdUnavailableError(
            f"etcd at {self.config.describe()} is not reachable "
            f"({'; '.join(errors)}); is it running? see --rdzv-endpoint"
        )

    def _call_at(self, idx: int, fn: Callable[[Endpoint, float], object], timeout_s: float):
        """fn on endpoint `idx` only, where calls go unchanged (the keep-alives sent to the leader); raises
        EtcdUnavailableError where it does not answer, and what _failure raises for other failures."""
        ep = self._endpoints[idx]
        try:
            return self._authenticated(ep, fn, timeout_s)
        except grpc.RpcError as exc:
            raise EtcdUnavailableError(f"etcd at {ep.label} is not reachable ({self._failure(ep, exc, timeout_s)})"
                                       ) from None

    def _failure(self, ep: Endpoint, exc: grpc.RpcError, timeout: float) -> str:
        """Why a call to `ep` failed where another endpoint may answer it ("unavailable", "no answer within ..."); any
        other failure raised, translated (EtcdAccessError, LeaseGoneError, EtcdUnavailableError)."""
        code = exc.code() if hasattr(exc, "code") else None
        details = (exc.details() if hasattr(exc, "details") else "") or ""
        access = self._refusal(ep, code, details, timeout)
        if access is not None:
            raise access from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "no answer within %g s" % timeout
        if code == grpc.StatusCode.UNAVAILABLE:
            return "unavailable"
        error = LeaseGoneError if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details \
            else EtcdUnavailableError
        raise error(f"etcd at {ep.label} refused the request: {code.name if code else 'error'} {details or exc}"
                    ) from exc

    def _away(self) -> None:
        """Calls just left an endpoint (the caller holds _lock): go_home() tries the first one again in home_retry_s,
        give or take a quarter (the agents of a member that died do not all come back in the same second)."""
        self._home_due = self._clock() + self.config.home_retry_s * self._rng.uniform(0.75, 1.25)

    def go_home(self, probe_key: str, timeout_s: float = 0.25) -> bool:
        """After a failover away from the endpoint `config.first` picked: once it is due (_away), one linearizable
        read of `probe_key` there (a key the caller may read: the run's; a member cut off from the quorum does not
        answer it); when it answers, calls go back there, the keep-alive stream on the member left is closed (unless
        keep-alives go to it as the leader), and True. Called by the lease thread between beats (`timeout_s` bounds
        what it adds to a beat), so that a job's agents stay spread over the members: without it a rolling restart
        of etcd's members in list order would end with every agent on one member."""
        with self._lock:
            home, away = self.config.first, self._current
            if away == home or self._clock() < self._home_due:
                return False
            self._away()
        ep = self._endpoints[home]
        probe = etcdrpc.RangeRequest(key=probe_key.encode(), count_only=True)
        try:
            self._authenticated(ep, lambda e, t: e.call("KV/Range", probe, t), timeout_s)
        except (grpc.RpcError, ElasticRTError, ValueError) as exc:  # ValueError: the client closed meanwhile
            log.debug("etcd: %s does not answer yet (%s); staying on %s", ep.label, exc, self._endpoints[away].label)
            return False
        with self._lock:
            if self._current != away:  # a call failed over meanwhile: leave that be
                return False
            self._current = home
            keeps_alive = away == self._leader  # keep-alives go on to the leader there
        if not keeps_alive:
            self._endpoints[away].drop_keepalive()
        log.info("etcd: %s answers again; back to it from %s", ep.label, self._endpoints[away].label)
        return True

    def _refusal(self, ep: Endpoint, code, details: str, timeout: float):
        """The EtcdAccessError this failure proves (TLS, auth, permission), else None: retry or fail over."""
        access = access_error(ep.label, self.config, code, details)
        if access is None and needs_tls_check(code, details, secure=self.config.secure):
            access = check_tls(ep.host, ep.port, ep.label, self.config, min(timeout, 5.0))
        return access

    def _authenticated(self, ep: Endpoint, fn: Callable[[Endpoint, float], object], timeout: float):
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

    def _authenticate(self, ep: Endpoint, timeout: float, stale: tuple | None = None) -> None:
        if self.config.user is None:
            return
        with ep.auth_lock:
            if ep.metadata is not None and ep.metadata is not stale:
                return  # authenticated (again) by another thread meanwhile
            try:
                resp = ep.call("Auth/Authenticate", etcdrpc.AuthenticateRequest(
                    name=self.config.user, password=self.config.password or ""), timeout, metadata=())
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
        resp = self._call(lambda ep, t: ep.call("KV/Range", req, t))
        kv = _kv(resp.kvs[0]) if resp.kvs else None
        return kv, resp.header.revision

    def count_prefix(self, prefix: str) -> int:
        req = etcdrpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix), count_only=True)
        resp = self._call(lambda ep, t: ep.call("KV/Range", req, t))
        return int(resp.count)

    def put(self, key: str, value: bytes, *, lease: int = 0, timeout_s: float | None = None,
            tick: Tick | None = None) -> int:
        """`tick`: something done while the put waits for its answer (Connection.unary)."""
        req = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease)
        resp = self._call(lambda ep, t: ep.call("KV/Put", req, t, tick=tick), timeout_s)
        return resp.header.revision

    def delete(self, key: str) -> bool:
        req = etcdrpc.DeleteRangeRequest(key=key.encode())
        resp = self._call(lambda ep, t: ep.call("KV/DeleteRange", req, t))
        return resp.deleted > 0

    def compare_and_put(
        self, key: str, value: bytes, *, expected_mod_revision: int | None, lease: int = 0,
        timeout_s: float | None = None, deletes: tuple[tuple[str, str], ...] = (), tick: Tick | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Put if the key's mod_revision is `expected` (None: only if absent), and then only, delete every key k with
        start <= k < end of each of `deletes` (in the same transaction and revision). `tick`: something done while
        the request waits for its answer (Connection.unary).

        Returns (succeeded, the key as it is after the transaction).
        """
        ok, _, kv, _, _ = self.compare_and_put_else(key, value, expected_mod_revision=expected_mod_revision,
                                                    lease=lease, timeout_s=timeout_s, read=RangeRead([]),
                                                    deletes=deletes, tick=tick)
        return ok, kv

    def compare_and_put_then_read(
        self, key: str, value: bytes, *, expected_mod_revision: int | None, lease: int = 0,
        timeout_s: float | None = None, read: RangeRead, also: tuple[Put, ...] = (), when: tuple[IfAbsent, ...] = (),
        tick: Tick | None = None,
    ) -> tuple[bool, KeyValue | None, list[list[KeyValue]], int, tuple[Outcome, ...]]:
        """compare_and_put, and in the same transaction (one request, one revision: after the put, when it was made)
        read_ranges(read); `also`: keys put with `key`, only when it is (before the read); `when`: transactions made
        there too, after those puts and before the read (which sees what they put). Returns (succeeded, the key as it
        is after it, the ranges' keys, that revision, and for each of `when`: IfAbsent.outcome(); () where the compare
        failed)."""
        ok, _, kv, ranges, revision, outcomes = self._cas(key, value, expected_mod_revision, lease, timeout_s, read,
                                                          also, None, (), tick, when)
        return ok, kv, ranges, revision, outcomes

    def compare_and_put_else(
        self, key: str, value: bytes, *, expected_mod_revision: int | None, lease: int = 0,
        timeout_s: float | None = None, read: RangeRead, also: tuple[Put, ...] = (), otherwise: IfHeld | None = None,
        deletes: tuple[tuple[str, str], ...] = (), tick: Tick | None = None,
    ) -> tuple[bool, bool, KeyValue | None, list[list[KeyValue]], int]:
        """compare_and_put_then_read, and where the compare fails, `otherwise`'s puts in the same request when its
        condition holds (before the read); `deletes` and `tick` as compare_and_put's. Returns (succeeded, otherwise's puts made,
        the key as it is after the transaction, the ranges' keys, that revision)."""
        ok, made, kv, ranges, revision, _ = self._cas(key, value, expected_mod_revision, lease, timeout_s, read, also,
                                                      otherwise, deletes, tick, ())
        return ok, made, kv, ranges, revision

    def _cas(self, key: str, value: bytes, expected_mod_revision: int | None, lease: int, timeout_s: float | None,
             read: RangeRead, also: tuple[Put, ...], otherwise: IfHeld | None, deletes: tuple[tuple[str, str], ...],
             tick: Tick | None, when: tuple[IfAbsent, ...]):
        cmp = _compare_mod(key, expected_mod_revision)
        get = pb.range_op(key.encode())
        writes = [_put_op(Put(key, value, lease)), *map(_put_op, also), *_delete_ops(deletes)]
        reads = _range_ops(read)
        nested = [otherwise.txn()] if otherwise is not None else []
        req = pb.txn([cmp], [*writes, *(w.txn() for w in when), get, *reads], [*nested, get, *reads])
        resp = self._call(lambda ep, t: ep.call("KV/Txn", req, t, tick=tick), timeout_s)
        _expect_results(resp, len(reads) + 1 + (len(writes) + len(when) if resp.succeeded else len(nested)))
        made = bool(nested) and not resp.succeeded and otherwise.outcome(resp.responses[0].response_txn)
        outcomes = tuple(w.outcome(resp.responses[len(writes) + i].response_txn)
                         for i, w in enumerate(when)) if resp.succeeded else ()
        responses = resp.responses[-len(reads) - 1:]
        rng = responses[0].response_range
        ranges = [[_kv(kv) for kv in r.response_range.kvs] for r in responses[1:]]
        kv = _kv(rng.kvs[0]) if rng.kvs else None
        return bool(resp.succeeded), made, kv, ranges, resp.header.revision, outcomes

    def create_with(self, key: str, value: bytes, guarded: GuardedPut, *, deletes: tuple[tuple[str, str], ...] = (),
                    ) -> tuple[bool, KeyValue | None, tuple[bool, KeyValue | None] | None]:
        """compare_and_put(key, value, expected_mod_revision=None, deletes=deletes) and, when it puts, `guarded` in the
        same request and revision (a transaction nested in the put's branch: etcd 3.3 and later). Returns (put, the key
        as it is after the transaction, and when it put: (guarded's put made, its key as it is after it); else None)."""
        gkey = guarded.put.key
        get = pb.range_op(key.encode())
        gget = pb.range_op(gkey.encode())
        inner = pb.txn([_compare_mod(gkey, guarded.expected_mod_revision)], [_put_op(guarded.put), gget], [gget])
        req = pb.txn([_compare_mod(key, None)], [_put_op(Put(key, value)), get, pb.txn_op(inner), *_delete_ops(deletes)],
                     [get])
        resp = self._call(lambda ep, t: ep.call("KV/Txn", req, t))
        _expect_results(resp, 3 + len(deletes) if resp.succeeded else 1)
        rng = resp.responses[1 if resp.succeeded else 0].response_range
        kv = _kv(rng.kvs[0]) if rng.kvs else None
        if not resp.succeeded:
            return False, kv, None
        nested = resp.responses[2].response_txn
        _expect_results(nested, 2 if nested.succeeded else 1)
        grng = nested.responses[-1].response_range
        return True, kv, (bool(nested.succeeded), _kv(grng.kvs[0]) if grng.kvs else None)

    def put_then_read(self, put: Put, read: RangeRead) -> tuple[list[list[KeyValue]], int]:
        """put, and in the same transaction (one request, one revision: the put's) read_ranges(read). Returns the
        ranges' keys and that revision."""
        reads = _range_ops(read)
        req = pb.txn([], [_put_op(put), *reads], [])
        resp = self._call(lambda ep, t: ep.call("KV/Txn", req, t))
        _expect_results(resp, len(reads) + 1)
        return [[_kv(kv) for kv in r.response_range.kvs] for r in resp.responses[1:]], resp.header.revision

    def delete_ranges(self, ranges: list[tuple[str, str]]) -> int:
        """Delete every key k with start <= k < end, for each (start, end), in one transaction."""
        return self._delete_ranges(ranges, compare=[])

    def delete_ranges_if_empty(self, ranges: list[tuple[str, str]], *, empty: tuple[str, bytes]) -> int:
        """delete_ranges, in a transaction that does it only while no key k with start <= k < end of `empty`
        exists (etcd compares an empty range as one key of version 0). Returns the keys deleted (0: not done)."""
        return self._delete_ranges(ranges, compare=[pb.compare_version(empty[0].encode(), 0, empty[1])])

    def _delete_ranges(self, ranges: list[tuple[str, str]], *, compare: list[bytes]) -> int:
        req = pb.txn(compare, _delete_ops(ranges), [])
        resp = self._call(lambda ep, t: ep.call("KV/Txn", req, t))
        return sum(int(r.response_delete_range.deleted) for r in resp.responses) if resp.succeeded else 0

    def read_many(self, keys: list[str], prefixes: list[str]) -> tuple[list[KeyValue | None], list[list[KeyValue]], int]:
        """Read several keys and prefixes in one round trip, at one revision."""
        ops = [pb.range_op(k.encode()) for k in keys] + [pb.range_op(p.encode(), prefix_end(p)) for p in prefixes]
        resp = self._read_txn(pb.txn([], ops, []))
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
        resp = self._read_txn(pb.txn([], _range_ops(RangeRead(ranges, keys_only, first_only)), []))
        return [[_kv(kv) for kv in r.response_range.kvs] for r in resp.responses], resp.header.revision

    def _read_txn(self, req):
        """A read-only Txn (several ranges at one revision): abandoned, never reset, when its deadline passes, and
        sent without grpc-timeout: etcd 3.5.0-3.5.4 members crash when such a call's context ends while they read its
        ranges (Connection.abandon). Range calls and Txns with writes do not need it (etcd reads those otherwise)."""
        return self._call(lambda ep, t: ep.call("KV/Txn", req, t, detach=True))

    # ---- leases -----------------------------------------------------------
    def grant_lease(self, ttl_s: float, *, timeout_s: float | None = None) -> int:
        req = pb.lease_grant(max(1, int(round(ttl_s))))
        resp = self._call(lambda ep, t: ep.call("Lease/LeaseGrant", req, t), timeout_s)
        return int(resp.ID)

    def refresh_lease(self, lease_id: int, *, timeout_s: float | None = None, attempts: int | None = None) -> float:
        """Send one keep-alive; returns the remaining TTL (0 or less: the lease is gone). No answer to it within
        the deadline is a failure (EtcdUnavailableError) and the next call starts at the next endpoint."""
        def once(ep: Endpoint, t: float) -> float:
            renewal = ep.keep_alive(lease_id, t)
            if renewal is None or (renewal.ttl > 0 and not renewal.own):  # an earlier one's late "alive"
                raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {t:g} s")
            return renewal.ttl

        return self._call(once, timeout_s=timeout_s, attempts=attempts)

    def keep_alive(self, lease_id: int, *, every_s: float, silent_s: float) -> Renewal | None:
        """The lease thread's beat: one keep-alive on the long-lived keep-alive stream of the leader's endpoint
        (follow_leader) or else the current one, sent whether or not earlier ones were answered, and the answers
        that came until the next is due (`every_s` after this one was sent): the newest renewal (its TTL, its
        request's send time, the answering member's raft term), or None when none came from a member that is there
        (etcd busy). Only a member silent for `silent_s` with a keep-alive unanswered fails (EtcdUnavailableError;
        the next beat goes to the next endpoint). Keep-alives leave a leader that refused one (this beat goes to
        the current endpoint), that failed slowly (the beat is spent: EtcdUnavailableError), or that answered
        none of its own for LEADER_MISSES beats."""
        with self._lock:
            leader = self._leader if self._leader != self._current else None
        beat = lambda ep, t: ep.keep_alive(lease_id, t, silent_s)  # noqa: E731
        renewal = None
        if leader is not None:
            began = self._clock()
            try:
                renewal = self._call_at(leader, beat, every_s)
            except EtcdUnavailableError:
                self._leave_leader(leader)
                if self._clock() - began >= every_s / 4:  # it took time (a hung leader): this beat is spent
                    raise
                leader = None  # refused (a dead leader): this beat goes to the current endpoint
            else:
                if every_s > 0:  # a registration's keep-alive waits for no answer: it neither misses nor answers
                    self._count_miss(leader, renewal is None or not renewal.own)
        if leader is None:
            renewal = self._call(beat, timeout_s=every_s, attempts=1)
        if renewal is not None and renewal.term > self._leader_term:  # a new term: the leader may have changed
            with self._lock:
                if renewal.term > self._leader_term:
                    self._leader_term, self._leader_due = renewal.term, 0.0
        return renewal

    def _count_miss(self, leader: int, missed: bool) -> None:
        """A beat sent to the leader at `leader` was answered (missed False) or not (True): LEADER_MISSES in a row
        and keep-alives leave it (a leader that stepped down or is stuck, its connection alive: no new term comes)."""
        self._leader_misses = self._leader_misses + 1 if missed else 0
        if self._leader_misses >= LEADER_MISSES:
            self._leave_leader(leader)

    def _leave_leader(self, leader: int) -> None:
        """Keep-alives to the leader at `leader` failed: the next go to the current endpoint, and follow_leader looks
        for the leader again after a new term (an election) or LEADER_RETRY_S (a leader this agent cannot reach, that
        its member can, is not tried again every other beat)."""
        with self._lock:
            if self._leader != leader:
                return
            self._leader, self._leader_misses, self._leader_gen = None, 0, self._leader_gen + 1
            self._leader_due = self._clock() + LEADER_RETRY_S * self._rng.uniform(0.75, 1.25)
            self._member_ids.pop(leader, None)  # a look must hear from it again before keep-alives go back there
        log.info("etcd: the leader at %s does not answer keep-alives; sending them to %s",
                 self._endpoints[leader].label, self.current_endpoint)

    def follow_leader(self, timeout_s: float = 0.25) -> bool:
        """Send keep-alives straight to the member that leads (config.keepalive_to_leader), not to one that forwards
        each to it: one Status of the current endpoint names the leader, and of the others (until one is it) says
        which endpoint that is (the leader's own Status, where keep-alives left it before). Looks when due: at
        first, after a keep-alive answered from a newer raft term (an election: the leader may have changed), and
        LEADER_RETRY_S after a look that found none among the endpoints or after keep-alives left the leader. An etcd
        user refused Status stops the looks, with one warning. Called by the lease thread between beats (`timeout_s`
        bounds each Status). True when keep-alives moved."""
        if not self.config.keepalive_to_leader or len(self._endpoints) < 2:
            return False
        with self._lock:
            now = self._clock()
            if self._status_refused or now < self._leader_due:
                return False
            self._leader_due = now + LEADER_RETRY_S * self._rng.uniform(0.75, 1.25)
            start, before, gen = self._current, self._keepalive_target(), self._leader_gen
        try:
            found, term = self._find_leader(start, timeout_s)
        except (grpc.RpcError, ElasticRTError, ValueError) as exc:  # ValueError: the client closed meanwhile
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
            if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                self._status_refused = True
                log.warning("etcd at %s refuses user %s its Status request (%s): lease keep-alives go through the "
                            "member each agent talks to (--rdzv-conf keepalive_to=member says so and skips the look)",
                            self._endpoints[start].label, self.config.user, code.name)
            else:
                log.debug("etcd: could not find the leader (%s); keep-alives go to %s", exc, self.keepalive_endpoint)
            return False
        with self._lock:
            if self._leader_gen != gen:  # keep-alives left a leader meanwhile: this look may have named it
                return False
            if found is not None:
                self._leader_due = float("inf")  # until a new term or a failed keep-alive
            self._leader, self._leader_term = found, max(term, self._leader_term)
            after = self._keepalive_target()
        if after == before:
            return False
        self._endpoints[before].drop_keepalive()
        log.info("etcd: keep-alives go to %s (%s)", self._endpoints[after].label,
                 "the leader" if found is not None else "no endpoint leads")
        return True

    def _find_leader(self, start: int, timeout_s: float) -> tuple[int | None, int]:
        """(the endpoint that leads or None, the raft term): Status of `start`, then of each endpoint whose member id
        is not known yet, until the leader's is."""
        def status(idx: int):
            resp = self._authenticated(self._endpoints[idx],
                                       lambda ep, t: ep.call("Maintenance/Status", etcdrpc.StatusRequest(), t),
                                       timeout_s)
            self._member_ids[idx] = int(resp.header.member_id)
            return resp

        first = status(start)
        leader, term = int(first.leader), int(first.header.raft_term)
        if not leader:
            return None, term
        for idx in (start, *(i for i in range(len(self._endpoints)) if i != start)):
            if idx not in self._member_ids:
                try:
                    status(idx)
                except grpc.RpcError:
                    continue
            if self._member_ids[idx] == leader:
                return idx, term
        for idx in [i for i in self._member_ids if i != start]:  # none is it: ask them all again next time (a
            del self._member_ids[idx]  # member replaced at the same address has a new id)
        return None, term

    def revoke_lease(self, lease_id: int) -> None:
        req = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self._call(lambda ep, t: ep.call("Lease/LeaseRevoke", req, t))
        except EtcdUnavailableError as exc:
            if "NOT_FOUND" not in str(exc):
                raise

    # ---- watches ----------------------------------------------------------
    def status_latency_s(self) -> tuple[str, float]:
        """Round trip of one Status call to the current endpoint: (version, seconds)."""
        t0 = time.monotonic()
        resp = self._call(
            lambda ep, t: ep.call("Maintenance/Status", etcdrpc.StatusRequest(), t)
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
        resp = self._call(lambda ep, t: ep.call("KV/Range", req, t))
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    def count_many(self, keys: list[str], prefixes: list[str]) -> tuple[list[int], int]:
        """How many keys exist at each key, then under each prefix, in one round trip at one revision."""
        ranges = [etcdrpc.RangeRequest(key=k.encode(), count_only=True) for k in keys]
        ranges += [etcdrpc.RangeRequest(key=p.encode(), range_end=prefix_end(p), count_only=True) for p in prefixes]
        ops = [etcdrpc.RequestOp(request_range=r) for r in ranges]
        resp = self._read_txn(etcdrpc.TxnRequest(compare=[], success=ops, failure=[]))
        return [int(r.response_range.count) for r in resp.responses], resp.header.revision

    def put_many(self, items: list[tuple[str, bytes]], *, lease: int = 0) -> int:
        """Put every (key, value) in one transaction (keys must be distinct)."""
        req = pb.txn([], [_put_op(Put(k, v, lease)) for k, v in items], [])
        resp = self._call(lambda ep, t: ep.call("KV/Txn", req, t))
        return resp.header.revision

    def delete_if_unchanged(self, key: str, mod_revision: int) -> bool:
        """Delete `key` only if its mod_revision is still `mod_revision`; True if this call deleted it."""
        req = pb.txn([_compare_mod(key, mod_revision)], [pb.delete_op(key.encode())], [])
        resp = self._call(lambda ep, t: ep.call("KV/Txn", req, t))
        return bool(resp.succeeded) and resp.responses[0].response_delete_range.deleted > 0

    def wait_for_any(self, keys: list[str], prefixes: list[str], *, after_revision: int, timeout_s: float) -> bool:
        """Block until a key or a key under a prefix changes after `after_revision` (True), or timeout_s passes
        (False); one watch stream for all of them. A compacted history also returns True: re-read."""
        if timeout_s <= 0:
            return False
        requests = tuple([*(pb.watch_create(k.encode(), b"", after_revision + 1) for k in keys),
                          *(pb.watch_create(p.encode(), prefix_end(p), after_revision + 1) for p in prefixes)])

        def watch(ep: Endpoint, t: float) -> bool:
            stream = ep.stream("Watch/Watch", t, ep.metadata or (), first=requests)  # watchers and headers: one write
            deadline = time.monotonic() + t
            try:
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        body = stream.next(left)
                    except CallError as exc:
                        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                            return False
                        raise
                    if body is None:
                        return False
                    resp = etcdrpc.WatchResponse.FromString(body)
                    if resp.compact_revision or resp.events:
                        return True  # a change, or history compacted: the caller re-reads either way
                    if resp.canceled:
                        raise EtcdUnavailableError(f"etcd cancelled a watch: {resp.cancel_reason}")
                return False
            finally:
                stream.cancel()

        return self._call(watch, timeout_s=timeout_s)

    def open_watch(self, ranges: list[tuple[str, bytes]], start_revisions: list[int], *,
                   deletes_only: frozenset[int] = frozenset(), on_event: Callable[[int, list[WatchEvent], bool], None],
                   on_end: Callable[[Exception | None], None]) -> "WatchStream":
        """One Watch stream on the current endpoint, a watcher per (start, end) range from its revision, its answers
        pushed to on_event and on_end (WatchStream); the watchers of the range indexes in `deletes_only` get no put
        events (etcd's NOPUT filter). Raises EtcdUnavailableError."""
        with self._lock:
            ep = self._endpoints[self._current]
        try:
            self._authenticate(ep, self.config.request_timeout_s)
        except grpc.RpcError as exc:
            raise EtcdUnavailableError(f"etcd at {ep.label}: cannot authenticate the watch: {exc.code().name}") from exc
        return WatchStream(ep, ranges, start_revisions, deletes_only=deletes_only,
                           timeout_s=self.config.request_timeout_s, decode=_event, on_event=on_event, on_end=on_end)
