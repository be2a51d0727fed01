"""The memory tier end to end: three `elastic-rt launch` nodes on one etcd, snapshots every 2 steps,
nothing on storage. A worker is SIGKILLed: the group resumes at the last snapshot from the nodes'
memory. Then the node hosting rank 0 (and with it the only copy of the manifests besides their replica)
is SIGKILLed: the two survivors resume at the last snapshot from the replica on a survivor. Every
sample of the epoch is trained exactly once."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.chaos.harness import Node, launch_args
from tests.chaos.test_launch_e2e import nodes  # noqa: F401 - fixture
from tests.chaos.test_resume_e2e import _committed_indices

pytestmark = pytest.mark.slow


def _first(nodes_: list[Node], pattern: str, timeout_s: float = 120) -> tuple[Node, re.Match]:
    """The node that printed `pattern` (rank 0's lines name the node hosting rank 0), and the match."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for n in nodes_:
            found = n.matches(pattern)
            if found:
                return n, found[-1]
        time.sleep(0.1)
    raise TimeoutError(f"no node printed {pattern!r}:\n" + "\n----\n".join(n.output[-1500:] for n in nodes_))


def test_worker_then_node_killed_resume_from_memory_and_replica_without_storage(etcd_endpoint, run_id, tmp_path,
                                                                        nodes):  # noqa: F811
    size, batch, every = 240, 4, 2  # 240 samples: whole batches at 3 and at 2 workers
    secret = tmp_path / "secret"
    secret.write_text("memory-tier-e2e-secret")
    ckpt = tmp_path / "ck"
    job = ["--log-indices", "--dataset-size", str(size), "--batch-size", str(batch), "--memory-every", str(every),
           "--save-every", "1000", "--ckpt-url", f"file://{ckpt}"]
    extra = ["--rdzv-conf", f"last_call_timeout=3,secret_file={secret}"]
    group = [Node(launch_args(etcd_endpoint, run_id, name, nnodes="2:3", nproc=1, steps=40, job_args=job,
                              extra=extra), name=name) for name in ("a", "b", "c")]
    nodes.extend(group)
    leader, _ = _first(group, r"\]:step=\d+")
    other = next(n for n in group if n is not leader)
    leader.wait_for(r"checkpoint saved step=4 world_size=3 .*tier=memory", 120)
    os.kill(other.worker_pid(0), signal.SIGKILL)  # a worker loss: every node's memory survives
    leader, restart = _first(group, r"start step=(\d+) world_size=3 .*restored_from=(\w+)")
    assert int(restart.group(1)) >= 4 and int(restart.group(1)) % every == 0 and restart.group(2) == "memory"
    leader.wait_for(r"checkpoint saved step=%d world_size=3 .*tier=memory" % (int(restart.group(1)) + 4), 120)
    leader.wait_for(r"\]:step=%d " % (int(restart.group(1)) + 5), 60)
    leader.kill_node()  # its agent, its replica server and its worker: rank 0's shard, .metadata and manifest
    snapshots = leader.matches(r"checkpoint saved step=(\d+) world_size=3 .*tier=memory")
    last_snapshot = max(int(m.group(1)) for m in snapshots)
    last_step = max(int(m.group(1)) for m in leader.matches(r"\]:step=(\d+) "))
    survivors = [n for n in group if n is not leader]
    for n in survivors:
        assert n.wait_exit(300) == 0, n.output[-3000:]
    start = [m for n in survivors for m in n.matches(r"start step=(\d+) world_size=2 .*restored_from=(\w+)")]
    assert start, "\n----\n".join(n.output[-3000:] for n in survivors)
    resumed, tier = int(start[-1].group(1)), start[-1].group(2)
    assert tier == "memory"
    assert resumed % every == 0 and last_snapshot <= resumed <= last_step, (last_snapshot, resumed, last_step)
    assert resumed > int(restart.group(1))
    assert not [p for p in os.listdir(ckpt) if p.startswith("step_")]  # nothing was ever on storage
    lost = [int(m.group(1)) for n in survivors for m in n.matches(r"progress lost: (\d+) step\(s\)")]
    assert lost and max(lost) <= every, lost  # the goodput ledger counts progress as kept at each snapshot
    committed = _committed_indices(group)
    assert sorted(committed) == list(range(1, 41))
    epoch0 = [i for step, (epoch, idx) in committed.items() if epoch == 0 for i in idx]
    assert sorted(epoch0) == list(range(size)), "epoch 0 must train every sample exactly once"
