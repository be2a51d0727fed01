"""Bad input gets one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from etcd_testbed.server import free_port
from tests.chaos.harness import EXAMPLE, ROOT


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_rt.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.mark.parametrize("argv,words", [
    (["--nnodes", "3:2"], "MIN (3) is larger than MAX (2)"),
    (["--nnodes", "0"], "at least 1"),
    (["--rdzv-backend", "nosuch", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "x"], "unknown"),
    (["--max-restarts", "many"], "invalid int value"),
])
def test_bad_flags(argv, words):
    proc = run_cli("launch", *argv, EXAMPLE)
    assert proc.returncode == 2
    assert words in _one_error_line(proc)


def test_etcd_unreachable_names_endpoint_and_exits_within_join_timeout():
    port = free_port()
    t0 = time.monotonic()
    proc = run_cli("launch", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "x",
                   "--metrics-port", "0", "--rdzv-conf", "join_timeout=4", EXAMPLE)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    line = _one_error_line(proc)
    assert f"127.0.0.1:{port}" in line and "--rdzv-endpoint" in line
    assert elapsed < 4 + 20  # the join timeout plus interpreter start-up, not minutes


def test_garbage_in_round_key_is_a_clear_error_not_a_crash_loop(etcd_client, etcd_endpoint, run_id):
    etcd_client.put(f"/elastic-rt/{run_id}/round", b"\x00\xffgarbage")
    proc = run_cli("launch", "--nnodes", "1:2", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id,
                   "--metrics-port", "0", "--rdzv-conf", "join_timeout=20", EXAMPLE, "--steps", "2")
    assert proc.returncode == 1
    line = _one_error_line(proc)
    assert f"/elastic-rt/{run_id}/round" in line and "etcdctl del" in line
    kv, _ = etcd_client.get(f"/elastic-rt/{run_id}/round")
    assert kv.value == b"\x00\xffgarbage"  # reported, not overwritten


def test_missing_script():
    proc = run_cli("launch", "--standalone", "does_not_exist.py")
    assert proc.returncode == 2
    assert "not found" in _one_error_line(proc)


def test_agent_refuses_to_join_with_an_rdma_port_down(etcd_endpoint, run_id):
    fixture = ROOT / "tests" / "fixtures" / "sysfs"  # mlx5_1 port 1 is DOWN
    proc = run_cli("launch", "--nnodes", "1", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id,
                   "--metrics-port", "0", "--sysfs-root", str(fixture), EXAMPLE, "--steps", "2")
    assert proc.returncode == 1
    line = _one_error_line(proc)
    assert "mlx5_1" in line and "not joining" in line


def test_late_node_of_a_finished_job_exits_5_with_one_line(etcd_endpoint, run_id):
    # Without a launch_id a late node cannot be told from a new launch of the same command: it trains
    # nothing and exits with the documented "run already finished" code (5; Slurm and systemd do not
    # restart on it), one line, no traceback (tests/integration/test_closed_run_exit.py has the launch_id cases).
    args = ["launch", "--nnodes", "1", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id,
            "--metrics-port", "0", EXAMPLE, "--steps", "2"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    late = run_cli(*args)
    assert late.returncode == 5, late.stderr[-2000:]
    assert "is closed (the job finished)" in late.stderr and "it did not train" in late.stderr
    assert "Traceback" not in late.stderr


def test_ckpt_cli_through_the_console_entry(tmp_path):
    proc = run_cli("ckpt", "verify", f"file://{tmp_path}")
    assert proc.returncode == 1
    assert "no checkpoints" in proc.stderr and "Traceback" not in proc.stderr
