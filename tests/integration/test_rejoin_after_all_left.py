"""A job whose every agent stopped (a preempted and requeued Slurm job, all pods of a Job restarted) starts
again under the same run id: the new agents open the next round themselves, since no member of the
running one is left to do it. Real etcd."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from tests.support.rendezvous import ranks


def _handler(endpoint, run_id, node):
    return create_etcd_v3_handler(RendezvousParameters(
        "etcd-v3", endpoint, run_id, 1, 2, local_addr="127.0.0.1", node_id=node, last_call_timeout=1,
        lease_ttl=2, join_timeout=40))


def _rendezvous(handlers) -> dict[str, tuple[int, int]]:
    return ranks(handlers)


def _first_run(endpoint, run_id, names, ready) -> None:
    """The job's first run, in a process of its own: its agents meet, then it waits to be killed."""
    import time

    handlers = [_handler(endpoint, run_id, n) for n in names]
    _rendezvous(handlers)
    ready.set()
    time.sleep(600)


@pytest.mark.parametrize("how,new_ids", [("left", True), ("killed", False)],
                         ids=["all-left-new-node-ids", "all-killed-same-node-ids"])
def test_new_agents_form_the_next_round_when_every_member_is_gone(etcd_endpoint, run_id, how, new_ids):
    names = ("n1-r0", "n2-r0")
    if how == "left":  # SIGTERM: every agent leaves (its lease is revoked)
        first = [_handler(etcd_endpoint, run_id, n) for n in names]
        assert sorted(_rendezvous(first).values()) == [(0, 2), (1, 2)]
        for h in first:
            h.leave()
            h.close()
    else:  # SIGKILL: the leases run out after lease_ttl
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        proc = ctx.Process(target=_first_run, args=(etcd_endpoint, run_id, names, ready))
        proc.start()
        try:
            assert ready.wait(120), "the first run did not meet"
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
    # a requeued job's new agents; hostnames as node ids come back the same
    second = [_handler(etcd_endpoint, run_id, n) for n in (("n1-r1", "n2-r1") if new_ids else names)]
    try:
        assert sorted(_rendezvous(second).values()) == [(0, 2), (1, 2)]
        assert second[0].membership.round >= 1
    finally:
        for h in second:
            h.leave()
            h.close()
