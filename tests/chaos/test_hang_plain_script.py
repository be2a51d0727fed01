"""Hangs in any script (issue 9.4): two nodes run a plain DDP script that never calls report_step; one
worker is SIGSTOPped; optimizer steps alone are the progress signal and --hang-timeout restarts the job."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.chaos.harness import Node
from tests.chaos.test_failure_causes import SCRIPT, worker_pid
from tests.chaos.test_launch_e2e import _rank0, nodes  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def test_sigstopped_worker_of_a_plain_script_restarts_both_nodes(etcd_endpoint, run_id, nodes, tmp_path):  # noqa: F811
    started = []
    for name in "ab":
        args = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id,
                "--node-id", name, "--local-addr", "127.0.0.1", "--metrics-port", "0", "--tee", "3",
                "--rdzv-conf", "last_call_timeout=3", "--log-dir", str(tmp_path / name), "--hang-timeout", "5",
                SCRIPT, "--steps", "200", "--step-sleep", "0.1"]
        started.append(Node(args, name=name))
    nodes.extend(started)
    leader, other = _rank0(*started)
    leader.wait_for(r"step=5 ", 120)
    victim = worker_pid(other, 1)
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    # the node of the stopped worker names it; the other node's workers wait in the all-reduce
    other.wait_for(r"workers hung: rank \d+ \(local 1, pid %d, state stopped\) stopped progressing first" % victim,
                   90, after=stopped_at)
    other.wait_for(r"restarting the worker group: hang", 30, after=stopped_at)
    # the leader's workers merely wait in the all-reduce: it follows the other node's new round (not
    # counted against its restarts) unless that round is slower to come than lease TTL + 1 s
    m = leader.wait_for(r"restarting the worker group: (hang|round advanced)", 90, after=stopped_at)
    print(f"node with the stopped worker: hang; the other node: {m.group(1)}")
    assert all(n.wait_exit(240) == 0 for n in started), leader.output[-3000:] + "\n----\n" + other.output[-3000:]
    done = leader.matches(r"done steps=(\d+) world_size=(\d+)") + other.matches(r"done steps=(\d+) world_size=(\d+)")
    assert [(m.group(1), m.group(2)) for m in done][-1:] == [("200", "4")]
