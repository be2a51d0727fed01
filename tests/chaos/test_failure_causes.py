"""Why did it fail: real workers of a plain DDP script (no elastic_rt import, no @record, no report_step)
raise, are SIGKILLed, run out of memory, segfault, are SIGSTOPped or deadlock; the agent names the cause."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

import pytest

from etcd_testbed.server import free_port
from tests.chaos.harness import Node
from tests.chaos.test_health_e2e import poll, scrape, value
from tests.chaos.test_launch_e2e import nodes  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parent / "scripts" / "plain_ddp_optimizer_only.py")
FAILED = r"worker failed: rank {rank} \(local {rank}, pid {pid}\) cause={cause}"


def start(nodes, tmp_path, *script_args: str, extra=(), port: int = 0) -> Node:  # noqa: F811
    args = ["--standalone", "--nproc-per-node", "2", "--metrics-port", str(port), "--tee", "3",
            "--log-dir", str(tmp_path / "logs"), "--max-restarts", "1", *extra, SCRIPT, *script_args]
    n = Node(args, name="a")
    nodes.append(n)
    return n


def finishes(node: Node, steps: int) -> None:
    assert node.wait_exit(240) == 0, node.output[-4000:]
    assert node.matches(rf"done steps={steps} world_size=2")


def test_exception_names_the_frame_without_record(nodes, tmp_path):  # noqa: F811
    port = free_port()
    n = start(nodes, tmp_path, "--steps", "60", "--fault", "raise", "--fault-rank", "1", port=port)
    m = n.wait_for(FAILED.format(rank=1, pid=r"\d+", cause="exception")
                   + r": ValueError: injected failure at step 3 at plain_ddp_optimizer_only\.py:\d+ in inject_failure$",
                   180)
    assert m
    # its peer either saw the closed connection first (a collective error, not the root cause), was still
    # waiting when the agent stopped it (not a failure of its own), or was never judged: with warm workers the
    # agent acts on the first failure at once and SIGKILLs the rest of the broken group. Never an exception.
    peer_error = n.matches(FAILED.format(rank=0, pid=r"\d+", cause="collective_error") + ": RuntimeError: .*Connection")
    assert not n.matches(FAILED.format(rank=0, pid=r"\d+", cause="exception")), n.output[-3000:]
    s = poll(lambda: (x := scrape(port)) and value(x, "elastic_rt_worker_failures_total", cause="exception") == 1
             and x, 60, "failure counted by cause")
    assert value(s, "elastic_rt_collective_errors_total", backend="gloo", kind="peer_closed") == len(peer_error)
    assert value(s, "elastic_rt_worker_failures_total", cause="killed") == 0
    finishes(n, 60)


def test_a_rank_that_raised_and_is_still_tearing_down_is_the_root_cause(nodes, tmp_path):  # noqa: F811
    # rank 1 raises, then lingers in an atexit handler: rank 0's all-reduce times out first (5 s); the
    # agent must still name rank 1's exception, not only rank 0's symptom
    n = start(nodes, tmp_path, "--steps", "30", "--fault", "raise-linger", "--fault-rank", "1")
    n.wait_for(FAILED.format(rank=1, pid=r"\d+", cause="exception")
               + r": ValueError: injected failure at step 3 at plain_ddp_optimizer_only\.py:\d+ in inject_failure$", 180)
    assert not n.matches(FAILED.format(rank=0, pid=r"\d+", cause="exception")), n.output[-3000:]
    finishes(n, 30)


@pytest.mark.long  # test_launch_e2e's worker kill and test_prometheus_e2e's crashes assert cause=killed
def test_sigkill_from_outside_is_killed(nodes, tmp_path):  # noqa: F811
    n = start(nodes, tmp_path, "--steps", "30")
    n.wait_for(r"step=3 ", 180)
    victim = n.worker_pid(1)
    os.kill(victim, signal.SIGKILL)
    n.wait_for(FAILED.format(rank=1, pid=victim, cause="killed") + ": SIGKILL from outside the agent", 60)
    finishes(n, 30)


def test_segfault_is_a_signal(nodes, tmp_path):  # noqa: F811
    n = start(nodes, tmp_path, "--steps", "30", "--fault", "segfault")
    n.wait_for(FAILED.format(rank=1, pid=r"\d+", cause="signal") + ": SIGSEGV$", 180)
    finishes(n, 30)


def _memory_cgroup(limit_bytes: int) -> tuple[str | None, str]:
    """A fresh memory cgroup limited to `limit_bytes` (v1 or v2), or (None, why not)."""
    name = f"elastic-rt-oom-{uuid.uuid4().hex[:8]}"
    if os.geteuid() != 0:
        return None, "not root: cannot create a memory cgroup"
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError as exc:
        return None, f"/proc/self/cgroup unreadable: {exc}"
    for line in lines:  # cgroup v1 memory hierarchy: a child of our own cgroup
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / name
            try:
                d.mkdir()
                (d / "memory.limit_in_bytes").write_text(str(limit_bytes))
                return str(d), ""
            except OSError as exc:
                return None, f"cgroup v1 memory at {d.parent} not writable: {exc}"
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):  # cgroup v2 at the mount's root
        try:
            if "memory" not in (root / "cgroup.subtree_control").read_text().split():
                (root / "cgroup.subtree_control").write_text("+memory")
            d = root / name
            d.mkdir()
            (d / "memory.max").write_text(str(limit_bytes))
            return str(d), ""
        except OSError as exc:
            reason = f"cgroup v2 memory controller at {root} not usable: {exc}"
            continue
    return None, locals().get("reason", "no memory cgroup hierarchy")


def test_memory_limit_is_an_oom_kill(nodes, tmp_path):  # noqa: F811
    cgroup, why = _memory_cgroup(256 << 20)
    if cgroup is None:
        pytest.skip(f"no real OOM kill possible here: {why} (RLIMIT_AS would give MemoryError, not an OOM kill)")
    try:
        n = start(nodes, tmp_path, "--steps", "30", "--fault", "oom", "--oom-cgroup", cgroup)
        m = n.wait_for(FAILED.format(rank=1, pid=r"(\d+)", cause="oom")
                       + r": SIGKILL by the kernel OOM killer \((kernel log|cgroup)[: ]", 180)
        assert m.group(2) == "kernel log" or not os.access("/dev/kmsg", os.R_OK)
        finishes(n, 30)
    finally:
        for n in nodes:
            n.cleanup()
        deadline = time.monotonic() + 30
        while os.path.isdir(cgroup):
            try:
                os.rmdir(cgroup)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


@pytest.mark.long  # for CI's time: test_hang_plain_script.py SIGSTOPs a worker
def test_sigstopped_worker_hang_names_it_and_writes_every_ranks_stacks(nodes, tmp_path):  # noqa: F811
    port = free_port()
    n = start(nodes, tmp_path, "--steps", "150", "--step-sleep", "0.1", extra=["--hang-timeout", "5"], port=port)
    n.wait_for(r"step=5 ", 180)
    victim = n.worker_pid(1)
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    m = n.wait_for(r"workers hung: rank 1 \(local 1, pid %d, state stopped\) stopped progressing first "
                   r"\(last step \d+\); .*hang timeout 5 s.*cause=hang; stacks of every local rank in (\S+)"
                   % victim, 90, after=stopped_at)
    detected_s = time.monotonic() - stopped_at
    assert detected_s >= 5.0  # never before the timeout
    n.wait_for(r"restarting the worker group: hang", 30, after=stopped_at)
    n.wait_for(r"\]:start world_size=2", 120, after=stopped_at)
    restarted_s = time.monotonic() - stopped_at
    stacks = Path(m.group(1))
    files = sorted(p.name for p in stacks.iterdir() if p.name.startswith("rank"))
    assert len(files) == 2 and files[1] == f"rank1-local1-pid{victim}.txt", files
    stopped = (stacks / files[1]).read_text()
    assert "process state: stopped" in stopped and "cannot run a signal handler" in stopped
    waiting = (stacks / files[0]).read_text()
    assert re.search(r'File ".*plain_ddp_optimizer_only.py", line \d+ in main', waiting), waiting
    s = poll(lambda: (x := scrape(port)) and value(x, "elastic_rt_hangs_total", local_rank="1",
                                                   process_state="stopped") == 1 and x, 60, "hang counted")
    assert value(s, "elastic_rt_worker_failures_total", cause="hang") == 1
    print(f"SIGSTOP -> hang line {detected_s:.1f} s, -> restarted workers running {restarted_s:.1f} s")
    finishes(n, 150)


def test_deadlocked_collective_with_flight_recorder(nodes, tmp_path):  # noqa: F811
    n = start(nodes, tmp_path, "--steps", "40", "--fault", "deadlock",
              extra=["--hang-timeout", "5", "--flight-recorder", "on"])
    m = n.wait_for(r"workers hung: .*stacks of every local rank in (\S+); flight recorder: (.*)$", 240)
    summary = m.group(2)
    assert re.search(r"pg 0 #\d+ gloo:all_?reduce.*joined by ranks \[0\], not joined by ranks \[1\]", summary), summary
    stacks = Path(m.group(1))
    rank1 = next(p for p in stacks.iterdir() if p.name.startswith("rank1-")).read_text()
    assert "in inject_failure" in rank1 and "process state: sleeping" in rank1
    assert sorted(p.name for p in stacks.iterdir() if p.suffix == ".json") == [
        "flight_recorder-rank0.json", "flight_recorder-rank1.json"]
    finishes(n, 40)
