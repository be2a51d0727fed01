"""The interfaces the agent is built against, declared once: what a rendezvous handler can do beyond torch's
RendezvousHandler, what the agent reports as it goes (AgentObserver), what it asks every monitor tick
(RestartPolicy). A leaf module: implementations in rendezvous/, metrics/, goodput/ and agent/ import it,
it imports nothing from elastic_rt at run time."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Iterable

from elastic_rt.decisions import RestartReason

if TYPE_CHECKING:
    from elastic_rt.diagnostics.hang import HangVerdict
    from elastic_rt.rendezvous.decide import Membership
    from elastic_rt.rendezvous.rounds import RendezvousSettings


class MembershipHandler(ABC):
    """A rendezvous handler that follows its round's membership and etcd's reachability (the etcd-v3 handler).
    The agent uses these where a handler has them and falls back to torch's RendezvousHandler API where it
    does not (c10d, --standalone: no membership change but nodes waiting, etcd always "reachable")."""

    settings: RendezvousSettings  # node_id, lease_ttl_s, join_timeout_s, ... as validated
    membership: Membership | None  # the round this node is a member of (None before the first)

    @abstractmethod
    def membership_change(self) -> RestartReason | None:
        """Why the current group must re-form (PEER_LOST, ROUND_ADVANCED, SCALE_UP), or None; reads local
        state only, so the monitor tick may ask as often as it likes."""

    @abstractmethod
    def etcd_reachable(self) -> bool:
        """Membership decisions can be made now (etcd answers and this node's view of it is current)."""

    @abstractmethod
    def catch_up(self, timeout_s: float = 2.0) -> bool:
        """After an outage: let the view see what the other nodes did meanwhile. False if etcd did not answer."""

    @abstractmethod
    def add_etcd_listener(self, fn: Callable[[bool], None]) -> None:
        """fn(up) whenever etcd becomes unreachable (False) or reachable again (True)."""

    @abstractmethod
    def leave(self) -> None:
        """Give up this node's place now, so that the others re-form without waiting for its lease to expire."""

    def round_running(self) -> bool:
        """A round has formed and the run is not closed: a node joining now makes its members restart (a
        scale-up). Best effort (False when it cannot tell); it decides only whether a joining node waits first."""
        return False

    def closed_by_this_launch(self) -> bool:
        """The run was closed by a node of this very launch (the same job fingerprint and launch id)."""
        return False

    @abstractmethod
    def tidy(self) -> int:
        """After leave(), when the run is closed and this was its last agent: remove the run's keys (but the
        short-lived `closed` marker). Returns the keys removed."""

    @abstractmethod
    def close(self) -> None:
        """Release the handler's connections (after leave() and tidy())."""

    def fence_view(self) -> dict | None:
        """What checkpoint fencing needs (elastic_rt/checkpoint/fence.py: run, launch, round, the lease's last
        confirmed renewal); None: this handler offers no fencing, and workers commit under the writer lease alone."""
        return None


class AgentObserver:
    """What the agent reports as it goes (metrics, the goodput journal, logs); an observer decides nothing.
    Every event is a no-op here: an observer overrides those it records, and this class itself is the
    observer of an agent that records nothing."""

    def on_rendezvous_started(self) -> None:
        """The agent entered the rendezvous (no worker group until the round completes)."""

    def on_rendezvous(self, *, round: int, world_size: int, nodes: int, duration_s: float) -> None:
        """A round completed: `nodes` agents, `world_size` workers, `duration_s` after joining."""

    def on_restart(self, reason: RestartReason) -> None:
        """The worker group is being stopped and restarted for `reason`."""

    def on_recovered(self, duration_s: float) -> None:
        """Workers run again, `duration_s` after the failure was detected."""

    def on_workers_started(self, pids: dict[int, int]) -> None:
        """The local workers started: local rank -> pid."""

    def on_workers_finished(self, state: str) -> None:
        """The local workers ended in `state` (a torch WorkerState name, lower-cased)."""

    def on_tick(self) -> None:
        """The monitor loop ticked while the workers are healthy."""

    def on_etcd(self, up: bool) -> None:
        """The rendezvous reached etcd (True) or lost it (False)."""

    def on_failures(self, causes: dict[int, str]) -> None:
        """Classified worker failures (or the hung rank): global rank -> "cause=...: detail"."""

    def track_warm_workers(self, ready: Callable[[], int]) -> None:
        """`ready()` counts the pre-started workers ready to take a local rank."""

    def close(self) -> None:
        """The agent is done: settle and release what the observer holds."""


class RestartPolicy:
    """Asked by the agent every monitor tick while its workers are healthy. This class itself never asks for
    anything (the policy of an agent with no hang timeout and probes that only report)."""

    def on_workers_started(self, local_ranks: Iterable[int]) -> None:
        """A new worker group started with these local ranks."""

    def check(self) -> RestartReason | None:
        """None, or the reason to act; its `response` says how (HANG restarts the group, PROBE_FAILURE and
        STRAGGLER leave the job)."""
        return None

    def hang_verdict(self) -> HangVerdict | None:
        """The verdict behind the last HANG check() returned (None if this policy judges no hangs)."""
        return None

    def on_hang_restart(self) -> None:
        """The agent restarts the group for a hang."""
