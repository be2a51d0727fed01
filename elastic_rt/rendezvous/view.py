"""This node's local copy of the run's membership keys, kept current by one etcd watch stream.

One range read at start, then one Watch stream (a watcher per range of RunKeys.watch_ranges,
which leaves the worker stores out) from the revision of that read. Reading the view costs
etcd nothing: the agent's monitor tick and the rendezvous loop only read local state. The stream's
answers are applied by the etcd connection's reader thread as they are read (no thread of the view's
own to wake for each: at a first round, one thread start and about 15 context switches fewer per node).
A broken stream reconnects from a thread started for it, with jittered backoff, and resumes each watcher
after the last revision it delivered; a compacted revision costs one fresh range read.

With `alive_puts=False` the alive/ range is not watched at all until members_formed(): the view reads
the smallest alive/ key below its node's own id (one key: etcd applies the limit while it reads) and
watches that one key for its deletion. The closer of a round is the smallest live node, and that is all
a node that is not yet a member must know. Watching every deletion instead makes each lease that lapses
an event at every node: at a first meeting of 1,024 simulated nodes on 2 cores, a few lapses woke 1,023
nodes each, which made more keepalives late and more leases lapse (hundreds to thousands of watch
events per node; the meeting never formed). Here a lapse is an event at no node unless it is the smallest's; then each
node reads the next smallest and watches it instead, on the stream it has (a thread, a read of one key and one watch
request per node: the one fan-out left, for one node; reading every range again on a new stream cost each node about
five times the watch requests, and an overloaded etcd whose lapses cascaded got them all at once). A node that
registers later with a smaller id is learnt by whoever acts as closer from its join, and refresh() makes the view
find the smallest again the same way (rounds.py). When a round forms, members_formed() counts every
member alive (the final says they were, at its revision) unless a deletion after that revision was
seen, and replaces the alive watcher on the same stream, from the final's revision, without a read (re-reading
alive/ cost each node O(N) keys, O(N^2) bytes in all): at rank 0 and rank 1 (the next round's closer, and the
one after it if rank 0 is lost) with one that sees every change of alive/; at every other member, with one that sees every change of the alive/ keys up to the smallest's
(nothing else is alive there: a smaller node that registers comes too), plus one of the keys from its ring neighbour
before it to the one after it. A member's lapse or registration is then an event at its neighbours and at ranks 0
and 1, not at every node (when every member followed every alive/ change, K lapses at once cost each of N nodes 2 K events:
the fan-out that turned an overloaded etcd's lapses into a cascade, docs/scale.md); a neighbour that finds it lost
opens the next round at once (handler.py), and every member sees that. When the smallest node goes after a round
formed, a member whose ring neighbour below it is alive (a deletion it would see) reads nothing: no round closes on it
before the next one forms, and that round's final names the next smallest (its least member, alive then), watched from the final's
revision with one watch request; with no round formed within SMALLEST_READ_DELAY_S it reads as before, and a member
with nobody below it left alive in its view reads at once (it may close the next round). At 1,024 nodes, every member
reading at rank 0's loss made that re-form 1-2 s slower. A member's old watcher is cancelled with the new one's
create; one key's deletion's (before the first round) is dropped, and cancelled if it ever answers (one answer at
most: that key is gone). This node's own alive/ key is not watched before
that: NodeLease tells the view (changed()) when it granted a new lease, so that the rendezvous loop joins again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from elastic_rt.errors import EtcdUnavailableError, RendezvousDataError
from elastic_rt.rendezvous.etcd_client import EtcdClient, KeyValue, RangeRead, WatchCompacted, WatchEvent, WatchStream
from elastic_rt.rendezvous.etcd_reachability import Backoff
from elastic_rt.rendezvous.keys import RunKeys

log = logging.getLogger(__name__)

# A member's view that saw the smallest node go, with its ring neighbour below it alive (it would see that one go),
# finds the next smallest this long after (at the next lease beat, revive()), unless a round forms first: its final
# names the next smallest (its least member, alive then). At 1,024 nodes, all of them reading it at once when rank 0
# was lost made the re-form 1-2 s slower than when every member followed every alive/ change.
SMALLEST_READ_DELAY_S = 5.0


def _reentrant(lock: threading.Condition) -> bool:
    """Whether the thread that holds `lock` can take it again."""
    with lock:
        if not lock.acquire(blocking=False):
            return False
        lock.release()
        return True


class MembershipView:
    """round, closed, alive/*, waiting/*, rounds/R/final (and joins/R/*, for a view given that range) as last
    seen; `version` counts changes.

    Read the attributes while holding `lock` (a Condition that is notified on every change; two views
    may share one, so that a thread can wait for either), or `mutex`, the lock it is made over (the same lock).
    """

    def __init__(self, client: EtcdClient, keys: RunKeys, *, node_id: str,
                 ranges: list[tuple[str, bytes]] | None = None, lock: threading.Condition | None = None,
                 clock: Callable[[], float] = time.monotonic, backoff: Backoff | None = None,
                 alive_puts: bool = True, smallest_read_delay_s: float = SMALLEST_READ_DELAY_S) -> None:
        self._client = client
        self._keys = keys
        self._node_id = node_id
        self._clock = clock
        self._backoff = backoff or Backoff()
        self._ranges = ranges or keys.watch_ranges()
        self._alive_index = self._ranges.index(keys.alive_range) if keys.alive_range in self._ranges else None
        lease_key = keys.run_lease.encode()  # the range whose watcher delivers the run lease's key
        self._lease_index = next((i for i, (lo, hi) in enumerate(self._ranges) if lo.encode() <= lease_key < hi), None)
        self.alive_puts = alive_puts  # False: only the smallest live node's alive/ key is watched (module docstring)
        self._below = (keys.alive_prefix, keys.alive(node_id).encode())  # alive/ keys of smaller node ids
        self._smallest: str | None = None  # while alive_puts is False: the alive/ key watched (None: no smaller node)
        self._member = False  # a round with this node formed: the ring's watcher and the smallest's puts (members_formed)
        self._ring_index: int | None = None  # the range index of the ring neighbours' alive/ keys (members_formed)
        self._reload_wanted = False
        self._smallest_wanted = False  # a thread reads the smallest alive/ key again and watches it (_find_smallest)
        self._smallest_read_delay_s = smallest_read_delay_s
        self._smallest_due: float | None = None  # a member's view: when to find the smallest gone (revive())
        self.reloads = 0  # reads of the view's ranges, and of the smallest alive/ key (decide()'s J6 counts both)
        if lock is not None and not _reentrant(lock):
            raise ValueError("a membership view's lock must be re-entrant (a Condition over an RLock): closing its "
                             "stream can deliver the stream's end on the thread that holds it")
        self.lock = lock or threading.Condition()
        # `with view.mutex` holds the same lock as `with view.lock`, without the Condition's __enter__ and __exit__
        # in Python (a round takes the view's lock about 15 times); wait and notify stay the Condition's
        self.mutex = getattr(self.lock, "_lock", self.lock)
        self.round: KeyValue | None = None
        self.closed = False
        self.closed_kv: KeyValue | None = None  # the `closed` marker as written (its signature is checked by readers)
        self.alive: dict[str, KeyValue] = {}
        # the closer of a round is the smallest live id: this is the smallest alive/ id the view knows (while it
        # watches the smallest live node only: that node if its id is smaller than this node's, else None)
        self.smallest_alive: str | None = None
        self.departed: dict[str, float] = {}  # node -> when its alive key was seen deleted
        self._departed_rev: dict[str, int] = {}  # node -> the revision it was deleted at (or read missing)
        self.waiting: dict[str, KeyValue] = {}
        self.joins: dict[int, dict[str, KeyValue]] = {}
        self.finals: dict[int, KeyValue] = {}
        self.run_lease: KeyValue | None = None  # the run lease's key (run_lease.py), when the view covers it
        self._run_lease_key = keys.run_lease
        self.connected = False
        self.version = 0
        self._revs: list[int] = []
        self._floors: list[int] = []  # per range: events at or below this revision are already in the view
        self._stream: WatchStream | None = None
        self._tracked: int | None = None  # the round whose joins/ the last range follows (track_joins())
        self._joins_followed = False  # the tracked range's watcher is on the stream (follow_joins())
        self._stop = threading.Event()
        self._started = False
        self._gen = 0  # the watch stream's generation: answers of an earlier stream are dropped
        self._created = 0  # creates answered on the current stream
        self._opened_with = 0  # the creates it opened with
        self._recovering = False  # a thread reopens the stream (reads again first when _retry_reload)
        self._stranded = False  # no thread could be started to reopen it: revive() tries again
        self._retry_wait, self._retry_reload = 0.0, False
        self._thread: threading.Thread | None = None  # the last such thread

    # ---- lifecycle ----------------------------------------------------------
    def start(self, read: tuple[RangeRead, list[list[KeyValue]], int] | None = None) -> None:
        """One range read (raises EtcdUnavailableError), then the watch stream, whose answers the connection's reader
        thread applies here: the view has no thread of its own while the stream works (one reopens a stream that
        broke or must be read again, and ends when it is open). `read`: first_read() as read elsewhere (with this
        node's registration: one request fewer), its keys and revision, instead of the read."""
        if self._started:
            return
        if read is not None and read[0] != self.first_read():
            read = None  # the view changed since that read was made: it reads itself (start() reads, or raises)
        self._reload(read)
        self._started = True
        try:
            opened = not self._reload_wanted and self._open()
        except EtcdUnavailableError as exc:
            with self.mutex:
                self._failed(exc, reload=False)
            return
        if not opened:
            with self.mutex:
                self._recover_later(0.0, False)

    def stop(self) -> None:
        self._stop.set()
        self.reconnect()
        with self.mutex:
            self._gen += 1  # what the stream still delivers is dropped
            self._stream = None
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        self._set_connected(False)

    def reconnect(self) -> None:
        """Drop the stream; another is opened on the client's current endpoint (after a failover)."""
        with self.mutex:
            stream = self._stream
        if stream is not None:
            stream.close()

    def changed(self) -> None:
        """Something the view's readers depend on changed outside it (this node's lease was granted anew):
        wake whoever waits on the view. While the view watches the smallest node only, this node's own alive/
        key is not watched, so its loss is not an event here."""
        with self.mutex:
            self.version += 1
            self.lock.notify_all()

    def refresh(self) -> None:
        """Find the smallest live node again (a node with a smaller id than this one registered after the last read):
        while the view watches the smallest node only, the read finds it. Nothing to do for a view that follows
        every alive/ change."""
        with self.mutex:
            if self._smallest_only():
                self._find_smallest()

    def _find_smallest(self) -> None:
        """Have a thread read the smallest alive/ key below this node's again and watch it instead of the one
        watched now, on the same stream (_swap_smallest); with no stream open, the thread that reopens it reads
        every range anyway. Caller holds the lock."""
        if self._stream is None:
            self._read_again()
            return
        self._smallest_wanted = True
        self._recover_later(0.0, False)

    def _read_again(self) -> None:
        """Read again and reopen the stream (closing it has a thread do both). Caller holds the lock."""
        self._reload_wanted = True
        if self._stream is not None:
            self._stream.close()

    def members_formed(self, nodes: tuple[str, ...], revision: int) -> None:
        """A round of `nodes` formed at `revision` (its final's mod_revision): every member was alive then
        (its join, on its lease, was). The view counts each member alive unless it saw the member's alive
        key deleted after that revision. A member the view never read has, in `alive`, one shared placeholder with
        no key and no value (the members' incarnations come with the final): no per-member object, key name or event.

        A view that watched the smallest node's deletion only then follows, on the same stream, from revision + 1
        (no read): as rank 0 or rank 1 with no smaller node known, every alive/ change (_follow_all: it closes the
        next round); else every change of the alive/ keys up to the smallest live node's below this node's id (the
        smallest's registration, and a smaller node that registers; nothing else is there) and of the keys from its
        ring neighbour before it to the one after it in the round (_form_ring): two watch requests. Not every alive/
        change at every node: that made each lapse and each registration an event at every node, the fan-out that
        turned an overloaded etcd's lapses into a cascade (docs/scale.md). A member that leaves is seen by its ring
        neighbours and ranks 0 and 1 (and by every node when it is the smallest); they open the next round at once
        (handler.py), and every other member sees that (MembershipMonitor: ROUND_ADVANCED)."""
        index = self._alive_index
        with self.mutex:
            if self._departed_rev:
                members = set(nodes)
                for node in [n for n, rev in self._departed_rev.items() if rev <= revision and n in members]:
                    self.departed.pop(node, None)  # left, and was back to join
                    del self._departed_rev[node]
            alive, departed = self.alive, self.departed
            unread = [n for n in nodes if n not in alive and n not in departed]
            if unread:
                alive.update(dict.fromkeys(unread, KeyValue("", b"", revision, revision, 0)))
            ordered = sorted(nodes)  # rank order
            least = ordered[0] if ordered else None
            if self._smallest_due is not None:  # the smallest went, the next one not found yet: this final names it
                self._smallest_due = None
                self.smallest_alive = self._smallest = None
            if not self.alive_puts and index is not None and self._closer_or_next(ordered):
                self._follow_all(revision)  # the closer of the next round, or the one after it if it is lost
            elif not self.alive_puts and index is not None:
                adopt = least is not None and least < self._node_id and (self.smallest_alive is None
                                                                         or least < self.smallest_alive)
                if adopt:  # the round's least member, alive at its final: the smallest from now on, without a read
                    self.smallest_alive, self._smallest = least, self._keys.alive(least)
                    self._smallest_wanted = False
                self._form_ring(ordered, revision, smallest_changed=adopt)
            if self.alive_puts and least is not None and (self.smallest_alive is None or least < self.smallest_alive):
                self.smallest_alive = least
            self.version += 1
            self.lock.notify_all()

    def _closer_or_next(self, ordered: list[str]) -> bool:
        """Whether this node is rank 0 or rank 1 of the members (`ordered`: in id order) with no smaller live node known than rank 0 (caller holds
        the lock): rank 0 closes the next round; rank 1 closes it when rank 0 is the node lost, and with a view of
        every alive/ key it needs no read for it (at 1,024 nodes, losing rank 0 took 5.30 s to re-form when rank 1
        read alive/ then, against 2.94 s when every member followed every alive/ change)."""
        return self._node_id in ordered[:2] and (self.smallest_alive is None or self.smallest_alive >= ordered[0])

    def _follow_all(self, revision: int) -> None:
        """members_formed() for rank 0 and rank 1 (caller holds the lock): every alive/ change from revision + 1 on, on
        the same stream, in place of the smallest's and the ring's watchers. Rank 0 closes the next round (rank 1 if
        rank 0 is lost): a re-formation closes once every live node joined, and only a view of every alive/ key
        knows them (two nodes: O(N) events per lapse in all, not per node); a one-node job's restart needs no read
        of its own for it."""
        index, ri = self._alive_index, self._ring_index
        self._untrack()
        if ri is not None:  # the last range, with no joins tracked
            if self._stream is not None:
                self._stream.forget(ri)
            del self._ranges[ri], self._revs[ri], self._floors[ri]
            self._ring_index = None
        # the watcher of one key's deletion is dropped, and cancelled if it answers (_form_ring()); a member's, cancelled.
        # Not from the old watcher's revision: that would replay every registration since this node's first read.
        # The deletions up to the final have come on the same stream before the final did.
        cancel = self._member
        self._member = self.alive_puts = True
        self._rewatch(index, self._ranges[index], revision, cancel=cancel)

    def _form_ring(self, ordered: list[str], revision: int, *, smallest_changed: bool = False) -> None:
        """members_formed()'s watchers (caller holds the lock; `ordered`: the members in id order): the smallest node's,
        turned from its deletion to every change up to it, once, and again when the smallest is another node
        (`smallest_changed`); the ring's, added, or replaced when this round's neighbours are others."""
        index = self._alive_index
        self._untrack()  # the joins of the round that formed: no longer needed, and the ring's index goes before them
        if not self._member or smallest_changed:
            # a member's watcher (every change up to the old smallest) is cancelled with the create: left idle, the
            # ones of each smallest lost piled up in etcd, and a node below them registering again was an event at
            # every one of them. The watcher of one key's deletion, before the first round, is dropped without a
            # cancel: it answers at most once (that key is gone), and is cancelled then (WatchStream.forget). Not
            # from the old watcher's revision: its deletions up to the final came on the same stream before the
            # final did (a synced watcher's events are sent in revision order)
            cancel, self._member = self._member, True
            self._rewatch(index, self._watched_ranges(frozenset({index}))[index], revision, cancel=cancel)
        ring, ri = self._ring(ordered), self._ring_index
        if ring is None:
            if ri is None:
                return  # a one-node round: no neighbour
            ring = (self._keys.alive(self._node_id), self._keys.alive(self._node_id).encode() + b"\0")
        if ri is None:
            self._ring_index = ri = len(self._ranges)
            self._ranges.append(ring)
            self._revs.append(revision)
            self._floors.append(revision)
        elif self._ranges[ri] == ring:
            return  # the same neighbours: the watcher stays
        else:
            old, self._ranges[ri] = self._ranges[ri], ring
            placeholder = KeyValue("", b"", revision, revision, 0)
            for node, kv in list(self.alive.items()):  # values the old ring did not follow may be behind: read again
                if kv.value and self._covers([ring], node) and not self._covers([old], node):
                    self.alive[node] = placeholder
        self._rewatch(ri, ring, revision, cancel=True)  # a new index has no watcher to cancel

    def _rewatch(self, index: int, key_range: tuple[str, bytes], revision: int, *, cancel: bool,
                 deletes_only: bool = False) -> None:
        """Range `index`'s watcher replaced, on the stream there is (none: the next one opens with it), by one of
        `key_range` from revision + 1: what came up to `revision` is in the view already. `cancel`: ask etcd to
        cancel the old one (else it stays until the stream ends, its events dropped here). Caller holds the lock."""
        stream = self._stream
        if stream is not None:
            stream.forget(index, cancel=cancel)
        self._floors[index] = self._revs[index] = revision
        if stream is not None:
            stream.add(index, key_range, revision + 1, deletes_only=deletes_only)

    def _ring(self, ordered: list[str]) -> tuple[str, bytes] | None:
        """The alive/ keys from this node's ring neighbour before it to the one after it, of the members in id order
        (ranks follow it): one range (the first and the last member each have one neighbour in it; the smallest's
        watcher covers the first member for every node). None for a round of one node, or one without this node."""
        if self._node_id not in ordered or len(ordered) < 2:
            return None
        i = ordered.index(self._node_id)
        lo, hi = ordered[max(i - 1, 0)], ordered[min(i + 1, len(ordered) - 1)]
        return self._keys.alive(lo), self._keys.alive(hi).encode() + b"\0"

    def _covers(self, ranges: list[tuple[str, bytes]], node: str) -> bool:
        key = self._keys.alive(node)
        return any(lo <= key and key.encode() < hi for lo, hi in ranges)

    def track_joins(self, rnd: int, joins: list[KeyValue], revision: int) -> None:
        """Follow round rnd's joins/ too (the closer's): `joins` as read at `revision`, then, from follow_joins()
        on, every change, on this view's own stream from revision + 1: one watch request, no other stream or
        thread, and none at all for a closer that closes the round on the joins it read. (Not etcd replaying the
        round's joins from the revision that opened it: a watcher that starts in the past waits for etcd's sync
        loop, up to 100 ms, and the round with it.) joins_of(rnd) has them; untrack_joins() ends it."""
        with self.mutex:
            if self._tracked == rnd:
                return
            self._untrack()
            key_range = self._keys.join_range(rnd)
            self._ranges.append(key_range)
            self._revs.append(revision)
            self._floors.append(revision)
            self._tracked = rnd
            self.joins[rnd] = {self._keys.parse(kv.key)[2]: kv for kv in joins}
            self.version += 1
            self.lock.notify_all()

    def follow_joins(self) -> None:
        """The tracked joins' watcher, on the stream, from the read's revision + 1 (once; a stream opened since
        track_joins() watches them already). Call it before waiting for them to change."""
        with self.mutex:
            if self._tracked is None or self._joins_followed or self._stream is None:
                return
            index = len(self._ranges) - 1
            self._stream.add(index, self._ranges[index], self._revs[index] + 1)
            self._joins_followed = True

    def untrack_joins(self) -> None:
        with self.mutex:
            self._untrack()

    def joins_of(self, rnd: int | None) -> dict[str, KeyValue] | None:
        """Round rnd's joins as track_joins() follows them, None when it does not (caller holds the lock)."""
        return self.joins.get(rnd, {}) if rnd is not None and self._tracked == rnd else None

    def _untrack(self) -> None:
        if self._tracked is None:
            return
        if self._stream is not None and self._joins_followed:
            self._stream.forget(len(self._ranges) - 1)
        self._joins_followed = False
        self._ranges.pop()
        self._revs.pop()
        self._floors.pop()
        self.joins.pop(self._tracked, None)
        self._tracked = None

    def registrations(self, keys: list[str], revision: int) -> dict[str, KeyValue | None]:
        """Of `keys` (alive/ keys and the run lease's), what this view answers without a read (caller holds the
        lock): an alive/ key whose value it read or saw put, while it follows every change of that key (every alive/
        key, or the smallest's and the ring's: not a member it holds a placeholder or a key without its value for); the run lease's key once the watcher that covers
        it has delivered every event up to `revision` (a watcher's events come in revision order). A value put
        meanwhile is at most as far behind as the watch stream's delivery."""
        found: dict[str, KeyValue | None] = {}
        prefix = self._keys.alive_prefix
        i = self._lease_index
        for key in keys:
            if key == self._run_lease_key:
                if i is not None and i < len(self._revs) and self._revs[i] >= revision:
                    found[key] = self.run_lease
            elif key.startswith(prefix) and (self.alive_puts or self._follows(key)):
                kv = self.alive.get(key[len(prefix):])
                if kv is not None and kv.value:
                    found[key] = kv
        return found

    def learn(self, found: dict[str, KeyValue | None]) -> None:
        """alive/ values read elsewhere (the members' keys read with a round) for the members this view holds a
        placeholder for, or an older put (its event is on its way: it brings the same value): the next rounds find
        them here. A member the view saw deleted, or put again since the read, stays as the view has it. The
        view's version does not change (no member came or went)."""
        prefix = self._keys.alive_prefix
        with self.mutex:
            for key, kv in found.items():
                if kv is None or not key.startswith(prefix):
                    continue
                node = key[len(prefix):]
                held = self.alive.get(node)
                if held is not None and (not held.key or held.mod_revision < kv.mod_revision
                                         or (held.mod_revision == kv.mod_revision and not held.value)):
                    self.alive[node] = kv

    def _follows(self, key: str) -> bool:
        """Whether a member's view follows every change of this alive/ key: the smallest node's, or one in its ring's
        range (caller holds the lock)."""
        if not self._member:
            return False
        ri = self._ring_index
        return key == self._smallest or (ri is not None and self._ranges[ri][0] <= key
                                         and key.encode() < self._ranges[ri][1])

    def _ring_alive_below(self) -> bool:
        """Whether the view holds alive a node below this one in its ring's range (from its ring neighbour before
        it): below the smallest, the other alive/ range it follows, nothing is alive. Node ids compare as their keys
        do; no key is built per node (every member runs this when the smallest goes). Caller holds the lock."""
        ri = self._ring_index
        if ri is None:
            return False
        lowest, me = self._keys.parse(self._ranges[ri][0])[2], self._node_id
        return any(lowest <= n < me for n in self.alive)

    def _deletes_only(self) -> frozenset[int]:
        """The range whose watcher gets no puts: alive/'s, until a round with this node formed."""
        return frozenset() if self._member else self._smallest_only()

    def _smallest_only(self) -> frozenset[int]:
        """The range read and watched up to the smallest live node's key only: alive/'s, unless the view follows
        every alive/ change."""
        return frozenset() if self.alive_puts or self._alive_index is None else frozenset({self._alive_index})

    @property
    def stream_endpoint(self) -> str | None:
        with self.mutex:
            return self._stream.endpoint if self._stream is not None else None

    def wait(self, version: int, timeout_s: float) -> int:
        """Block until the view changes past `version` or timeout_s passes; returns the version now."""
        deadline = self._clock() + max(0.0, timeout_s)
        with self.mutex:
            while self.version == version and not self._stop.is_set():
                left = deadline - self._clock()
                if left <= 0:
                    break
                self.lock.wait(left)
            return self.version

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Block until predicate() (called with the lock held) is true or timeout_s passes."""
        deadline = self._clock() + max(0.0, timeout_s)
        with self.mutex:
            while not predicate():
                left = deadline - self._clock()
                if left <= 0 or self._stop.is_set():
                    return False
                self.lock.wait(left)
            return True

    # ---- the watch stream ------------------------------------------------
    def _open(self) -> bool:
        """Open the watch stream for the ranges the view holds, from the revisions it has (raises
        EtcdUnavailableError). False when the view changed meanwhile (members_formed(), track_joins() or a re-read
        wanted after the ranges were chosen): that stream is closed again, and the caller opens another."""
        with self.mutex:
            filters, starts = self._deletes_only(), [r + 1 for r in self._revs]
            ranges = self._watched_ranges(self._smallest_only())
            watched = list(self._ranges)
            self._gen += 1
            gen = self._gen
            self._created, self._opened_with = 0, len(watched)
        stream = self._client.open_watch(ranges, starts, deletes_only=filters,
                                         on_event=lambda index, events, created: self._on_watch(gen, index, events,
                                                                                                  created),
                                         on_end=lambda error: self._on_watch_end(gen, error))
        with self.mutex:
            if gen != self._gen:
                return True  # it ended already: its end has the stream opened again
            if not (self._stop.is_set() or self._reload_wanted or self._deletes_only() != filters
                    or self._ranges != watched or self._watched_ranges(self._smallest_only()) != ranges):
                self._stream = stream
                self._joins_followed = self._tracked is not None  # its ranges include the tracked joins
                return True
            self._gen += 1  # stale: its answers and its end are dropped
        stream.close()
        return self._stop.is_set()

    def _on_watch(self, gen: int, index: int, events: list[WatchEvent], created: bool) -> None:
        """An answer of the watch stream (the connection's reader thread)."""
        with self.mutex:
            if gen != self._gen:
                return
            if created:
                self._created += 1
                if self._created == self._opened_with:  # the creates it opened with (more come with add())
                    self._backoff.reset()
                    self._set_connected(True)
                return
            self._apply(index, events)

    def _on_watch_end(self, gen: int, error: Exception | None) -> None:
        """The watch stream ended (the connection's reader thread, or the thread that closed it): open another,
        from a thread, after a backoff when etcd did not answer."""
        with self.mutex:
            if gen != self._gen:
                return
            self._gen += 1
            self._stream = None
            if self._stop.is_set():
                return
            if error is None:  # closed here: reconnect(), or a re-read wanted
                self._recover_later(0.0, False)
            else:
                self._failed(error, reload=False)

    def _failed(self, error: Exception, *, reload: bool) -> None:
        """The stream broke, or could not be opened (or read again first, with `reload`): have it opened again,
        at once and after a read for a compacted revision, else after a backoff, reading again first with `reload`
        when etcd did not answer and always after anything else (the view must outlive any one bad response).
        Caller holds the lock."""
        if isinstance(error, WatchCompacted):
            log.info("node %s: membership watch: %s; re-reading", self._node_id, error)
            self._recover_later(0.0, True)
            return
        self._set_connected(False)
        if isinstance(error, EtcdUnavailableError):
            log.debug("node %s: membership watch: %s", self._node_id, error)
        else:
            log.warning("node %s: membership watch failed: %r; reconnecting", self._node_id, error)
            reload = True
        self._recover_later(self._backoff.next(), reload)

    def _recover_later(self, wait_s: float, reload: bool) -> None:
        """Have a thread open the stream again after wait_s, reading first with `reload` (caller holds the lock)."""
        self._retry_wait = max(self._retry_wait, wait_s)
        self._retry_reload = self._retry_reload or reload
        if self._recovering or self._stop.is_set():
            return
        self._recovering = True
        thread = threading.Thread(target=self._recover, name="elastic-rt-view", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to be had (a process or cgroup thread limit): revive() tries again
            self._recovering, self._stranded = False, True
            if self._stream is None:  # else the open stream still works: only the smallest node is not found again
                self._set_connected(False)
            log.warning("node %s: membership watch: could not start a thread to reopen it (%s); trying again at the "
                        "next lease beat", self._node_id, exc)
            return
        self._thread = thread

    def revive(self) -> None:
        """Reopen a stream that ended while no thread could be started to reopen it, and find the next smallest node
        when a member's view put that off and no round formed meanwhile (the lease thread calls this after every
        beat; nothing to do otherwise)."""
        with self.mutex:
            if self._smallest_due is not None and self._clock() >= self._smallest_due:
                self._smallest_due = None
                if self._smallest_only():
                    self._find_smallest()
            if self._stranded:
                self._stranded = False
                self._recover_later(0.0, self._stream is None)  # with a stream open: the smallest node's read only

    def _recover(self) -> None:
        while True:
            with self.mutex:
                if self._stop.is_set():
                    self._recovering = False
                    return
                wait, reload = self._retry_wait, self._retry_reload or self._reload_wanted
                self._retry_wait, self._retry_reload = 0.0, False
                smallest = self._smallest_wanted and self._stream is not None and not reload
                if self._smallest_wanted and not smallest:  # no stream to swap a watcher on: a read of every
                    self._smallest_wanted, reload = False, True  # range finds the smallest too
                if not smallest and self._stream is not None:  # never a second stream beside an open one
                    if not reload:
                        self._recovering = False
                        return
                    self._read_again()  # its end comes back here (_on_watch_end): this loop reopens it
            if wait and self._stop.wait(wait):
                continue
            if smallest:
                self._read_smallest()  # raises nothing; the loop's top ends this thread once nothing is left to do
                continue
            try:
                if reload:
                    self._reload()
                with self.mutex:
                    again = self._reload_wanted
                opened = not again and self._open()
            except Exception as exc:  # noqa: BLE001 - the view must outlive any one bad response
                with self.mutex:
                    self._failed(exc, reload=reload)
                continue
            with self.mutex:
                if opened and (self._stop.is_set() or (self._stream is not None and not self._smallest_wanted)):
                    self._recovering = False
                    return
                if not opened:
                    self._retry_reload = self._retry_reload or self._reload_wanted

    def _read_smallest(self) -> None:
        """Read the smallest alive/ key below this node's and watch it on the open stream (the recovery thread). A read
        that failed is tried again after a backoff; a stream that ended meanwhile is reopened after a read of every
        range."""
        with self.mutex:
            self._smallest_wanted = False
            gen = self._gen
        try:
            (found,), rev = self._client.read_ranges([self._below], first_only=frozenset({0}),
                                                     keys_only=frozenset({0}) if self._deletes_only() else frozenset())
        except Exception as exc:  # noqa: BLE001 - the view must outlive any one bad response
            with self.mutex:
                log.debug("node %s: membership watch: finding the smallest node again: %s", self._node_id, exc)
                self._smallest_wanted = True
                self._retry_wait = max(self._retry_wait, self._backoff.next())
            return
        with self.mutex:
            if gen == self._gen and self._stream is not None and self._smallest_only():
                self._swap_smallest(found[0] if found else None, rev)
            elif self._smallest_only():
                self._retry_reload = True  # the stream ended meanwhile: its reopening reads the smallest too

    def _swap_smallest(self, kv: KeyValue | None, rev: int) -> None:
        """The smallest alive/ key below this node's as read at `rev` (None: there is none): the alive map as a read of
        every range would have it, and its watcher, from rev + 1, replaces the one of the node that left, on the same
        stream (a member's cancelled, one key's deletion dropped: _form_ring()). Caller holds the lock; the other
        ranges stay watched."""
        index = self._alive_index
        covered = self._below_covered(kv)
        self._smallest_due = None
        self._smallest = kv.key if kv is not None else None
        self._replace_alive([kv] if kv is not None else [], self._clock(), rev, covered)
        self._rewatch(index, self._watched_ranges(frozenset({index}))[index], rev, cancel=self._member,
                      deletes_only=bool(self._deletes_only()))
        self.reloads += 1
        self.version += 1
        self.lock.notify_all()

    def _set_connected(self, connected: bool) -> None:
        with self.mutex:
            if self.connected != connected:
                self.connected = connected
                self.version += 1
                self.lock.notify_all()

    def _watched_ranges(self, smallest_only: frozenset[int]) -> list[tuple[str, bytes]]:
        """The ranges the stream watches: while alive_puts is False the alive/ watcher covers one key, the
        smallest live node's (or, with none below this node, the key alive/ itself, which no node has).
        Caller holds the lock."""
        ranges = list(self._ranges)
        for i in smallest_only:
            if self._member:  # every change up to the smallest's key: nothing else is alive there
                ranges[i] = (self._keys.alive_prefix, self._smallest.encode() + b"\0" if self._smallest
                             else self._below[1])
            else:
                key = self._smallest or self._keys.alive_prefix
                ranges[i] = (key, key.encode() + b"\0")
        return ranges

    def first_read(self) -> RangeRead:
        """What start() reads: give the result to start() to have the read made elsewhere, in the same request as
        something else (a view that changed meanwhile reads again itself)."""
        with self.mutex:
            return self._read_spec()

    def _read_spec(self) -> RangeRead:
        """The ranges a read of the view covers now (caller holds the lock): while alive_puts is False, the smallest
        alive/ key if it is below this node's, without its value."""
        smallest_only = self._smallest_only()
        return RangeRead([self._below if i in smallest_only else r for i, r in enumerate(self._ranges)],
                         keys_only=self._deletes_only(), first_only=smallest_only)

    def _reload(self, done: tuple[RangeRead, list[list[KeyValue]], int] | None = None) -> None:
        if done is not None:
            spec, ranges, rev = done
            with self.mutex:
                watched = list(self._ranges)
        else:
            with self.mutex:
                spec, watched = self._read_spec(), list(self._ranges)
            ranges, rev = self._client.read_ranges(spec.ranges, keys_only=spec.keys_only, first_only=spec.first_only)
        smallest_only = spec.first_only
        now = self._clock()
        with self.mutex:
            if self._read_spec() != spec or self._ranges != watched:
                self._reload_wanted = True  # members_formed() or track_joins() came meanwhile: read again
                return
            covered = None
            if smallest_only:
                smallest = ranges[self._alive_index][0] if ranges[self._alive_index] else None
                covered = self._below_covered(smallest)
                if self._ring_index is not None:
                    covered.append(self._ranges[self._ring_index])
                self._smallest = smallest.key if smallest is not None else None
            self.round, self.closed, self.closed_kv, self.run_lease = None, False, None, None
            self.waiting, self.joins, self.finals = {}, {}, {}
            self._smallest_due = None
            self._replace_alive([kv for kvs in ranges for kv in kvs], now, rev, covered)
            self._revs = [rev] * len(self._ranges)
            self._floors = [rev] * len(self._ranges)
            self._reload_wanted = False
            self.reloads += 1
            self.version += 1
            self.lock.notify_all()

    def _below_covered(self, smallest: KeyValue | None) -> list[tuple[str, bytes]] | None:
        """The alive/ keys a read of the smallest one below this node's speaks for, up to the one it found (all below
        this node's, with none): for a member's view, whose alive map holds more than what it reads. None (the whole
        map) before. Caller holds the lock."""
        if not self._member or self.alive_puts:
            return None
        return [(self._keys.alive_prefix, smallest.key.encode() + b"\0" if smallest is not None else self._below[1])]

    def _replace_alive(self, kvs: list[KeyValue], now: float, rev: int,
                       covered: list[tuple[str, bytes]] | None = None) -> None:
        """Apply a range read's keys (any kind) over the alive map emptied where the read speaks for it (`covered`:
        those alive/ ranges; None: all of it): a node the read no longer has departed now. A member's view keeps
        the members it does not read (its ring's neighbours see them go). The caller holds the lock and has emptied
        the other maps the read covers."""
        self.smallest_alive = None
        if covered is None:
            before = set(self.alive)
            self.alive = {}
        else:
            before = {node for node in self.alive if self._covers(covered, node)}
            for node in before:
                del self.alive[node]
        for kv in kvs:
            self._put(kv, now)
        for node in before - set(self.alive):
            if node not in self.departed:
                self.departed[node], self._departed_rev[node] = now, rev

    def _apply(self, index: int, events: list[WatchEvent]) -> None:
        now = self._clock()
        with self.mutex:
            if index >= len(self._ranges):
                return  # a tracked range untrack_joins() dropped while its events were on their way
            if self._tracked is not None and index == len(self._ranges) - 1:
                # the index of another round's joins before: untracked, then tracked again for this round
                lo, hi = self._ranges[index][0], self._ranges[index][1].decode()
                events = [ev for ev in events if lo <= ev.kv.key < hi]
            for ev in events:
                if ev.kv.mod_revision <= self._floors[index]:
                    continue  # before a watcher's start (members_formed() replaced it): applied already
                if ev.deleted:
                    self._delete(ev.kv, now)
                else:
                    self._put(ev.kv, now)
                self._revs[index] = max(self._revs[index], ev.kv.mod_revision)
            self.version += 1
            self.lock.notify_all()

    # ---- key layout -> state (caller holds the lock) -------------------------
    def _put(self, kv: KeyValue, now: float) -> None:
        kind, rnd, node = self._keys.parse(kv.key)
        if kind == "round":
            self.round = kv
            self._prune()
        elif kind == "closed":
            self.closed, self.closed_kv = True, kv
        elif kind == "alive":
            self._set_alive(node, kv)
        elif kind == "waiting":
            self.waiting[node] = kv
        elif kind == "join":
            self.joins.setdefault(rnd, {})[node] = kv
        elif kind == "final":
            self.finals[rnd] = kv
        elif kv.key == self._run_lease_key:
            self.run_lease = kv

    def _set_alive(self, node: str, kv: KeyValue) -> None:
        self.alive[node] = kv
        self.departed.pop(node, None)
        self._departed_rev.pop(node, None)
        if self._member and not self.alive_puts:
            # only a node below this one's id can be the smallest: its key is in the smallest's watched range (every
            # key up to it), so its deletion comes too
            if node < self._node_id and (self.smallest_alive is None or node < self.smallest_alive
                                         or (self._smallest_due is not None and node == self.smallest_alive)):
                # the smallest again (one that left and is back, while the next one was not looked for yet)
                self.smallest_alive, self._smallest, self._smallest_due = node, kv.key, None
        elif self.smallest_alive is None or node < self.smallest_alive:
            self.smallest_alive = node

    def _delete(self, kv: KeyValue, now: float) -> None:
        kind, rnd, node = self._keys.parse(kv.key)
        if kind == "round":
            self.round = None
        elif kind == "closed":
            self.closed, self.closed_kv = False, None
        elif kind == "alive":
            known = self.alive.pop(node, None) is not None
            if known:
                self.departed[node], self._departed_rev[node] = now, kv.mod_revision
            if self._smallest_only():
                # the smallest node left: until the next read finds the next smallest (_find_smallest: its watcher is
                # swapped on this stream), smallest_alive stays as it was: somebody smaller may still be alive
                if kv.key == self._smallest or (known and self._smallest_due is not None and node < self._node_id):
                    if self._member and self._ring_alive_below():
                        # a node below this one is alive, one whose deletion this view would see (its ring neighbour
                        # before it): this node closes no round before the next one forms, whose final names the next
                        # smallest (members_formed())
                        if self._smallest_due is None:
                            self._smallest_due = now + self._smallest_read_delay_s
                    else:  # this node may be the smallest now: the closer of the next round
                        self._smallest_due = None
                        self._find_smallest()
            elif known and node == self.smallest_alive:
                self.smallest_alive = min(self.alive) if self.alive else None
        elif kind == "waiting":
            self.waiting.pop(node, None)
        elif kind == "join":
            self.joins.get(rnd, {}).pop(node, None)
        elif kind == "final":
            self.finals.pop(rnd, None)
        elif kv.key == self._run_lease_key:
            self.run_lease = None

    def _prune(self) -> None:
        """Keep the current and the previous round's keys only (rank 0 deletes older ones from etcd)."""
        try:
            current = self.current_round()
        except RendezvousDataError:
            return  # the handler reports it
        if current is None:
            return
        for table in (self.joins, self.finals):
            for rnd in [r for r in table if r < current - 1]:
                del table[rnd]

    def current_round(self) -> int | None:
        """The round number (caller holds the lock); None before the first node created it."""
        if self.round is None:
            return None
        return self._keys.decode_round(self.round)
