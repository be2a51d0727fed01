"""Hangs in any script: a plain DDP script that never calls report_step, so optimizer steps
alone are the progress signal; a worker SIGSTOPped on one of two nodes, or in uninterruptible sleep."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from tests.chaos.harness import Node
from tests.chaos.test_failure_causes import SCRIPT
from tests.chaos.test_launch_e2e import _rank0, nodes  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def test_sigstopped_worker_of_a_plain_script_restarts_both_nodes(etcd_endpoint, run_id, nodes, tmp_path):  # noqa: F811
    started = []
    for name in "ab":
        args = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id,
                "--node-id", name, "--local-addr", "127.0.0.1", "--metrics-port", "0", "--tee", "3",
                "--rdzv-conf", "last_call_timeout=3", "--log-dir", str(tmp_path / name), "--hang-timeout", "5",
                # the first attempt's 20 s of steps leave the SIGSTOP after step 5 time to land; the restarted
                # group only has to finish
                SCRIPT, "--steps", "200", "--step-sleep", "0.1", "--restart-step-sleep", "0"]
        started.append(Node(args, name=name))
    nodes.extend(started)
    leader, other = _rank0(*started)
    leader.wait_for(r"step=5 ", 120)
    victim = other.worker_pid(1)
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


def _freezer_cgroup() -> tuple[Path | None, str]:
    """A cgroup v1 freezer: its frozen tasks sit in uninterruptible sleep (D, __refrigerator), as on a dead
    NFS server, and even SIGKILL waits until they are thawed."""
    root = Path("/sys/fs/cgroup/freezer")
    if os.geteuid() != 0 or not (root / "cgroup.procs").exists():
        return None, "no writable cgroup v1 freezer (root and a v1 freezer hierarchy needed)"
    d = root / f"elastic-rt-hang-{uuid.uuid4().hex[:8]}"
    try:
        d.mkdir()
    except OSError as exc:
        return None, f"cannot create a freezer cgroup: {exc}"
    return d, ""


@pytest.mark.long  # a SIGSTOPped worker (CI) is the same detection path; this one needs a cgroup v1 freezer
def test_worker_in_uninterruptible_sleep_is_a_hang(nodes, tmp_path):  # noqa: F811
    freezer, why = _freezer_cgroup()
    if freezer is None:
        pytest.skip(why)
    try:
        args = ["--standalone", "--nproc-per-node", "2", "--metrics-port", "0", "--tee", "3",
                "--log-dir", str(tmp_path / "logs"), "--hang-timeout", "5", SCRIPT, "--steps", "100",
                "--step-sleep", "0.1"]
        n = Node(args, name="a")
        nodes.append(n)
        n.wait_for(r"step=5 ", 180)
        victim = n.worker_pid(1)
        (freezer / "cgroup.procs").write_text(str(victim))
        (freezer / "freezer.state").write_text("FROZEN")
        frozen_at = time.monotonic()
        m = n.wait_for(r"workers hung: rank 1 \(local 1, pid %d, state disk-sleep\) stopped progressing first.*"
                       r"stacks of every local rank in (\S+)" % victim, 90, after=frozen_at)
        stacks = Path(m.group(1)) / f"rank1-local1-pid{victim}.txt"
        assert "process state: disk-sleep" in stacks.read_text()
        n.wait_for(r"restarting the worker group: hang", 30, after=frozen_at)
        # SIGKILL cannot take it while frozen: the agent says so and starts the new workers anyway
        n.wait_for(r"process %d did not die after SIGKILL \(uninterruptible sleep\?\)" % victim, 60)
        n.wait_for(r"\]:start world_size=2", 120, after=frozen_at)
    finally:
        (freezer / "freezer.state").write_text("THAWED")  # the pending SIGKILL then ends it
        deadline = time.monotonic() + 30
        while True:
            try:
                freezer.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    assert n.wait_exit(240) == 0, n.output[-3000:]
    assert n.matches(r"done steps=100 world_size=2")
