"""Resume end to end: checkpoints + elastic sampler under real kills, resizes and preemption."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.chaos.harness import EXAMPLE, Node, launch_args
from tests.chaos.test_launch_e2e import _rank0, nodes  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def _standalone(ckpt: str, *job: str, extra: list[str] | None = None) -> list[str]:
    return ["--standalone", "--nproc-per-node", "2", "--metrics-port", "0", "--tee", "3",
            "--checkpoint-url", ckpt, *(extra or []), EXAMPLE, *job]


@pytest.mark.long  # tests/chaos/test_same_math_e2e.py resumes after SIGKILLs and compares every parameter
def test_worker_killed_after_checkpoint_resumes_bitwise_equal(tmp_path, nodes):  # noqa: F811
    job = ["--steps", "60", "--save-every", "20", "--dataset-size", "200", "--step-sleep", "0.2"]
    ref = Node(_standalone(f"file://{tmp_path}/ref", *job), name="reference")
    nodes.append(ref)
    assert ref.wait_exit(240) == 0, ref.output[-3000:]
    ref_digest = ref.matches(r"done steps=60 world_size=2 param_digest=(\w+)")[0].group(1)

    n = Node(_standalone(f"file://{tmp_path}/run", *job), name="run")
    nodes.append(n)
    n.wait_for(r"checkpoint saved step=20 ", 180)
    os.kill(n.worker_pids()[1], signal.SIGKILL)  # 20 steps x 0.2 s before the next save
    n.wait_for(r"start step=20 world_size=2 .*restart=1", 120)
    assert n.wait_exit(240) == 0, n.output[-3000:]
    assert n.matches(r"done steps=60 world_size=2 param_digest=(\w+)")[-1].group(1) == ref_digest


def test_sigterm_saves_in_grace_period_and_exits_cleanly(tmp_path, nodes):  # noqa: F811
    url = f"file://{tmp_path}/ck"
    job = ["--steps", "100000", "--save-every", "1000", "--step-sleep", "0.05"]
    n = Node(_standalone(url, *job, extra=["--grace-period", "20"]), name="preempted")
    nodes.append(n)
    n.wait_for(r"\]:step=5 ", 120)
    os.kill(n.proc.pid, signal.SIGTERM)
    assert n.wait_exit(60) == 128 + signal.SIGTERM
    stopped = int(n.matches(r"stopped steps=(\d+)")[0].group(1))
    assert n.matches(r"checkpoint saved step=%d " % stopped)
    resumed = Node(_standalone(url, "--steps", str(stopped + 3), "--save-every", "1000"), name="resumed")
    nodes.append(resumed)
    assert resumed.wait_exit(120) == 0, resumed.output[-3000:]
    assert resumed.matches(r"start step=%d " % stopped)


def _committed_indices(outputs: list[Node]) -> dict[int, tuple[int, list[int]]]:
    """step -> (epoch, indices) of the run that finally committed it: the last line per step."""
    lines = sorted((t, line) for n in outputs for t, line in n.lines)
    out: dict[int, tuple[int, list[int]]] = {}
    for _, line in lines:
        m = re.search(r"indices step=(\d+) epoch=(\d+) idx=([\d,]+)", line)
        if m:
            out[int(m.group(1))] = (int(m.group(2)), [int(i) for i in m.group(3).split(",")])
    return out


def test_node_killed_mid_epoch_every_sample_trained_once(etcd_endpoint, run_id, tmp_path, nodes):  # noqa: F811
    size, batch = 240, 4  # divisible by the global batch at 4 and at 2 workers: no padding
    job = ["--log-indices", "--dataset-size", str(size), "--batch-size", str(batch), "--save-every", "3",
           "--ckpt-url", f"file://{tmp_path}/ck"]
    a = Node(launch_args(etcd_endpoint, run_id, "a", nnodes="1:2", steps=40, job_args=job), name="a")
    b = Node(launch_args(etcd_endpoint, run_id, "b", nnodes="1:2", steps=40, job_args=job), name="b")
    nodes.extend([a, b])
    a.wait_for(r"round 0: rank \d of 2", 120)
    leader, survivor = _rank0(a, b)
    leader.wait_for(r"checkpoint saved step=6 ", 120)
    leader.wait_for(r"\]:step=8 ", 60)
    leader.kill_node()  # mid-epoch 0: 8 steps x 16 samples of 240
    survivor.wait_for(r"start step=(6|9) world_size=2", 120)
    assert survivor.wait_exit(240) == 0, survivor.output[-3000:]
    committed = _committed_indices([a, b])
    assert sorted(committed) == list(range(1, 41))
    epoch0 = [i for step, (epoch, idx) in committed.items() if epoch == 0 for i in idx]
    assert sorted(epoch0) == list(range(size)), "epoch 0 must train every sample exactly once"
    resumed_from = int(survivor.matches(r"start step=(\d+) world_size=2")[-1].group(1))
    assert any(len(committed[s][1]) == 16 for s in range(1, resumed_from + 1))  # 4 workers before
    assert all(len(committed[s][1]) == 8 for s in range(resumed_from + 1, 41))  # 2 after
