"""This node's liveness: an etcd lease kept alive by a thread, and the alive key attached to it. Between its
beats the same thread serves the node's liveness listener (liveness.py), which has no thread of its own."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable

from elastic_rt.errors import DuplicateNodeError, EtcdUnavailableError
from elastic_rt.rendezvous.daemon import Daemon
from elastic_rt.rendezvous.etcd_client import EtcdClient, IfAbsent, KeyValue, Outcome, RangeRead, Renewal, Tick
from elastic_rt.rendezvous.etcd_reachability import Backoff, EtcdHealth
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.liveness import LivenessListener, parse_peer, probe
from elastic_rt.rendezvous.monitor import incarnation

log = logging.getLogger(__name__)
SILENT_BEATS = 1.5  # a member that owes a keep-alive answer and sent nothing for this many beats is given up
LAPSE_CAUSES = ("process", "held", "backoff", "unexplained", "etcd")  # LeaseLapse.cause's answers
KEPT_LAPSES = 8  # the newest lapses a lease remembers (NodeLease.lapses)
SENDS_KEPT = 1024  # keep-alive send times kept while none is confirmed (past that, the oldest are forgotten)


@dataclass
class Send:
    """One keep-alive this process sent: when (`at`), how late the lease thread woke for it (`late_s`: due, and
    the process did not run it), how long it then took to send (`before_s`: the lease's lock, held by a grant or
    another thread's beat), how long the lease thread stayed in that beat and its callbacks after the send
    (`after_s`, set when it returns; a beat waits up to its interval for answers by design), and how long it had
    chosen to wait before it, backing off after a beat that failed (`backoff_s`)."""

    at: float
    late_s: float = 0.0
    before_s: float = 0.0
    after_s: float = 0.0
    backoff_s: float = 0.0


@dataclass(frozen=True)
class LeaseLapse:
    """One time the lease was found gone, and whose silence let it run out. etcd ends a lease when no keep-alive
    reached it for a TTL. `longest_silence_s` is the longest stretch, from the send of the last keep-alive etcd
    confirmed to the send of the one it answered "gone", in which this process sent none. Less than a TTL: it sent
    on time, so etcd did not renew what it was sent (too busy, partitioned, or a peer revoked the lease). A TTL or
    more: this process's own silence explains the lapse, and the stretch says why (`cause`): the lease thread woke
    `late_s` late (the process did not run: starved, stopped, swapped out); it was held `held_s` in the beat or the
    registration that opened the stretch, its callbacks, or the lease's lock before the beat that closed it (or,
    found by another thread, had been `stuck_s` in its current beat); or it waited `backoff_s`, backing off after a
    failed beat."""

    at: float  # monotonic send time of the keep-alive answered "gone"
    ttl_s: float
    unrenewed_s: float  # from the last confirmed keep-alive's send to `at`
    beats: int  # keep-alives sent in that stretch, the last one included
    longest_silence_s: float
    late_s: float = 0.0  # in the longest silence: how late the lease thread woke
    held_s: float = 0.0  # in the longest silence: how long the lease thread was busy beyond a beat's answer wait
    backoff_s: float = 0.0  # in the longest silence: how long it waited, backing off after a failed beat
    stuck_s: float = 0.0  # found by another thread: how long the lease thread had then been in one beat
    sent_to: str = ""  # the etcd endpoint the keep-alives went to when it was found (the leader's, where known)

    @property
    def cause(self) -> str:
        """'etcd' (keep-alives sent on time, not renewed); or, none sent for a TTL, whichever covers half the silence
        or more: 'process' (the lease thread woke late: the process did not run), 'held' (it was busy elsewhere) or
        'backoff' (it waited, backing off after a beat that failed); 'unexplained' when none does."""
        if self.longest_silence_s < self.ttl_s:
            return "etcd"
        part, cause = max((self.late_s, "process"), (max(self.held_s, self.stuck_s), "held"),
                          (self.backoff_s, "backoff"))
        return cause if part >= self.longest_silence_s / 2 else "unexplained"

    def describe(self) -> str:
        if self.cause == "etcd":
            return (f"{self.beats} keep-alives sent in {self.unrenewed_s:.1f} s, none more than "
                    f"{self.longest_silence_s:.1f} s apart (TTL {self.ttl_s:g} s), and etcd did not renew them: etcd "
                    f"was too busy or cut off, or a peer revoked the lease")
        why = {"held": f"its lease thread was held {max(self.held_s, self.stuck_s):.1f} s in a beat, its callbacks, "
                       f"a registration (grant and put) or waiting for the lease's lock",
               "process": f"it woke {self.late_s:.1f} s late for a beat: the process did not run (starved, stopped "
                          f"or swapped out)",
               "backoff": f"its lease thread waited {self.backoff_s:.1f} s, backing off after a beat etcd did not "
                          f"answer (and {self.held_s:.1f} s in beats)",
               "unexplained": f"its lease thread woke {self.late_s:.1f} s late, was held "
                              f"{max(self.held_s, self.stuck_s):.1f} s and backed off {self.backoff_s:.1f} s, which "
                              f"does not explain it"}[self.cause]
        return f"this process sent no keep-alive for {self.longest_silence_s:.1f} s (TTL {self.ttl_s:g} s): {why}"


def lapse_of(renewed: float, sends: list[Send], at: float, ttl_s: float, stuck_s: float = 0.0) -> LeaseLapse:
    """The lapse found by the keep-alive sent at `at` (as the connection saw it go out), the last one confirmed
    having been sent at `renewed`. `sends`: this process's keep-alives, in order, each recorded just before it went
    out; the last one at or before `at` is the one answered "gone", the last one at or before `renewed` (just before
    it) the one confirmed, whose time in its beat and callbacks opens the first stretch. `stuck_s`: found by another
    thread, how long the lease thread had been in its current beat (its sends' after_s is set when a beat ends)."""
    mine = [x for x in sends if renewed < x.at <= at]
    last = mine.pop() if mine else Send(at)
    confirmed = next((x for x in reversed(sends) if x.at <= renewed), None)  # the confirmed one, recorded just before
    start = Send(renewed, after_s=confirmed.after_s if confirmed and renewed - confirmed.at <= ttl_s / 6 else 0.0)
    if len(sends) >= SENDS_KEPT:  # the sends right after `renewed` were forgotten: no silence is known before them
        stretches = list(zip(mine, [*mine[1:], last]))
    else:
        stretches = list(zip([start, *mine], [*mine, last]))
    longest = max(stretches, key=lambda ab: ab[1].at - ab[0].at, default=None)
    if longest is None:
        return LeaseLapse(at=last.at, ttl_s=ttl_s, unrenewed_s=last.at - renewed, beats=1, longest_silence_s=0.0,
                          stuck_s=stuck_s)
    a, b = longest
    return LeaseLapse(at=last.at, ttl_s=ttl_s, unrenewed_s=last.at - renewed, beats=len(mine) + 1,
                      longest_silence_s=b.at - a.at, late_s=b.late_s, held_s=a.after_s + b.before_s,
                      backoff_s=b.backoff_s, stuck_s=stuck_s)


class NodeLease:
    """Grants a lease of `ttl_s` and keeps it alive: a beat every ttl_s/3, a message on the client's long-lived
    keep-alive stream sent on schedule whether or not earlier beats were answered. An answer renews from its
    own request's send time, however late it came; a busy etcd (late answers, "request timed out") costs no
    beat, no failover and no backoff. Only a member that owed an answer and sent nothing for 1.5 beats is
    given up (one that died just after answering a beat: half a beat before the lease it renewed last can run
    out): the next beat goes to the next endpoint, with jittered exponential backoff while etcd does not answer.

    Keys put with `lease_id` vanish `ttl_s` after this process stops refreshing (SIGKILL,
    partition, hang): that is how peers learn of a dead node, with no dependence on anybody's
    wall clock. A lease found gone (it expired during an etcd outage, or a peer revoked it) is
    granted anew and the alive key put again, with the same `incarnation`, so peers can tell
    this process re-registering from a restarted agent.
    """

    def __init__(self, client: EtcdClient, keys: RunKeys, node_id: str, *, ttl_s: float, info: dict,
                 health: EtcdHealth, local_addr: str = "0.0.0.0", clock: Callable[[], float] = time.monotonic,
                 backoff: Backoff | None = None, on_beat: Callable[[], None] = lambda: None,
                 on_granted: Callable[[], None] = lambda: None) -> None:
        self._client = client
        self._keys = keys
        self._node_id = node_id
        self._ttl_s = ttl_s
        self.beat_s = ttl_s / 3
        self._health = health
        self._clock = clock
        self._backoff = backoff or Backoff(base_s=0.1, cap_s=2.0)
        self._on_beat = on_beat
        self._on_granted = on_granted  # after every grant: a new lease id (joins put on the old one are gone)
        self._local_addr = local_addr
        self._listener = LivenessListener(local_addr)
        self.incarnation = uuid.uuid4().hex[:12]
        self._info = json.dumps({**info, "liveness_port": self._listener.port, "incarnation": self.incarnation}).encode()
        self._lock = threading.Lock()  # held across a grant's requests: never taken by a caller of lease_id
        self._lease_id = 0
        self._published = 0  # the lease the alive key is registered on (lease_id): read without the lock
        self._registered = False
        self._stop = threading.Event()
        self._thread: Daemon | None = None
        self.last_renewed = 0.0  # monotonic send time of the last beat etcd answered with the lease alive
        self._next_beat = 0.0  # when the next beat is due: a beat_s after the last one (or the grant) was sent
        self.renewals_lost = 0  # times the lease was found gone (an outage, a pause, a partition, an eviction)
        self.lost_at: float | None = None  # when it was last found gone
        self.lapses: deque[LeaseLapse] = deque(maxlen=KEPT_LAPSES)  # the newest times it was found gone, and why
        self._sends: deque[Send] = deque(maxlen=SENDS_KEPT)  # the keep-alives sent since the last one confirmed
        self._in_beat_since: float | None = None  # when the lease thread began its current beat (None: between beats)
        self._woke: tuple[float, float, float] | None = None  # the lease thread's last wake-up (when, how late, after
        # what backoff), until a send takes it
        self.conflict: DuplicateNodeError | None = None  # another agent holds this node id: beats stopped
        self._read: tuple[RangeRead, list[list[KeyValue]], int] | None = None  # start()'s `read`, until take_read()
        self._outcomes: tuple[tuple[Outcome, ...], int, int] = ((), 0, 0)  # start()'s `when`, until take_outcomes()

    @property
    def lease_id(self) -> int:
        """The lease this node's alive key is registered on (0 before start() and after stop()). Read without the
        lock: the lease thread holds it across a re-grant's requests, and the rendezvous reads this while it holds the
        membership view's lock, which the connection's reader thread needs to deliver those requests' answers (and
        on_granted needs): taking the lock here deadlocked a node whose lease was granted anew mid-round."""
        return self._published

    def unrenewed_for_s(self) -> float:
        """Seconds since etcd last confirmed this lease (longer than the TTL: peers may have re-formed)."""
        return self._clock() - self.last_renewed

    def start(self, *, wait_s: float | None = None, read: RangeRead | None = None,
              when: Callable[[int], tuple[IfAbsent, ...]] | None = None) -> int:
        """Grant the lease and put the alive key (request deadlines: the client's), then keep it alive. `read`: ranges
        to read in the alive key's own request (the membership view's first read); take_read() has the result.
        `when(lease_id)`: conditional puts that go in that request too, where the alive key is put (before the read:
        EtcdClient.compare_and_put_then_read); take_outcomes() has what came of them (nothing where another agent's key
        was in the way, or without `read`).

        The node id's alive/ key held by another agent: when that agent registered this agent's own address and
        its liveness port refuses connections, its process is gone (a restart) and the key is taken over at once
        (peers see the new incarnation); otherwise its lease is waited for up to `wait_s` (default twice the TTL
        and a second: a dead agent's lease runs out meanwhile), then DuplicateNodeError: a second live agent."""
        deadline = self._clock() + (2 * self._ttl_s + 1.0 if wait_s is None else wait_s)
        said = False
        self._read, self._outcomes = None, ((), 0, 0)  # a read of an earlier start() never outlives its lease
        with self._lock:
            while True:
                try:
                    self._grant(timeout_s=None, read=read, when=when)
                    break
                except DuplicateNodeError as exc:
                    held = exc.held
                    if self._holder_gone(held) and self._take_over(held):
                        break
                    self._client.revoke_lease(self._lease_id)  # ours, with nothing on it
                    self._lease_id = 0
                    left = deadline - self._clock()
                    if left <= 0:
                        raise
                if not said:
                    said = True
                    log.warning("node %s: another agent holds this node id (%s); waiting up to %.0f s for its lease "
                                "to run out", self._node_id, _describe(held), left)
                self._client.wait_for_any([held.key], [], after_revision=held.mod_revision, timeout_s=left)
        self._on_granted()  # outside the lock (see lease_id)
        self._thread = Daemon(self._run, "elastic-rt-lease")  # kept before it runs: it asks _on_lease_thread()
        self._thread.start()
        return self._lease_id

    def _holder_gone(self, held: KeyValue) -> bool:
        """The agent behind `held` registered this agent's own address and its liveness port refuses: it is dead.
        (A refusal from another host may be a firewall's REJECT: no evidence; its lease decides.)"""
        peer = parse_peer(self._node_id, held.value, held.lease)
        return peer is not None and peer.addr == self._local_addr and probe(peer, 1.0)[0] == "refused"

    def _take_over(self, held: KeyValue) -> bool:
        ok, _ = self._client.compare_and_put(held.key, self._info, expected_mod_revision=held.mod_revision,
                                             lease=self._lease_id, tick=self._registering())
        if ok:
            log.info("node %s: the agent that held this node id (%s) is gone; taking its place", self._node_id,
                     _describe(held))
            self._registered = True
            self._renewed(self._clock())
            self._published = self._lease_id
        return ok

    def take_read(self) -> tuple[RangeRead, list[list[KeyValue]], int] | None:
        """start()'s `read`, the ranges' keys and the revision it was read at, once; None when it was not read with
        the alive key (another agent's key was in the way)."""
        read, self._read = self._read, None
        return read

    def take_outcomes(self) -> tuple[tuple[Outcome, ...], int, int]:
        """What came of start()'s `when` (IfAbsent.outcome() each), the revision of that request and the lease it put
        the alive key on (which `when` was given: the lease thread may have granted another one since), once; ((), 0,
        0) when they were not sent or not made (the alive key was not put by that request)."""
        outcomes, self._outcomes = self._outcomes, ((), 0, 0)
        return outcomes

    def _grant(self, timeout_s: float | None, read: RangeRead | None = None,
               when: Callable[[int], tuple[IfAbsent, ...]] | None = None) -> None:
        """A new lease and the alive key on it (None: the client's request deadline); `read` and `when` in the put's
        request."""
        sent = self._clock()
        self._lease_id = self._client.grant_lease(self._ttl_s, timeout_s=timeout_s)
        self._registered = False
        self._keep_registering()  # the first keep-alive goes out now, not after the put: a busy etcd may take a TTL
        tick = self._registering()  # to answer both, and more keep-alives go out while the put waits
        key = self._keys.alive(self._node_id)
        if read is None:
            ok, held = self._client.compare_and_put(key, self._info, expected_mod_revision=None, lease=self._lease_id,
                                                    timeout_s=timeout_s, tick=tick)
        else:
            ok, held, ranges, revision, outcomes = self._client.compare_and_put_then_read(
                key, self._info, expected_mod_revision=None, lease=self._lease_id, timeout_s=timeout_s, read=read,
                when=when(self._lease_id) if when is not None else (), tick=tick)
            self._read = (read, ranges, revision) if ok else None
            self._outcomes = (outcomes, revision, self._lease_id) if ok else ((), 0, 0)
        if not ok and held is not None:  # this process's own key, from a grant whose answer was lost, is replaced
            if incarnation(held) != self.incarnation:
                raise DuplicateNodeError(
                    f"node id {self._node_id} is in use by another live agent of run {self._keys.run_id} "
                    f"({_describe(held)}); give each agent its own --node-id", held)
            self._client.put(key, self._info, lease=self._lease_id, timeout_s=timeout_s, tick=tick)
        self._registered = True
        self._renewed(sent)  # (a keep-alive sent during the put may have renewed it since: that stands)
        last = self._sends[-1]  # this registration's last keep-alive: its time in the registration after it is a
        last.after_s = self._clock() - last.at  # silence too (after_s)
        self._next_beat = last.at + self.beat_s
        self._published = self._lease_id  # the caller calls on_granted once it has let go of the lock

    def _registering(self) -> Tick:
        """What a registration's put does while it waits for etcd: a keep-alive every beat (a busy etcd may take
        longer than a TTL to answer a put, and the lease it was granted must not run out meanwhile)."""
        return Tick(self.beat_s, self._keep_registering)

    def _keep_registering(self) -> None:
        """One keep-alive of a registration (the thread holds the lease's lock), sent without waiting for its
        answer; answers that came meanwhile renew the lease. No answer is no failure here: the put says whether
        etcd answers."""
        now = self._clock()
        if self._sends:  # the registration's previous keep-alive: the thread stayed in the registration until now
            self._sends[-1].after_s = max(self._sends[-1].after_s, now - self._sends[-1].at)
        self._sends.append(Send(now))
        try:
            renewal = self._client.keep_alive(self._lease_id, every_s=0.0, silent_s=float("inf"))
        except EtcdUnavailableError:
            return
        if renewal is not None and renewal.ttl > 0:
            self._renewed(self._sent(renewal))

    def _renewed(self, sent: float) -> None:
        """etcd confirmed the lease as of `sent` (a keep-alive's or the grant's send time), unless a later send was
        confirmed already (a registration's keep-alive, answered before its put): the sends before it no longer count
        towards a lapse."""
        self.last_renewed = sent = max(self.last_renewed, sent)
        while len(self._sends) > 1 and self._sends[1].at < sent:  # the newest one before `sent` stays: the confirmed
            self._sends.popleft()  # keep-alive, recorded just before it went out (its time in the beat counts)

    def _sent(self, renewal: Renewal) -> float:
        """When the keep-alive that `renewal` answers was sent, on this process's clock."""
        return self._clock() - (time.monotonic() - renewal.sent_at)

    def _beat(self) -> bool:
        """One beat; True when etcd confirmed the lease (or it was granted anew), False when no answer came yet
        from a member that is there (the next beat is due at once)."""
        before = self._published
        try:
            return self._beat_locked()
        finally:
            if self._published != before:
                self._on_granted()  # outside the lock (see lease_id)

    def _beat_locked(self) -> bool:
        sent = self._clock()
        with self._lock:
            if not self._registered:  # the last grant's put failed: the lease may be gone too, start over
                self._grant(None)
                return True
            self._next_beat = sent + self.beat_s
            self._sends.append(self._send_now())
            renewal = self._client.keep_alive(self._lease_id, every_s=self.beat_s, silent_s=SILENT_BEATS * self.beat_s)
            if renewal is None:
                return False
            renewal_sent = self._sent(renewal)
            if renewal.ttl > 0:  # renewed from its request's send time
                self._renewed(renewal_sent)
                return True
            self.renewals_lost += 1
            self.lost_at = sent
            started = self._in_beat_since  # the lease thread's current beat, when another thread found the lapse
            stuck = self._clock() - started if started is not None and not self._on_lease_thread() else 0.0
            lapse = dataclasses.replace(lapse_of(self.last_renewed, list(self._sends),
                                                 max(renewal_sent, self.last_renewed), self._ttl_s, stuck_s=stuck),
                                        sent_to=self._client.keepalive_endpoint)
            self.lapses.append(lapse)
            log.warning("node %s: liveness lease %x is gone, %.1f s after etcd last renewed it: %s (keep-alives sent "
                        "to %s); registering again", self._node_id, self._lease_id, lapse.unrenewed_s, lapse.describe(),
                        lapse.sent_to)
            self._grant(None)  # the client's request deadline: a busy etcd answers grants late too
            return True

    def check_now(self) -> None:
        """Another request found the lease gone: register again now, not at the next beat.
        Raises EtcdUnavailableError when etcd does not answer (the lease thread keeps trying),
        DuplicateNodeError when another agent took the node id meanwhile."""
        if self.conflict is not None:
            raise self.conflict
        self._beat()

    def _on_lease_thread(self) -> bool:
        return self._thread is not None and self._thread.is_current()

    def _send_now(self) -> Send:
        """A keep-alive sent now; on the lease thread, with how late it woke and how long it took since."""
        now = self._clock()
        if not self._on_lease_thread() or self._woke is None:
            return Send(now)
        (woke, late, backoff), self._woke = self._woke, None
        return Send(now, late_s=late, before_s=now - woke, backoff_s=backoff)

    def _run(self) -> None:
        wait, backoff = max(0.0, self._next_beat - self._clock()), False  # a slow start may have used the first beat
        while True:
            due = self._clock() + wait
            if self._idle(wait):
                return
            woke = self._clock()
            self._woke = (woke, max(0.0, woke - due), wait if backoff else 0.0)  # for its send (_send_now)
            self._in_beat_since = woke
            try:
                nxt = self._iteration()
            finally:
                self._in_beat_since = None
                if self._sends and self._sends[-1].at >= woke:  # this iteration's send: how long the thread stayed
                    self._sends[-1].after_s = self._clock() - self._sends[-1].at
            if nxt is None:
                return
            wait, backoff = nxt

    def _idle(self, wait_s: float) -> bool:
        """Between beats: serve the liveness listener for wait_s (this thread is its host); True once stop() came."""
        end = time.monotonic() + wait_s
        while not self._stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            self._listener.serve(left)
        return True

    def _iteration(self) -> tuple[float, bool] | None:
        """A beat, then a confirmed one's callbacks: the time until the next beat and whether that wait is a backoff
        after a failed beat, or None when the thread stops."""
        try:
            confirmed = self._beat()
        except EtcdUnavailableError as exc:
            self._health.failure(str(exc))
            return self._backoff.next(), True
        except DuplicateNodeError as exc:  # while this lease was lost, another agent took the node id
            log.error("node %s: %s; this agent stops", self._node_id, exc)
            self.conflict = exc
            self._on_granted()  # wake the rendezvous loop: it raises the conflict
            return None
        except ValueError:  # gRPC: "closed channel": the client was closed while stop() waited for this beat
            if self._stop.is_set():
                return None
            raise
        if confirmed:
            self._health.success()
            self._backoff.reset()
            self._on_beat()
        return max(0.0, self._next_beat - self._clock()), False

    def stop(self, *, revoke: bool) -> None:
        """Stop refreshing; with revoke, peers see this node gone at once."""
        self._stop.set()
        self._read = None
        self._listener.close()  # its port refuses and its connections close (the lease thread served it)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if revoke and self._lease_id:
            try:
                self._client.revoke_lease(self._lease_id)
            except EtcdUnavailableError as exc:
                log.warning("node %s: could not revoke lease (%s); it expires in %g s", self._node_id, exc, self._ttl_s)
        self._lease_id = self._published = 0


def _describe(kv: KeyValue) -> str:
    """'incarnation abc at 10.0.0.7' for an alive/ key's value."""
    try:
        data = json.loads(kv.value.decode())
    except (UnicodeDecodeError, ValueError):
        return "a value elastic-rt did not write"
    if not isinstance(data, dict):
        return "a value elastic-rt did not write"
    return f"incarnation {data.get('incarnation', '?')} at {data.get('addr', '?')}"
