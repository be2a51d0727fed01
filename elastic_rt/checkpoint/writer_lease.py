"""One writer per checkpoint root: a lease kept beside the checkpoints, with epochs as fencing tokens.

    <root>/writer-lease/00000012.json   {"epoch", "run_id", "launch_id", "round", "host", "pid", "pid_ns",
                                          "beat", "beat_unix_s", "ttl_s", "released"}

Rank 0 of a CheckpointManager acquires the lease when the manager is created: it creates the next
epoch's record, create-only (the same primitive as a commit: whoever creates epoch E+1 first holds
the lease; the other gets FileExistsError and looks again). The holder rewrites its record every
ttl_s / 3 (`beat`), and before each beat and each commit it checks that no newer epoch exists.

A newcomer takes over at once when the newest record is released (its manager closed), belongs
to the same job (under an elastic-rt agent: the same run and launch at an older or the same round,
the agent re-formed the group and the round fence stops the old one; without one: the same named run,
torchrun's --rdzv-id, whose next rank 0 may sit on another host after a node loss), or names a process on this host, in this PID namespace, that no
longer exists (a crashed predecessor; containers that share a host name have PID namespaces of their
own, where the same pid means another process). A record of another run or launch is in use while its beat
moves: a record written less than ttl_s ago by the wall clock is refused at once (one line naming
the holder), unless `wait_s` allows waiting for its release; one that looks older is taken over
only after its beat did not move for ttl_s on this process's own monotonic clock (no clock skew
can make a live holder look dead). The holder's own view is the mirror image: its lease is valid
until ttl_s after it sent its last beat that storage accepted; a holder paused longer (SIGSTOP)
finds a newer epoch, or its time run out, and commits and deletes nothing.

Epochs only grow, across runs and launches: every save folder carries its writer's epoch, and
clean-up deletes only save folders of older epochs.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

from elastic_rt.checkpoint.backends import Storage
from elastic_rt.checkpoint.fence import FencedError
from elastic_rt.checkpoint.manifest import WriterToken
from elastic_rt.errors import CheckpointError

log = logging.getLogger(__name__)

LEASE_DIR = "writer-lease"


@dataclass(frozen=True, kw_only=True)
class LeaseRecord:
    epoch: int
    run_id: str
    launch_id: str
    round: int
    host: str
    pid: int
    pid_ns: str = ""  # /proc/self/ns/pid's target: pids compare only within one namespace
    beat: int = 0
    beat_unix_s: float = 0.0
    ttl_s: float = 30.0
    released: bool = False

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "LeaseRecord":
        body = json.loads(data.decode())
        return cls(**{k: body[k] for k in cls.__dataclass_fields__ if k in body})

    def describe(self) -> str:
        return (f"run {self.run_id or '-'} (launch {self.launch_id or '-'}, round {self.round}, "
                f"{self.host} pid {self.pid})")


def _pid_namespace() -> str:
    """This process's PID namespace ("pid:[4026531836]"), or "" where there is no /proc."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _record_name(epoch: int) -> str:
    return f"{epoch:08d}.json"


class WriterLease:
    """Rank 0's hold on a checkpoint root. acquire(), then check() before every commit and delete."""

    def __init__(self, storage: Storage, *, token: WriterToken, ttl_s: float, wait_s: float = 0.0,
                 fenced: bool = False, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        """fenced: the token's launch and round come from an elastic-rt agent (checkpoint/fence.py)."""
        self._storage, self._ttl_s, self._wait_s, self._fenced = storage, ttl_s, wait_s, fenced
        self._clock, self._wall = clock, wall
        self._dir = posixpath.join(storage.root, LEASE_DIR)
        self._record = LeaseRecord(epoch=0, run_id=token.run_id, launch_id=token.launch_id, round=token.round,
                                   host=socket.gethostname(), pid=os.getpid(), pid_ns=_pid_namespace(), ttl_s=ttl_s)
        self._valid_until = 0.0
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def epoch(self) -> int:
        return self._record.epoch

    # ---- acquiring ----------------------------------------------------------------------------
    def acquire(self) -> int:
        """Hold the lease (the new epoch) or raise CheckpointError naming the holder."""
        self._storage.makedir(self._dir, sync=True)
        started = self._clock()
        watched: tuple[int, bytes] | None = None  # (epoch, record bytes) of a holder seen alive
        watched_since = started
        while True:
            newest, data = self._newest()
            if newest == 0 or data is None:
                if self._try_create(newest + 1):
                    return self.epoch
                continue
            holder = self._parse(data)
            if holder is None:
                log.warning("checkpoint writer lease under %s: record %s is damaged (names no holder); taking over",
                            self._storage.url, _record_name(newest))
            if holder is None or holder.released or self._same_job(holder) or self._dead_here(holder):
                if self._try_create(newest + 1):
                    return self.epoch
                continue
            if watched != (newest, data):
                watched, watched_since = (newest, data), self._clock()
            waited = self._clock() - started
            quiet = self._clock() - watched_since
            recent = abs(self._wall() - holder.beat_unix_s) < holder.ttl_s
            if quiet >= holder.ttl_s:
                log.warning("checkpoint writer lease under %s: %s did not beat for %.0f s; taking over",
                            self._storage.url, holder.describe(), quiet)
                if self._try_create(newest + 1):
                    return self.epoch
                continue
            if recent and waited >= self._wait_s:
                raise CheckpointError(
                    f"checkpoint URL {self._storage.url} is in use by {holder.describe()}, whose writer "
                    f"lease beat {max(0.0, self._wall() - holder.beat_unix_s):.0f} s ago; one job per URL: "
                    "give this job another checkpoint URL, or stop that job")
            time.sleep(min(1.0, max(0.05, holder.ttl_s / 10)))

    def _dead_here(self, holder: LeaseRecord) -> bool:
        """The holder ran on this host, in this PID namespace, and its process is gone (a crashed
        predecessor): no need to wait."""
        mine = self._record
        if holder.host != mine.host or holder.pid_ns != mine.pid_ns or not mine.pid_ns or holder.pid == os.getpid():
            return False
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            log.info("checkpoint writer lease under %s: %s is gone; taking over", self._storage.url, holder.describe())
            return True
        except OSError:
            return False
        return False

    def _same_job(self, holder: LeaseRecord) -> bool:
        """The holder is an earlier writer of this job: this one succeeds it (the fence or the epoch stops it)."""
        mine = self._record
        if self._fenced:
            return (holder.run_id == mine.run_id and holder.launch_id == mine.launch_id and bool(mine.launch_id)
                    and holder.round <= mine.round)
        # no agent tells launches apart: a named run is one job (torchrun's default id "none" names none)
        return holder.run_id == mine.run_id and mine.run_id not in ("", "none")

    def _newest(self) -> tuple[int, bytes | None]:
        try:
            names = self._storage.listdir(self._dir)
        except FileNotFoundError:
            return 0, None
        epochs = sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())
        if not epochs:
            return 0, None
        try:
            return epochs[-1], self._storage.read(posixpath.join(self._dir, _record_name(epochs[-1])))
        except FileNotFoundError:
            return epochs[-1], None

    @staticmethod
    def _parse(data: bytes) -> LeaseRecord | None:
        try:
            return LeaseRecord.from_json(data)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            return None  # damaged: treated as released (it names no holder that could beat)

    def _try_create(self, epoch: int) -> bool:
        record = replace(self._record, epoch=epoch, beat_unix_s=self._wall())
        sent = self._clock()
        try:
            self._storage.create(posixpath.join(self._dir, _record_name(epoch)), record.to_json())
        except FileExistsError:
            return False
        with self._lock:
            self._record, self._valid_until, self._lost = record, sent + self._ttl_s, None
        self._drop_old(epoch)
        self._thread = threading.Thread(target=self._run, name="elastic-rt-ckpt-lease", daemon=True)
        self._thread.start()
        return True

    def _drop_old(self, epoch: int) -> None:
        try:
            names = self._storage.listdir(self._dir)
            for name in names:
                if name.endswith(".json") and name[:-5].isdigit() and int(name[:-5]) < epoch - 1:
                    self._storage.remove(posixpath.join(self._dir, name))
        except (OSError, CheckpointError) as exc:
            log.debug("old writer lease records not removed (%s)", exc)

    # ---- holding ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self._ttl_s / 3):
            try:
                self.beat()
            except FencedError as exc:
                log.error("checkpoint writer lease under %s lost: %s", self._storage.url, exc)
                return
            except (OSError, CheckpointError) as exc:
                log.warning("checkpoint writer lease under %s: beat failed (%s); retrying", self._storage.url, exc)

    def beat(self) -> None:
        """Check that no newer epoch exists, then rewrite this epoch's record."""
        self._check_newest()
        sent = self._clock()
        with self._lock:
            record = replace(self._record, beat=self._record.beat + 1, beat_unix_s=self._wall())
        self._storage.write(posixpath.join(self._dir, _record_name(record.epoch)), record.to_json(), sync=False)
        with self._lock:
            self._record, self._valid_until = record, sent + self._ttl_s

    def _check_newest(self) -> None:
        newest, _ = self._newest()
        mine = self._record.epoch
        if newest != mine:
            with self._lock:
                self._lost = (f"epoch {newest} was created after this writer's epoch {mine}" if newest > mine else
                              f"this writer's record (epoch {mine}) is gone from {LEASE_DIR}/ (newest there: "
                              f"{newest or 'none'}); something deleted the lease records")
            raise FencedError(f"this writer lost the checkpoint URL {self._storage.url}: {self._lost}")

    def check(self, *, local_only: bool = False) -> None:
        """Before a commit or a delete: the lease is held, by this epoch, and its last beat is fresh (and,
        unless local_only, storage holds no newer epoch)."""
        with self._lock:
            lost, valid_until = self._lost, self._valid_until
        if lost is not None:
            raise FencedError(f"this writer lost the checkpoint URL {self._storage.url}: {lost}; not committing")
        if self._clock() >= valid_until:
            raise FencedError(f"this writer's lease on {self._storage.url} was not renewed for "
                              f"{self._clock() - valid_until + self._ttl_s:.1f} s (TTL {self._ttl_s:g} s): "
                              "another writer may hold it; not committing")
        if not local_only:
            self._check_newest()

    def release(self) -> None:
        """Mark the record released, so the next writer need not wait; stop beating."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._record.epoch == 0:
            return
        try:
            self._check_newest()
            record = replace(self._record, released=True, beat_unix_s=self._wall())
            self._storage.write(posixpath.join(self._dir, _record_name(record.epoch)), record.to_json(), sync=True)
        except (OSError, CheckpointError) as exc:
            log.info("checkpoint writer lease under %s not released (%s); it lapses in %g s",
                     self._storage.url, exc, self._ttl_s)
