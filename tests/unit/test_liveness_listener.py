"""The liveness listener has no thread of its own (liveness.py): a connection is open to the peer before anything
serves the listener (the kernel's backlog), serve() accepts and holds it, close() wakes a serve() in progress, and
the held connections then close as they would when the process exits. Real loopback sockets."""

from __future__ import annotations

import socket
import threading
import time

from elastic_rt.rendezvous.liveness import LivenessListener
from tests.support.net import refuses


def _served_until(listener: LivenessListener, predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the listener never got there"
        listener.serve(0.05)


def test_a_peer_connects_before_the_listener_is_served_and_is_held_once_it_is():
    listener = LivenessListener("127.0.0.1")
    try:
        peer = socket.create_connection(("127.0.0.1", listener.port), timeout=5)  # the kernel's backlog: open
        assert listener._held == 0  # noqa: SLF001 - not accepted yet
        _served_until(listener, lambda: listener._held == 1)  # noqa: SLF001
        peer.close()  # the peer hangs up: forgotten at the next serve
        _served_until(listener, lambda: listener._held == 0)  # noqa: SLF001
    finally:
        listener.close()


def test_serve_returns_after_its_timeout_and_false_once_closed():
    listener = LivenessListener("127.0.0.1")
    started = time.monotonic()
    assert listener.serve(0.05) is True
    assert time.monotonic() - started >= 0.04
    listener.close()
    assert listener.serve(10) is False  # at once: nothing left to serve


def test_close_wakes_a_serve_in_progress_and_the_held_connections_close_and_the_port_refuses():
    listener = LivenessListener("127.0.0.1")
    peer = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
    _served_until(listener, lambda: listener._held == 1)  # noqa: SLF001
    result: list[bool] = []
    host = threading.Thread(target=lambda: result.append(listener.serve(None)), daemon=True)
    host.start()
    listener.close()
    host.join(10)
    assert result == [False]  # woken by close(), not left waiting for a connection
    peer.settimeout(5)
    assert peer.recv(1) == b""  # the held connection closed, as when the agent's process exits
    peer.close()
    assert refuses("127.0.0.1", listener.port)  # the port is closed
