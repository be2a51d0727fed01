"""A stop signal (SIGTERM, SIGINT, SIGHUP) is never lost on its way to the agent's loop: not inside an
observer, whose other errors the agent logs and survives, and not inside code that catches Exception."""

from __future__ import annotations

import os
import signal

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from elastic_rt.agent import stop_signal
from elastic_rt.agent.fanout import ObserverGroup
from elastic_rt.interfaces import AgentObserver


@pytest.fixture
def installed():
    saved = {sig: signal.getsignal(sig) for sig in stop_signal.STOP_SIGNALS}
    stop_signal.forget()
    stop_signal.install()
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        stop_signal.forget()


class SignalledDuringTick(AgentObserver):
    """An observer during whose on_tick the process is told to stop."""

    def __init__(self, sig: signal.Signals) -> None:
        self.sig = sig

    def on_tick(self) -> None:
        os.kill(os.getpid(), self.sig)


class Ticks(AgentObserver):
    def __init__(self) -> None:
        self.ticks = 0

    def on_tick(self) -> None:
        self.ticks += 1


@pytest.mark.parametrize("sig", stop_signal.STOP_SIGNALS)
def test_a_stop_signal_during_an_observer_reaches_the_agent(installed, sig):
    after = Ticks()
    group = ObserverGroup(SignalledDuringTick(sig), after)
    with pytest.raises(SignalException) as err:
        group.on_tick()
    assert err.value.sigval == sig
    assert after.ticks == 0


def test_a_stop_signal_swallowed_on_its_way_is_raised_again_at_the_next_tick(installed):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    except Exception:  # noqa: BLE001 - what a retry loop or a guard on the way does
        pass
    assert stop_signal.received() == signal.SIGTERM
    with pytest.raises(SignalException) as err:
        stop_signal.raise_if_received()
    assert err.value.sigval == signal.SIGTERM


def test_without_a_stop_signal_the_tick_goes_on(installed):
    stop_signal.raise_if_received()
    assert stop_signal.received() is None
