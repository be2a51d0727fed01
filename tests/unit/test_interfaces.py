"""The agent's declared interfaces: one definition of the observer's events, fanned out without getattr;
policies and handlers are what they declare to be."""

from __future__ import annotations

import inspect

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from elastic_rt.agent.fanout import ObserverGroup, PolicyGroup
from elastic_rt.agent.policy import HealthPolicy
from elastic_rt.decisions import RestartReason
from elastic_rt.goodput.goodput_observer import GoodputObserver, StragglerPolicy
from elastic_rt.interfaces import AgentObserver, MembershipHandler, RestartPolicy
from elastic_rt.metrics.metrics_observer import MetricsObserver
from elastic_rt.rendezvous.handler import EtcdRendezvousHandler

EVENTS = [name for name, _ in inspect.getmembers(AgentObserver, inspect.isfunction) if not name.startswith("_")]


def _arguments(name: str) -> tuple[tuple, dict]:
    """Distinct arguments for each event, as its declaration names them."""
    args, kwargs = [], {}
    for p in list(inspect.signature(getattr(AgentObserver, name)).parameters.values())[1:]:
        value = f"{name}.{p.name}"
        if p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


class Recorder(AgentObserver):
    def __init__(self, calls: list, broken: str | None = None) -> None:
        self.calls, self.broken = calls, broken

    def __getattribute__(self, name):
        if name in EVENTS:
            def record(*args, **kwargs):
                if name == self.broken:
                    raise RuntimeError(f"bug in {name}")
                self.calls.append((id(self), name, args, kwargs))
            return record
        return super().__getattribute__(name)


def test_the_group_forwards_every_declared_event_to_each_observer_in_order():
    calls: list = []
    first, second = Recorder(calls), Recorder(calls)
    group = ObserverGroup(first, None, second)
    for name in EVENTS:
        args, kwargs = _arguments(name)
        getattr(group, name)(*args, **kwargs)
    expected = []
    for name in EVENTS:
        args, kwargs = _arguments(name)
        expected += [(id(first), name, args, kwargs), (id(second), name, args, kwargs)]
    assert calls == expected
    assert len(EVENTS) == 11  # nine events, track_warm_workers and close


def test_an_observer_that_raises_does_not_stop_the_others(caplog):
    calls: list = []
    group = ObserverGroup(Recorder(calls, broken="on_restart"), Recorder(calls))
    group.on_restart(RestartReason.PEER_LOST)
    assert [c[1:3] for c in calls] == [("on_restart", (RestartReason.PEER_LOST,))]
    assert "Recorder.on_restart failed" in caplog.text


@pytest.mark.parametrize("cls", [MetricsObserver, GoodputObserver, ObserverGroup])
def test_observers_implement_only_declared_events_with_their_declared_signatures(cls):
    assert issubclass(cls, AgentObserver)
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("on_") or name in EVENTS:
            assert name in EVENTS, f"{cls.__name__}.{name} is not declared on AgentObserver"
            declared = inspect.signature(getattr(AgentObserver, name)).parameters
            assert list(inspect.signature(fn).parameters) == list(declared), f"{cls.__name__}.{name}"


def test_policies_are_restart_policies_and_the_group_asks_each():
    assert all(issubclass(c, RestartPolicy) for c in (HealthPolicy, StragglerPolicy, PolicyGroup))
    assert RestartPolicy().check() is None and RestartPolicy().hang_verdict() is None

    class Hung(RestartPolicy):
        restarts = 0

        def check(self):
            return RestartReason.HANG

        def hang_verdict(self):
            return "verdict"

        def on_hang_restart(self):
            self.restarts += 1

    quiet, hung = RestartPolicy(), Hung()
    group = PolicyGroup(quiet, None, hung)
    assert group.check() is RestartReason.HANG and group.hang_verdict() == "verdict"
    group.on_hang_restart()
    assert hung.restarts == 1


def test_the_etcd_handler_declares_every_extra_and_torchs_handlers_none():
    assert issubclass(EtcdRendezvousHandler, MembershipHandler)
    assert not EtcdRendezvousHandler.__abstractmethods__
    assert not issubclass(DynamicRendezvousHandler, MembershipHandler)  # c10d, etcd-v3-torch: torch's API only
