"""The agent's fencing view, handed to its workers: which round is current, and until when that is known.

Workers have no etcd client (they never hold its credentials); their agent has the lease and a
watch-fed view of the run's `round` key. The agent keeps one small file current in its reports
folder (`fence.json`, replaced atomically):

    {"run_id", "launch_id", "round", "confirmed_until_monotonic", "lease_ttl_s", "agent_pid",
     "etcd_unreachable", "published_monotonic"}

`confirmed_until_monotonic` is the agent's last lease renewal that etcd confirmed (the time the
request was sent, on CLOCK_MONOTONIC, which every process of the host shares) plus the lease TTL:
until then no group can have formed without this node, because peers declare it lost only once
its lease is gone. After the lease was found gone (a pause, an outage), nothing is confirmed until
the agent has read `round` from etcd again and its view caught up (handler.catch_up). A node whose
agent is frozen with it (SIGSTOP, a hung host) stops confirming: the time passes, and its rank 0
refuses to commit when it resumes, before its agent has even noticed.

A writer commits only while the file's round is the one it was started in and the confirmation
holds (FenceCheck.check), or while its agent, alive (it rewrites the file every POLL_S meanwhile),
reports that etcd does not answer it and has not found its lease gone: then the writer lease decides
alone (WriterGuard: fresh, and no newer epoch on storage). etcd is needed to change membership, not to
train: during an outage nobody can form a new round, and a node cut off from etcd alone is re-formed
out by peers who first stop their workers, so its group's save fails in its next collective, and the
new group's rank 0 holds a newer writer epoch before it loads or saves anything. What stays open: the time between that check and the one create-only
write of the manifest (docs/failure-model.md says what the create-only commit and per-epoch save
folders close of it), and the watch's delay in telling the agent of a newer round.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from elastic_rt.errors import CheckpointError
from elastic_rt.worker_env import ENV_HEARTBEAT_DIR, ENV_ROUND

log = logging.getLogger(__name__)

FENCE_FILE = "fence.json"
POLL_S = 0.1
OUTAGE_FRESH_S = 1.0  # an outage report older than this (a frozen agent's last word) is not believed


class FencedError(CheckpointError):
    """This writer's token is not (or not known to be) current: it must commit and delete nothing."""


@dataclass(frozen=True, kw_only=True)
class FenceState:
    run_id: str
    launch_id: str
    round: int
    confirmed_until_monotonic: float
    lease_ttl_s: float
    agent_pid: int
    etcd_unreachable: bool = False  # the agent's etcd does not answer it, and its lease was not found gone
    published_monotonic: float = 0.0  # when the agent wrote this state (kept current during an outage)

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "FenceState":
        body = json.loads(data.decode())
        return cls(run_id=str(body["run_id"]), launch_id=str(body["launch_id"]), round=int(body["round"]),
                   confirmed_until_monotonic=float(body["confirmed_until_monotonic"]),
                   lease_ttl_s=float(body["lease_ttl_s"]), agent_pid=int(body["agent_pid"]),
                   etcd_unreachable=bool(body.get("etcd_unreachable", False)),
                   published_monotonic=float(body.get("published_monotonic", 0.0)))


def write_fence(path: str, state: FenceState) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(state.to_json())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_fence(path: str) -> FenceState:
    """The agent's current fencing view; FencedError when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return FenceState.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FencedError(f"this node's agent publishes no readable fencing view at {path} ({exc}); "
                          "not committing") from exc


class FenceCheck:
    """Worker side: is the round this worker was started in still current, per its agent?"""

    def __init__(self, path: str, *, round: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.round, self._clock = path, round, clock
        self._outage_logged = False
        first = read_fence(path)
        self.run_id, self.launch_id = first.run_id, first.launch_id

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "FenceCheck | None":
        """The check for a worker started by an elastic-rt agent that publishes a fence; else None
        (plain torchrun, one process, a rendezvous backend without fencing)."""
        directory, rnd = env.get(ENV_HEARTBEAT_DIR, ""), env.get(ENV_ROUND, "")
        path = os.path.join(directory, FENCE_FILE) if directory else ""
        if not path or not rnd.isdigit() or not os.path.exists(path):
            return None
        return cls(path, round=int(rnd))

    def check(self, *, wait_s: float) -> None:
        """Return while this round is current and confirmed, or while the agent reports an etcd outage (the
        writer lease decides then); else wait up to `wait_s` for the agent to confirm it (a late lease beat on
        a loaded host), then raise FencedError with one line."""
        deadline = self._clock() + wait_s
        while True:
            state = read_fence(self.path)
            if state.round != self.round or state.launch_id != self.launch_id:
                raise FencedError(
                    f"this writer belongs to round {self.round}, but its agent is in round {state.round}"
                    f"{'' if state.launch_id == self.launch_id else ' of another launch'}: a newer group "
                    "owns the checkpoints; not committing")
            now = self._clock()
            if now < state.confirmed_until_monotonic:
                self._outage_logged = False
                return
            if state.etcd_unreachable and now - state.published_monotonic <= OUTAGE_FRESH_S:
                if not self._outage_logged:
                    self._outage_logged = True
                    log.warning("round %d: etcd does not answer this node's agent; checkpoint commits go on while "
                                "the writer lease holds (no newer writer took the URL)", self.round)
                return
            if now >= deadline:
                raise FencedError(
                    f"this node's agent has not confirmed round {self.round} for "
                    f"{now - state.confirmed_until_monotonic + state.lease_ttl_s:.1f} s (lease TTL "
                    f"{state.lease_ttl_s:g} s): the node may have been re-formed out; not committing")
            time.sleep(POLL_S)


class FencePublisher:
    """Agent side: keeps `fence.json` current from the rendezvous handler, in a thread of its own
    (it must go on while the agent waits for its workers' SIGTERM saves)."""

    def __init__(self, directory: str, handler: Any, *, interval_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = os.path.join(directory, FENCE_FILE)
        self._handler, self._interval_s, self._clock = handler, interval_s, clock
        self._confirmed_until = 0.0
        self._lost_seen: int | None = None
        self._last: FenceState | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            self.publish()
        except OSError as exc:  # a full or read-only log dir: the agent goes on, its workers do not commit
            log.warning("checkpoint fence %s cannot be written (%s): this node's workers refuse to commit "
                        "checkpoints until it can (free space in --log-dir)", self.path, exc.strerror or exc)
            if not os.path.exists(self.path):
                try:
                    open(self.path, "wb").close()  # empty, so unreadable: workers refuse rather than go unfenced
                except OSError:
                    pass
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elastic-rt-fence", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.publish()
            except Exception as exc:  # the fence only lapses (workers refuse to commit): never kill the agent
                log.warning("checkpoint fence not updated (%s)", exc)

    def publish(self) -> None:
        view = self._handler.fence_view()
        if view is None:
            return
        if self._lost_seen is None:
            self._lost_seen = view["renewals_lost"]
        if view["renewals_lost"] != self._lost_seen:
            # the lease was found gone: trust the view's round again only once it has caught up with a read
            # of `round` made after that (the others may have re-formed without this node meanwhile)
            if not self._handler.catch_up():
                return
            self._lost_seen = view["renewals_lost"]
            view = self._handler.fence_view()
        if view["reachable"]:
            self._confirmed_until = view["last_renewed"] + view["lease_ttl_s"]
        outage = not view.get("etcd_up", True)  # rewritten at every call meanwhile: this agent is alive
        state = FenceState(run_id=view["run_id"], launch_id=view["launch_id"], round=view["round"],
                           confirmed_until_monotonic=self._confirmed_until, lease_ttl_s=view["lease_ttl_s"],
                           agent_pid=os.getpid(), etcd_unreachable=outage,
                           published_monotonic=self._clock() if outage else 0.0)
        if state != self._last:
            write_fence(self.path, state)
            self._last = state
