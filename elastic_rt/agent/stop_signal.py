"""The agent's stop signals (SIGTERM, SIGINT, SIGHUP): raised as torch's SignalException where they land, and
remembered, so that code on the way that catches Exception (an observer's guard, a retry loop) cannot make
the agent forget it was told to stop."""

from __future__ import annotations

import signal

from torch.distributed.elastic.multiprocessing.api import SignalException

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_received: signal.Signals | None = None


def _exception(sig: signal.Signals) -> SignalException:
    return SignalException(f"received signal {int(sig)}", sigval=sig)


def _on_signal(signum: int, _frame) -> None:
    global _received
    _received = signal.Signals(signum)
    raise _exception(_received)


def install() -> None:
    """Stop signals raise SignalException in the main thread, also during rendezvous (before torch installs
    its own handlers), so that the agent stops its workers and leaves cleanly."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def received() -> signal.Signals | None:
    """The last stop signal this process received, or None."""
    return _received


def raise_if_received() -> None:
    """Raise the stop signal again if one arrived: the agent's loop calls this on every tick, so a
    SignalException swallowed on its way still ends the run."""
    if _received is not None:
        raise _exception(_received)


def forget() -> None:
    """Clear the record (tests, and an embedding that handled the stop itself)."""
    global _received
    _received = None
