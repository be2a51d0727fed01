"""End to end: real etcd, real `elastic-rt launch` nodes, real workers, really killed."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from tests.chaos.harness import EXAMPLE, Node, launch_args

pytestmark = pytest.mark.slow


@pytest.fixture
def nodes():
    started: list[Node] = []
    yield started
    for n in started:
        n.cleanup()
    # pytest shows a test's captured output only when it failed: then every node's whole log is there, not
    # only the tail of the one a wait gave up on
    for n in started:
        print(f"\n===== node {n.name} (exit {n.proc.poll()}) =====\n{n.output}")


def _start(nodes, endpoint, run_id, node_id, **kw) -> Node:
    n = Node(launch_args(endpoint, run_id, node_id, **kw), name=node_id)
    nodes.append(n)
    return n


def _rank0(a: Node, b: Node, timeout_s: float = 120) -> tuple[Node, Node]:
    """(node whose worker is global rank 0 — it prints the step lines, the other node)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for x, y in ((a, b), (b, a)):
            if x.matches(r"\]:step=\d+"):
                return x, y
        time.sleep(0.1)
    raise TimeoutError("no node printed a step:\n" + a.output[-2000:] + "\n----\n" + b.output[-2000:])


def test_worker_killed_group_restarts_and_finishes(etcd_endpoint, etcd_client, run_id, nodes):
    a = _start(nodes, etcd_endpoint, run_id, "a", nnodes="2", steps=30)
    b = _start(nodes, etcd_endpoint, run_id, "b", nnodes="2", steps=30)
    leader, other = _rank0(a, b)
    leader.wait_for(r"step=3 ", 120)
    victim = other.worker_pids()[-1]
    os.kill(victim, signal.SIGKILL)
    assert a.wait_exit(240) == 0, a.output[-3000:]
    assert b.wait_exit(60) == 0, b.output[-3000:]
    # both nodes re-formed (one for its own worker, the other for the round or its broken peers)
    assert all(n.matches(r"restarting the worker group") for n in (a, b))
    # rank 0 (which logs) may sit on either node after the new round
    assert sum(len(n.matches(r"\]:start step=\d+ world_size=4")) for n in (a, b)) == 2
    done = a.matches(r"done steps=(\d+) world_size=(\d+)") + b.matches(r"done steps=(\d+) world_size=(\d+)")
    assert [(m.group(1), m.group(2)) for m in done][-1:] == [("30", "4")]
    assert other.matches(r"worker failed: rank \d+ \(local \d+, pid %d\) cause=killed: SIGKILL" % victim)
    # the last agent to leave removed the run's keys: only the closed marker is left, on a lease of its own
    left, _ = etcd_client.list_prefix(f"/elastic-rt/{run_id}/", keys_only=True)
    assert [kv.key for kv in left] == [f"/elastic-rt/{run_id}/closed"] and left[0].lease != 0, left


def test_node_with_rank0_killed_survivor_finishes_alone(etcd_endpoint, run_id, nodes):
    a = _start(nodes, etcd_endpoint, run_id, "a", nnodes="1:2", steps=60)
    b = _start(nodes, etcd_endpoint, run_id, "b", nnodes="1:2", steps=60)
    a.wait_for(r"round 0: rank \d of 2", 120)
    leader, survivor = _rank0(a, b)
    leader.wait_for(r"step=3 ", 120)
    killed_at = time.monotonic()
    leader.kill_node()
    survivor.wait_for(r"step=\d+ loss=\S+ world_size=2$", 120, after=killed_at)
    assert survivor.wait_exit(240) == 0, survivor.output[-3000:]
    assert survivor.matches(r"done steps=60 world_size=2")
    assert survivor.matches(r"restarting the worker group: (peer lost|worker failure|round advanced)")


@pytest.mark.long  # for CI's time: test_same_math_e2e.py grows a job 2 -> 3 -> 4 workers
def test_third_node_scales_job_up(etcd_endpoint, run_id, nodes):
    # long enough that the third node (an agent start with torch imports, slow on a loaded machine) joins
    # while the first group still trains: a group that already finished has nothing to scale up
    a = _start(nodes, etcd_endpoint, run_id, "a", nnodes="2:3", steps=250)
    b = _start(nodes, etcd_endpoint, run_id, "b", nnodes="2:3", steps=250)
    leader, _ = _rank0(a, b)
    leader.wait_for(r"step=3 .*world_size=4", 120)
    c = _start(nodes, etcd_endpoint, run_id, "c", nnodes="2:3", steps=250)
    for n in (a, b, c):
        assert n.wait_exit(300) == 0, n.output[-3000:]
    done = [m for n in (a, b, c) for m in n.matches(r"done steps=(\d+) world_size=(\d+)")]
    assert [(m.group(1), m.group(2)) for m in done] == [("250", "6")]
    assert any(n.matches(r"restarting the worker group: scale up") for n in (a, b))


def test_torchrun_with_etcd_v3_backend(etcd_endpoint, run_id, nodes):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id,
           "--rdzv-conf", "node_id=torchrun-node", EXAMPLE, "--steps", "5"]
    n = Node([], name="torchrun", cmd=cmd)
    nodes.append(n)
    assert n.wait_exit(300) == 0, n.output[-3000:]
    assert n.matches(r"done steps=5 world_size=2")


def test_agent_sigkilled_alone_takes_its_workers(etcd_endpoint, run_id, nodes):
    a = _start(nodes, etcd_endpoint, run_id, "a", nnodes="1", steps=10000)
    a.wait_for(r"step=2 ", 120)
    workers = [psutil.Process(p) for p in a.worker_pids()]
    assert len(workers) == 2
    os.kill(a.proc.pid, signal.SIGKILL)  # the agent only, not its session
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive, f"orphaned workers still running: {[p.pid for p in alive]}"
