"""Goodput and stragglers end to end: real agents, real workers really killed, the journals they write
and `elastic-rt report` on them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.chaos.harness import EXAMPLE, ROOT, Node
from tests.chaos.test_launch_e2e import nodes  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

LOCAL_SGD = str(Path(__file__).parent / "scripts" / "goodput_local_sgd.py")
CATEGORIES = ("productive", "startup", "restart", "checkpoint", "restore", "lost", "other")


def _journal(log_dir: Path) -> list[dict]:
    (path,) = log_dir.glob("goodput-*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _report(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "elastic_rt.cli", "report", *args], capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT), env=env)


def test_worker_killed_twice_categories_sum_and_lost_steps_match(tmp_path, nodes):  # noqa: F811
    logs = tmp_path / "logs"
    n = Node(["--standalone", "--nproc-per-node", "2", "--metrics-port", "0", "--tee", "3", "--log-dir", str(logs),
              "--checkpoint-url", f"file://{tmp_path}/ck", EXAMPLE, "--steps", "30", "--save-every", "5",
              "--step-sleep", "0.1"], name="standalone")
    nodes.append(n)
    started = psutil.Process(n.proc.pid).create_time()
    redone = []
    resume_at, since = 0, 0.0
    for restart in (1, 2):
        n.wait_for(r"\]:step=%d " % (resume_at + 8), 240, after=since)  # 3 steps past a commit
        os.kill(n.worker_pid(1), signal.SIGKILL)
        m = n.wait_for(r"\]:start step=(\d+) .*restart=%d" % restart, 240)
        resume_at, since = int(m.group(1)), time.monotonic()
        lines = [line for _, line in n.lines]
        start_idx = max(i for i, line in enumerate(lines) if re.search(r"restart=%d" % restart, line))
        last = max(int(x) for x in re.findall(r"\]:step=(\d+) ", "\n".join(lines[:start_idx])))
        redone.append(last - resume_at)
    assert n.wait_exit(240) == 0, n.output[-3000:]

    events = _journal(logs)
    lost = [e for e in events if e["event"] == "lost"]
    assert [e["steps"] for e in lost] == redone, (redone, lost)
    assert all(e["seconds"] > 0 and e["committed_step"] is not None for e in lost)
    assert [e["reason"] for e in events if e["event"] == "restart"] == ["worker_failure", "worker_failure"]
    (exit_line,) = [e for e in events if e["event"] == "exit"]
    totals = exit_line["totals"]
    wall = exit_line["time"] - started  # the agent process's wall time, by the wall clock
    assert abs(sum(totals.values()) - wall) <= 0.01 * wall, (totals, wall)
    assert exit_line["uncommitted_s"] == 0
    for category in ("productive", "startup", "restart", "restore", "checkpoint", "lost"):
        assert totals[category] > 0, (category, totals)
    assert abs(totals["lost"] - sum(e["seconds"] for e in lost)) < 1e-3

    out = _report(str(logs))
    assert out.returncode == 0, out.stderr
    assert "Restarts: 2" in out.stdout and out.stdout.count("worker failure") >= 2, out.stdout


def _sgd_node(endpoint: str, run_id: str, node_id: str, log_dir: Path, step_sleep: float, *extra: str) -> Node:
    return Node([
        "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--node-id", node_id, "--local-addr", "127.0.0.1", "--metrics-port", "0", "--tee", "3",
        "--log-dir", str(log_dir), "--rdzv-conf", "last_call_timeout=3",
        "--straggler-window", "2", "--straggler-windows", "3", *extra,
        LOCAL_SGD, "--steps", "80", "--sync-every", "5",
    ], name=node_id, env={"GOODPUT_STEP_SLEEP": str(step_sleep)})  # one command line for the job's nodes


@pytest.mark.long  # for CI's time: test_lockstep_stragglers.py names, and lets leave, a slow rank
def test_slow_node_is_flagged_leaves_and_the_other_reforms(etcd_endpoint, run_id, tmp_path, nodes):  # noqa: F811
    fast = _sgd_node(etcd_endpoint, run_id, "fast", tmp_path / "fast", 0.1, "--straggler-action", "leave")
    slow = _sgd_node(etcd_endpoint, run_id, "slow", tmp_path / "slow", 0.3, "--straggler-action", "leave")
    nodes.extend([fast, slow])
    fast.wait_for(r"round \d+: rank \d of 2", 180)
    slow.wait_for(r"\[slow round \d+\] straggler: local rank 0 .*leaving the job", 240)
    assert slow.wait_exit(120) == 1, slow.output[-3000:]
    fast.wait_for(r"done steps=80 world_size=1", 240)
    assert fast.wait_exit(120) == 0, fast.output[-3000:]
    assert not fast.matches(r"straggler:"), fast.output[-3000:]

    slow_events = _journal(tmp_path / "slow")
    flagged = [e for e in slow_events if e["event"] == "straggler"]
    assert flagged and flagged[0]["local_rank"] == 0 and flagged[0]["ratio"] >= 1.5
    assert not [e for e in _journal(tmp_path / "fast") if e["event"] == "straggler"]

    png = tmp_path / "run.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []  # an optional extra
    out = _report(str(tmp_path), *plot)
    assert out.returncode == 0, out.stderr
    restarts = int(re.search(r"Restarts: (\d+)", out.stdout).group(1))
    assert restarts >= 1, out.stdout
    assert re.search(r"fast: (peer lost|worker failure|round advanced)", out.stdout), out.stdout
    assert re.search(r"node slow local rank 0: \d+\.\d+x the median", out.stdout), out.stdout
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
