"""Rendezvous handlers meeting from threads, as the agents of several nodes would."""

from __future__ import annotations

import threading


def together(handlers, timeout_s: float = 60.0) -> dict:
    """next_rendezvous() of every handler at once; node id -> RendezvousInfo. Fails on any error, or on a
    handler still in its rendezvous after timeout_s."""
    out, errors = {}, []

    def go(h):
        try:
            out[h.settings.node_id] = h.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), f"a rendezvous still running after {timeout_s:g} s"
    return out


def ranks(handlers, timeout_s: float = 60.0) -> dict[str, tuple[int, int]]:
    """together(), as node id -> (rank, world size)."""
    return {n: (i.rank, i.world_size) for n, i in together(handlers, timeout_s).items()}
