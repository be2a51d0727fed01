"""`elastic-rt doctor` against a real etcd, and the CLI's exit codes run as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etcd_testbed.server import free_port
from elastic_rt.doctor.command import DoctorOptions, DoctorSources, etcd_config, first_failure, hard_checks, run_doctor
from elastic_rt.checks.model import Status
from elastic_rt.doctor.checks import GpuInfo, known_etcd_bug
from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "sysfs"


def doctor_cli(*argv: str, timeout_s: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    # A CPU-only environment with no NCCL variables, so the rows do not depend on the caller's shell.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_NCCL_", "GLOO_"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_rt.cli", "doctor", *argv],
        capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env,
    )  # fmt: skip
    return proc, time.monotonic() - start


def quiet_sysfs(tmp_path: Path) -> Path:
    """A sysfs root with one interface and no RDMA: only etcd can fail."""
    (tmp_path / "sys" / "class" / "net" / "lo").mkdir(parents=True)
    return tmp_path / "sys"


def row(stdout: str, name: str) -> list[str]:
    for line in stdout.splitlines():
        if line.startswith(name + "  "):
            return line[len(name):].split(None, 1)
    raise AssertionError(f"no row {name!r} in:\n{stdout}")


def unreachable() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


def _expected(version: str) -> Status:
    """The etcd row of a healthy server: a warning for a version with a known crash (3.5.0-3.5.4), else ok."""
    return Status.WARN if known_etcd_bug(version) else Status.OK


def test_etcd_row_measures_a_real_server(etcd_endpoint):
    # The warning threshold is raised so that a loaded CI machine cannot turn ok into warn.
    options = DoctorOptions(
        etcd=etcd_config(etcd_endpoint, {}, timeout_s=3.0), sysfs_root="/nonexistent", etcd_warn_latency_s=1.0
    )
    sources = DoctorSources(env={}, gpu_probe=lambda: GpuInfo(names=(), cuda_version=None))
    etcd = run_doctor(options, sources)[0]
    answer = etcd.data["endpoints"][etcd_endpoint]
    assert etcd.name == "etcd" and etcd.status is _expected(answer["version"]), etcd.detail
    assert answer["version"].startswith("3.") and 0 < answer["latency_s"] < 1.0
    assert f"{etcd_endpoint} v{answer['version']}" in etcd.detail


def test_one_endpoint_down_warns_and_names_it(etcd_endpoint):
    dead = unreachable()
    options = DoctorOptions(etcd=etcd_config(f"{etcd_endpoint},{dead}", {}, timeout_s=2.0), sysfs_root="/nonexistent")
    etcd = run_doctor(options, DoctorSources(env={}, gpu_probe=lambda: GpuInfo(names=(), cuda_version=None)))[0]
    assert etcd.status is Status.WARN, etcd.detail
    assert f"{dead} unreachable" in etcd.detail and "1 of 2 endpoints down" in etcd.detail
    assert "version" in etcd.data["endpoints"][etcd_endpoint] and "error" in etcd.data["endpoints"][dead]


def test_hard_checks_with_the_agents_client(etcd_client):
    results = hard_checks(etcd_client=etcd_client, sysfs_root=str(FIXTURE), env={})
    version = etcd_client.status_latency_s()[0]
    assert [(r.name, r.status) for r in results] == [("etcd", _expected(version)), ("rdma", Status.FAIL)]
    assert "'rdma' failed: mlx5_1/1 is DOWN" in first_failure(results)
    # The caller owns the client: hard_checks must not have closed it.
    assert etcd_client.status_latency_s()[0].startswith("3.")


def test_hard_checks_refuse_an_unreachable_etcd_in_one_line():
    dead = unreachable()
    client = EtcdClient(EtcdConfig(endpoints=(("127.0.0.1", int(dead.rsplit(":", 1)[1])),), request_timeout_s=2.0))
    try:
        start = time.monotonic()
        results = hard_checks(etcd_client=client, sysfs_root="/nonexistent", env={})
        assert time.monotonic() - start < 5.0
    finally:
        client.close()
    line = first_failure(results)
    assert line is not None and "\n" not in line
    assert line.startswith(f"pre-flight check 'etcd' failed: etcd at {dead}")


def test_cli_all_good_exits_zero(etcd_endpoint, tmp_path):
    proc, _ = doctor_cli(
        "--rdzv-endpoint", etcd_endpoint, "--sysfs-root", str(quiet_sysfs(tmp_path)),
        "--checkpoint-url", f"file://{tmp_path}/ckpt", "--min-free-gb", "0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].split() == ["check", "status", "detail"]
    etcd = row(proc.stdout, "etcd")
    assert etcd[0] == ("warn" if "etcd-io/etcd#14110" in " ".join(etcd) else "ok"), etcd  # 3.5.0-3.5.4: a known crash
    assert row(proc.stdout, "rdma")[0] == "skip"
    assert row(proc.stdout, "checkpoint space")[0] == "ok"
    assert "Traceback" not in proc.stderr


def test_cli_unreachable_etcd_fails_fast_without_traceback(tmp_path):
    dead = unreachable()
    proc, wall_s = doctor_cli(
        "--rdzv-endpoint", dead, "--sysfs-root", str(quiet_sysfs(tmp_path)),
        "--checkpoint-url", str(tmp_path), "--min-free-gb", "0",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    status, detail = row(proc.stdout, "etcd")
    assert status == "fail" and f"etcd at {dead}" in detail
    assert "Traceback" not in proc.stdout + proc.stderr
    # The whole command, interpreter and torch import included; generous for a loaded CI machine
    # (the checks' own time is asserted tightly in test_cli_json).
    assert wall_s < 30.0


def test_cli_json(tmp_path):
    proc, _ = doctor_cli(
        "--json", "--rdzv-endpoint", unreachable(), "--sysfs-root", str(FIXTURE),
        "--checkpoint-url", "memory://ckpt", "--timeout", "5",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert doc["ok"] is False
    assert [checks[n]["status"] for n in ("etcd", "rdma", "checkpoint space")] == ["fail", "fail", "skip"]
    # A refused connection is reported at once, not after the 5 s request timeout.
    assert checks["etcd"]["elapsed_s"] < 2.5
    assert sum(c["elapsed_s"] for c in doc["checks"]) < 10.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-clock-offset", "soon"], "argument --max-clock-offset: invalid float value: 'soon'"),
        (["--rdzv-endpoint", "h:99999"], "invalid port 99999"),
    ],
)
def test_cli_bad_flags_exit_2_with_one_line(argv, message):
    proc, _ = doctor_cli(*argv)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert proc.stdout == ""
