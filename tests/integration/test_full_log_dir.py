"""A full --log-dir (a small tmpfs mounted by the test, filled to the last block): heartbeats are allocated up front
and degrade to none, stack dumps degrade to log lines, the agent keeps running and the job recovers from a worker
kill. Needs root (mount)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_rt.diagnostics.failure_diagnostics import FailureDiagnostics
from elastic_rt.worker_reports import heartbeat as hb
from elastic_rt.worker_env import ENV_HEARTBEAT_FILE
from tests.chaos.harness import ROOT, Node
from tests.support.tmpfs import mounted_tmpfs

PLAIN = str(ROOT / "tests" / "chaos" / "scripts" / "plain_ddp_steps.py")


@pytest.fixture
def full_dir(tmp_path):
    """A 256 KiB tmpfs with no free block left."""
    with mounted_tmpfs(tmp_path / "full", "256k") as mnt:
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        yield mnt


def test_a_worker_reporting_steps_into_a_full_dir_keeps_running(full_dir):
    path = str(full_dir / "heartbeat" / "worker-0")
    assert hb.prepare_heartbeat_file(path) == "No space left on device"
    assert not os.path.exists(path)  # no sparse file left to map
    script = "from elastic_rt.worker_reports.heartbeat import report_step\nfor s in range(100): report_step(s)\nprint('ok')"
    res = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, **{ENV_HEARTBEAT_FILE: path}),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", (res.returncode, res.stderr[-2000:])  # not SIGBUS
    assert "step heartbeats are off" in res.stderr


def test_hang_stacks_that_cannot_be_written_go_to_the_log(full_dir, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="elastic_rt")
    worker = subprocess.Popen(["sleep", "300"])
    try:
        diag = FailureDiagnostics(log_dir=str(full_dir), reports_dir=str(tmp_path))  # stack signal off
        diag.on_workers_started([(0, 0, worker.pid)], {})
        out = diag.on_hang("[n0]", None)  # raised OSError out of the agent's monitor loop before
        assert "(not written: No space left on device; in the log)" in out
        assert f"stacks of rank 0 ({full_dir}/stacks/" in caplog.text and f"pid {worker.pid}" in caplog.text
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.slow
def test_a_job_with_a_full_log_dir_recovers_from_a_worker_kill(full_dir, etcd_endpoint, run_id):
    node = Node(["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id,
                 "--node-id", "a", "--local-addr", "127.0.0.1", "--metrics-port", "0", "--log-dir", str(full_dir),
                 PLAIN, "--steps", "60", "--step-sleep", "0.05"], name="a")
    try:
        node.wait_for(r"step=5 ", 180)
        victim = node.worker_pids()[-1]
        os.kill(victim, signal.SIGKILL)
        assert node.wait_exit(240) == 0, node.output[-3000:]
        assert node.matches(r"restarting the worker group"), node.output[-3000:]
        assert node.matches(r"done steps=60 world_size=2"), node.output[-3000:]
        assert node.matches(r"heartbeat files of local rank\(s\) \[0, 1\] cannot be allocated"), node.output[-3000:]
        agent_tracebacks = [line for line in node.output.splitlines() if line.startswith("Traceback")]
        assert not agent_tracebacks, node.output[-3000:]  # the workers' own ([rankN]: ...) are the kill's
    finally:
        node.cleanup()


def test_prepare_allocates_a_zeroed_record(tmp_path: Path):
    path = str(tmp_path / "hb" / "w0")
    assert hb.prepare_heartbeat_file(path) is None
    assert os.path.getsize(path) == hb.RECORD_SIZE and os.stat(path).st_blocks > 0  # blocks, not a sparse file
    assert hb.read_heartbeat(path, clock=time.monotonic) is None  # allocated, never written
