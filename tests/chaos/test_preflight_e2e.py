"""The pre-flight node test end to end: two real nodes; node b (its agent and everything it starts) runs
under a CPU quota, as a container with too small a CPU limit would. With --preflight exclude the compute
test names b, b leaves before any worker starts (exit 4), and a meets again alone and trains. The
quota is set as b's agent is about to start its test (its imports at 10 % of a CPU would take minutes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.chaos.harness import Node
from tests.chaos.test_launch_e2e import nodes  # noqa: F401 - fixture
from elastic_rt.chaos import cpu_quota

pytestmark = pytest.mark.slow

PLAIN = str(Path(__file__).parent / "scripts" / "plain_ddp_steps.py")
QUOTA_CPUS = 0.1


def _args(endpoint: str, run_id: str, name: str, tmp_path: Path) -> list[str]:
    return [
        "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--node-id", name, "--local-addr", "127.0.0.1", "--metrics-port", "0", "--tee", "3",
        "--log-dir", str(tmp_path / name), "--warm-workers", "off", "--probe-bytes", "0",
        # the first round waits for both nodes (b starts slowly under its quota); re-formations need no wait
        "--rdzv-conf", "last_call_timeout=300",
        "--preflight", "exclude", "--preflight-timeout", "120",
        PLAIN, "--steps", "300", "--print-every", "50",
    ]


def test_preflight_excludes_the_node_under_a_cpu_quota(etcd_endpoint, run_id, tmp_path, nodes):  # noqa: F811
    skip = cpu_quota.available()
    if skip:
        pytest.skip(skip)
    with cpu_quota.CpuQuota(0) as quota:  # no limit while the agent imports and starts
        a = Node(_args(etcd_endpoint, run_id, "a", tmp_path), name="a")
        b_args = _args(etcd_endpoint, run_id, "b", tmp_path)
        b = Node(b_args, name="b", cmd=quota.wrap([sys.executable, "-m", "elastic_rt.cli", "launch", *b_args]))
        nodes.extend([a, b])
        b.wait_for(r"\[b\] auto hang timeout", 180)  # logged just before the compute test starts
        quota.set(QUOTA_CPUS)
        a.wait_for(r"\[a\] pre-flight compute test \(\d+\.\d s\): local rank 0 cpu: ", 180)
        b.wait_for(r"\[b\] pre-flight compute test", 300)
        m = b.wait_for(r"\[b\] pre-flight: this node is excluded \(compute: local rank 0 matmul .* (\d+\.\d+)x the job "
                       r"median .*\); leaving the job", 300)
        assert float(m.group(1)) >= 1.5
        assert b.wait_exit(120) == 4, b.output[-3000:]
    (journal,) = (tmp_path / "b").glob("goodput-*.jsonl")
    assert '"workers_started"' not in journal.read_text()  # it left before any worker started
    a.wait_for(r"pre-flight: 1 node\(s\) named .*; b: compute: ", 60)
    a.wait_for(r"pre-flight excluded b; meeting again once they left", 60)
    a.wait_for(r"round \d+: rank 0 of 1 nodes", 120)
    a.wait_for(r"done steps=300 world_size=1", 240)
    assert a.wait_exit(120) == 0, a.output[-3000:]
    assert len(a.matches(r"pre-flight compute test")) == 1  # the re-formation is not tested again
