"""etcd outages never stop training: real etcd paused, killed, its leader lost; real nodes, real workers.

Each test counts forced restarts ("restarting the worker group: <reason>" in the agents' logs)
and checks the job finished with every step done; the example job's runs also check that every
sample of every epoch was trained exactly once.

The long variant (etcd killed, restarted from its data directory after 30 s) is skipped unless
ELASTIC_RT_LONG_TESTS=1:  ELASTIC_RT_LONG_TESTS=1 python -m pytest tests/chaos/test_etcd_outage.py -m long
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from etcd_testbed.server import EtcdCluster, find_etcd_binary, free_port
from tests.chaos.harness import EXAMPLE, ROOT, Node, launch_args
from tests.chaos.test_launch_e2e import _rank0, nodes  # noqa: F401 - fixture
from tests.chaos.test_resume_e2e import _committed_indices

pytestmark = pytest.mark.slow

PLAIN = str(ROOT / "tests" / "chaos" / "scripts" / "plain_ddp_steps.py")
# Every world size the tests use (2, 3, 4, 6 workers) takes a multiple of 6 or 12 samples a step, so
# the sampler never pads when it re-shards a remainder: each sample of an epoch is trained exactly once.
DATASET, BATCH = 360, 6


def node_args(endpoint: str, run_id: str, node_id: str, *, nnodes: str, steps: int, step_sleep: float,
              script: str = PLAIN, metrics_port: int = 0, local_addr: str = "127.0.0.1", nproc: int = 2,
              job_args: list[str] | None = None) -> list[str]:
    args = launch_args(endpoint, run_id, node_id, nnodes=nnodes, nproc=nproc, steps=steps, step_sleep=step_sleep,
                       job_args=job_args)
    args[args.index(EXAMPLE)] = script
    args[args.index("--metrics-port") + 1] = str(metrics_port)
    args[args.index("--local-addr") + 1] = local_addr
    return args


def accounting(tmp_path) -> list[str]:
    """Example-job arguments for exact sample accounting (checkpoints every 5 steps)."""
    return ["--log-indices", "--dataset-size", str(DATASET), "--batch-size", str(BATCH), "--save-every", "5",
            "--ckpt-url", f"file://{tmp_path}/ck"]


def example_pair(nodes: list[Node], endpoints: str, run_id: str, tmp_path, steps: int) -> tuple[Node, Node]:
    """Nodes a and b (2 workers each) running the example job with exact accounting."""
    pair = tuple(Node(node_args(endpoints, run_id, n, nnodes="2", steps=steps, step_sleep=0.05, script=EXAMPLE,
                                job_args=accounting(tmp_path)), name=n) for n in "ab")
    nodes.extend(pair)
    return pair


def assert_every_sample_once(all_nodes: list[Node], steps: int) -> None:
    committed = _committed_indices(all_nodes)
    missing = sorted(set(range(1, steps + 1)) - set(committed))
    assert not missing, f"steps {missing} never logged their indices:\n" + "\n".join(
        f"{n.name} {t:.2f} {line}" for n in all_nodes for t, line in n.lines
        if re.search(r"start step=|stopped steps=|done steps=|restarting|round \d+: rank", line))
    epochs: dict[int, list[int]] = {}
    for epoch, idx in committed.values():
        epochs.setdefault(epoch, []).extend(idx)
    for epoch, idx in sorted(epochs.items()):
        if len(idx) >= DATASET:  # a finished epoch: every sample exactly once
            assert sorted(idx) == list(range(DATASET)), f"epoch {epoch} lost or repeated samples"
        else:
            assert len(set(idx)) == len(idx), f"epoch {epoch} repeated samples"


def restarts(*all_nodes: Node) -> dict[str, list[str]]:
    return {n.name: [m.group(1) for m in n.matches(r"restarting the worker group: (.+)$")] for n in all_nodes}


def assert_no_restart(*all_nodes: Node) -> None:
    counted = restarts(*all_nodes)
    assert not any(counted.values()), f"{counted}\n" + "\n----\n".join(n.output[-5000:] for n in all_nodes)


def finish(all_nodes: list[Node], done: str, timeout_s: float = 300) -> None:
    for n in all_nodes:
        assert n.wait_exit(timeout_s) == 0, n.output[-4000:]
    assert any(n.matches(done) for n in all_nodes), "\n----\n".join(n.output[-2000:] for n in all_nodes)


def pause(cluster: EtcdCluster, members, seconds: float) -> float:
    """SIGSTOP the members, keep them stopped `seconds` (the fault's length), SIGCONT. Returns the resume time."""
    for m in members:
        os.kill(m.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        for m in members:
            os.kill(m.proc.pid, signal.SIGCONT)
    return time.monotonic()


def leader(cluster: EtcdCluster):
    """The member that is raft leader now (etcdctl endpoint status)."""
    ctl = os.path.join(os.path.dirname(find_etcd_binary()), "etcdctl")
    live = [m for m in cluster.members if cluster.is_running(m)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = subprocess.run([ctl, "--endpoints", ",".join(m.endpoint for m in live), "--command-timeout", "2s",
                              "endpoint", "status", "-w", "json"], capture_output=True, text=True, timeout=30)
        try:
            statuses = json.loads(out.stdout)
        except ValueError:
            statuses = []
        for st in statuses:
            if st["Status"]["leader"] == st["Status"]["header"]["member_id"]:
                return next(m for m in live if st["Endpoint"] == m.endpoint)
        time.sleep(0.2)
    raise TimeoutError(f"no etcd leader among {[m.name for m in live]}")


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("elastic_rt_etcd_")}


@pytest.fixture
def etcd1():
    with EtcdCluster(1) as c:
        yield c


@pytest.fixture
def etcd3():
    with EtcdCluster(3) as c:
        yield c


@pytest.mark.long  # the three-member variant below covers the same rule in CI
def test_single_etcd_paused_10s_plain_ddp_trains_through(etcd1, run_id, nodes):  # noqa: F811
    port = free_port()
    a = Node(node_args(etcd1.endpoints, run_id, "a", nnodes="2", steps=300, step_sleep=0.05, metrics_port=port),
             name="a")
    b = Node(node_args(etcd1.endpoints, run_id, "b", nnodes="2", steps=300, step_sleep=0.05), name="b")
    nodes.extend([a, b])
    lead, _ = _rank0(a, b)
    lead.wait_for(r"\]:step=5 ", 120)
    paused_at = time.monotonic()
    resumed_at = pause(etcd1, etcd1.members, 10.0)
    trained = [line for t, line in lead.lines if paused_at + 2 < t < resumed_at and "]:step=" in line]
    assert trained, "the workers must keep training while etcd is stopped"
    for n in (a, b):
        n.wait_for(r"etcd unreachable", 5, after=paused_at)
        n.wait_for(r"etcd reachable again after \d+\.\d s", 30, after=resumed_at)
    metrics = scrape(port)
    assert metrics["elastic_rt_etcd_up"] == 1.0
    assert metrics["elastic_rt_etcd_unreachable_seconds_total"] >= 5.0
    finish([a, b], r"\]:done steps=300 world_size=4")
    assert_no_restart(a, b)


def test_three_member_cluster_all_paused_10s_example_job_exact(etcd3, run_id, tmp_path, nodes):  # noqa: F811
    a, b = example_pair(nodes, etcd3.endpoints, run_id, tmp_path, 150)
    lead, _ = _rank0(a, b)
    lead.wait_for(r"\]:step=5 ", 120)
    resumed_at = pause(etcd3, etcd3.members, 10.0)
    for n in (a, b):
        n.wait_for(r"etcd reachable again", 30, after=resumed_at)
    finish([a, b], r"\]:done steps=150 world_size=4")
    assert_no_restart(a, b)
    assert_every_sample_once([a, b], 150)


@pytest.mark.long  # for CI's time: test_etcd_member_loss.py kills a member under a training job
def test_etcd_leader_killed_in_training_then_in_a_reformation(etcd3, run_id, tmp_path, nodes):  # noqa: F811
    a, b = example_pair(nodes, etcd3.endpoints, run_id, tmp_path, 150)
    lead, other = _rank0(a, b)
    lead.wait_for(r"\]:step=5 ", 120)
    first = leader(etcd3)
    etcd3.kill_member(first)  # during training: nobody needs etcd, nobody restarts
    killed_at = time.monotonic()
    lead.wait_for(r"\]:step=\d+ ", 60, after=killed_at + 3)
    assert_no_restart(a, b)
    etcd3.start_member(first)  # back with its data: the cluster has three members again
    etcd3.wait_healthy(60)
    lead.wait_for(r"\]:step=\d+ ", 60, after=time.monotonic())
    os.kill(other.worker_pids()[-1], signal.SIGKILL)  # a re-formation starts ...
    etcd3.kill_member(leader(etcd3))  # ... and loses the etcd leader
    for n in (a, b):
        n.wait_for(r"round 1: rank \d of 2", 120)
    finish([a, b], r"\]:done steps=150 world_size=4")
    counted = restarts(a, b)
    assert sorted(len(v) for v in counted.values()) == [1, 1], counted  # the worker kill, nothing else
    assert_every_sample_once([a, b], 150)


def test_a_job_that_finishes_while_etcd_is_gone_exits_0_with_no_traceback(etcd1, run_id, nodes):  # noqa: F811
    """The workers succeeded: that is the job's result. The exit barrier and the closing of the run need
    etcd; without it each is one warning line, never a traceback (torch's exit barrier logs one) and
    never a failed exit (set_closed's failure after its close_timeout of retries is logged, not raised)."""
    args = node_args(etcd1.endpoints, run_id, "a", nnodes="1", steps=100, step_sleep=0.05)
    args[args.index("--rdzv-conf") + 1] += ",close_timeout=5"
    a = Node(args, name="a")
    nodes.append(a)
    a.wait_for(r"\]:step=5 ", 120)
    etcd1.kill_member(etcd1.members[0])
    assert a.wait_exit(120) == 0, a.output[-4000:]
    out = a.output
    assert a.matches(r"\]:done steps=100 world_size=2"), out[-4000:]
    assert a.matches(r"etcd does not answer: not waiting for the other nodes to finish"), out[-4000:]
    assert a.matches(r"the job finished, but the run could not be marked closed in etcd"), out[-4000:]
    assert a.matches(r"\[a\] job finished$"), out[-4000:]
    assert "Traceback" not in out, out[-4000:]


@pytest.mark.long
def test_etcd_killed_and_restarted_from_its_data_after_30s(etcd1, run_id, tmp_path, nodes):  # noqa: F811
    a, b = example_pair(nodes, etcd1.endpoints, run_id, tmp_path, 600)
    lead, _ = _rank0(a, b)
    lead.wait_for(r"\]:step=5 ", 120)
    m = etcd1.members[0]
    etcd1.kill_member(m)
    time.sleep(30.0)  # the outage itself
    etcd1.start_member(m)
    etcd1.wait_healthy(60)
    for n in (a, b):
        n.wait_for(r"etcd reachable again after \d+\.\d s", 30)
    finish([a, b], r"\]:done steps=600 world_size=4", timeout_s=600)
    assert_no_restart(a, b)
    assert_every_sample_once([a, b], 600)
