"""Rendezvous handlers meeting from threads, as the agents of several nodes would; the etcd requests a client makes."""

from __future__ import annotations

import sys
import threading
import time
import traceback


def together(handlers, timeout_s: float = 60.0) -> dict:
    """next_rendezvous() of every handler at once; node id -> RendezvousInfo. Fails on any error, or on a
    handler still in its rendezvous after timeout_s (the message says where each one stands: its view and the
    stack of its thread)."""
    out, errors = {}, []

    def go(h):
        try:
            out[h.settings.node_id] = h.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not errors, errors
    stuck = [(h, t) for h, t in zip(handlers, threads) if t.is_alive()]
    assert not stuck, f"a rendezvous still running after {timeout_s:g} s:\n" + "\n".join(_where(h, t) for h, t in stuck)
    return out


def _where(handler, thread: threading.Thread) -> str:
    """A stuck handler's view (what its rounds decide from) and its thread's stack."""
    view = handler._view
    with view.lock:
        state = (f"round={view.current_round()} smallest_alive={view.smallest_alive} alive={sorted(view.alive)} "
                 f"joins={ {r: sorted(j) for r, j in view.joins.items()} } finals={sorted(view.finals)} "
                 f"connected={view.connected} version={view.version} reloads={view.reloads}")
    frame = sys._current_frames().get(thread.ident)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
    return f"node {handler.settings.node_id}: {state}\n{stack}"


def ranks(handlers, timeout_s: float = 60.0) -> dict[str, tuple[int, int]]:
    """together(), as node id -> (rank, world size)."""
    return {n: (i.rank, i.world_size) for n, i in together(handlers, timeout_s).items()}


def count_requests(monkeypatch, client, names) -> list[str]:
    """The calls of `client`'s methods `names` from now on, by name, in order; a call made inside another of them (the
    method one of them is built on) is not counted again."""
    calls: list[str] = []
    depth = [0]
    for name in names:
        real = getattr(client, name)

        def wrapped(*a, _real=real, _name=name, **k):
            if not depth[0]:
                calls.append(_name)
            depth[0] += 1
            try:
                return _real(*a, **k)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(client, name, wrapped)
    return calls
