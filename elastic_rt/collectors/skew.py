"""Clock skew of each node against the rank-0 agent, measured through the rendezvous store."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch.distributed as dist

from elastic_rt.collectors.clock import SkewEstimate, measure_skew

_PREFIX = "elastic-rt/skew"

log = logging.getLogger(__name__)


def serve_skew(store: dist.Store, peer_ranks: list[int], *, samples: int = 8,
               clock: Callable[[], float] = time.time) -> list[threading.Thread]:
    """Rank 0: answer each peer's `samples` pings with this node's wall clock (one thread per peer)."""

    def answer(peer: int) -> None:
        try:
            for k in range(samples):
                store.get(f"{_PREFIX}/{peer}/ping/{k}")
                store.set(f"{_PREFIX}/{peer}/pong/{k}", repr(clock()))
        except Exception as exc:  # noqa: BLE001 - a peer that went away stops its own measurement
            log.debug("clock skew: stopped answering rank %d (%s)", peer, exc)

    threads = [threading.Thread(target=answer, args=(p,), daemon=True, name=f"skew-{p}") for p in peer_ranks]
    for t in threads:
        t.start()
    return threads


def measure_skew_via_store(store: dist.Store, rank: int, *, samples: int = 8,
                           clock: Callable[[], float] = time.time) -> SkewEstimate:
    """A peer: offset of rank 0's clock minus ours, NTP-style from the fastest of `samples` round trips."""

    def read_remote(k: int) -> float:
        store.set(f"{_PREFIX}/{rank}/ping/{k}", "")
        return float(store.get(f"{_PREFIX}/{rank}/pong/{k}").decode())

    return measure_skew(read_remote, samples=samples, clock=clock)
