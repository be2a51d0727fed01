"""Several observers or restart policies where the agent takes one: events go to each in turn."""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from torch.distributed.elastic.multiprocessing.api import SignalException

from elastic_rt.diagnostics.hang import HangVerdict
from elastic_rt.decisions import RestartReason
from elastic_rt.interfaces import AgentObserver, RestartPolicy

log = logging.getLogger(__name__)


class ObserverGroup(AgentObserver):
    """An AgentObserver that forwards every event to each observer, in order.

    An observer that raises is logged and skipped: recording must never stop the agent.
    """

    def __init__(self, *observers: AgentObserver | None) -> None:
        self.observers = tuple(o for o in observers if o is not None)

    def _each(self, event: str, call: Callable[[AgentObserver], None]) -> None:
        for observer in self.observers:
            try:
                call(observer)
            except SignalException:
                raise  # the agent was told to stop while an observer ran: not the observer's bug
            except Exception:  # noqa: BLE001 - an observer's bug must not take the agent down
                log.exception("observer %s.%s failed", type(observer).__name__, event)

    def on_rendezvous_started(self) -> None:
        self._each("on_rendezvous_started", lambda o: o.on_rendezvous_started())

    def on_rendezvous(self, *, round: int, world_size: int, nodes: int, duration_s: float) -> None:
        self._each("on_rendezvous", lambda o: o.on_rendezvous(round=round, world_size=world_size, nodes=nodes,
                                                              duration_s=duration_s))

    def on_restart(self, reason: RestartReason) -> None:
        self._each("on_restart", lambda o: o.on_restart(reason))

    def on_recovered(self, duration_s: float) -> None:
        self._each("on_recovered", lambda o: o.on_recovered(duration_s))

    def on_workers_started(self, pids: dict[int, int]) -> None:
        self._each("on_workers_started", lambda o: o.on_workers_started(pids))

    def on_workers_finished(self, state: str) -> None:
        self._each("on_workers_finished", lambda o: o.on_workers_finished(state))

    def on_tick(self) -> None:
        self._each("on_tick", lambda o: o.on_tick())

    def on_etcd(self, up: bool) -> None:
        self._each("on_etcd", lambda o: o.on_etcd(up))

    def on_failures(self, causes: dict[int, str]) -> None:
        self._each("on_failures", lambda o: o.on_failures(causes))

    def track_warm_workers(self, ready: Callable[[], int]) -> None:
        self._each("track_warm_workers", lambda o: o.track_warm_workers(ready))

    def close(self) -> None:
        self._each("close", lambda o: o.close())


class PolicyGroup(RestartPolicy):
    """A RestartPolicy made of several: the first reason any of them gives wins."""

    def __init__(self, *policies: RestartPolicy | None) -> None:
        self.policies = tuple(p for p in policies if p is not None)

    def on_workers_started(self, local_ranks: Iterable[int]) -> None:
        ranks = tuple(local_ranks)
        for policy in self.policies:
            policy.on_workers_started(ranks)

    def check(self) -> RestartReason | None:
        for policy in self.policies:
            reason = policy.check()
            if reason:
                return reason
        return None

    def hang_verdict(self) -> HangVerdict | None:
        return next((v for p in self.policies if (v := p.hang_verdict()) is not None), None)

    def on_hang_restart(self) -> None:
        for policy in self.policies:
            policy.on_hang_restart()
