"""`elastic-rt doctor` checks with injected sources: fixture sysfs, fake env, tmp dirs, a loopback SNTP server."""

from __future__ import annotations

import io
import json
import shutil
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from elastic_rt.cli import build_parser
from elastic_rt.errors import ConfigError, EtcdUnavailableError, HealthCheckError
from elastic_rt.doctor import command as doctor
from elastic_rt.doctor.command import DoctorOptions, DoctorSources, first_failure, hard_checks, run_doctor
from elastic_rt.checks.model import CheckResult, Status, run_check
from elastic_rt.checks.rdma import NcclList
from elastic_rt.doctor.checks import (
    GIB,
    GpuInfo,
    check_etcd,
    check_free_space,
    check_gpus,
    check_kernel_clock,
    check_ntp,
)
from elastic_rt.doctor.net import check_nccl_env, check_rdma
from elastic_rt.collectors import sntp
from elastic_rt.collectors.rdma import RdmaCollector
from elastic_rt.collectors.timex import TimexStatus
from tests.unit.test_collectors_clock import LoopbackNtpServer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"


def fixture_ports():
    return RdmaCollector(sysfs_root=str(FIXTURE)).read_ports()


def timex(*, synchronized: bool = True, offset_s: float = 0.0) -> TimexStatus:
    return TimexStatus(
        synchronized=synchronized, unsync_flag=not synchronized, offset_s=offset_s, estimated_error_s=0.001,
        max_error_s=16.0 if not synchronized else 0.01, frequency_adjustment_ratio=1.0, tick_s=0.01,
        status=0x40 if not synchronized else 0, state=5 if not synchronized else 0,
    )  # fmt: skip


def sysfs_with_net(root: Path, *names: str, rdma: bool = False) -> Path:
    if rdma:
        shutil.copytree(FIXTURE, root)
    for name in names:
        (root / "class" / "net" / name).mkdir(parents=True)
    return root


def sources(**kw) -> DoctorSources:
    defaults = dict(
        env={},
        read_timex=lambda: timex(),
        gpu_probe=lambda: GpuInfo(names=("NVIDIA H200",), cuda_version="12.8"),
        disk_usage=lambda path: shutil._ntuple_diskusage(100 * GIB, 50 * GIB, 50 * GIB),
    )
    defaults.update(kw)
    return DoctorSources(**defaults)


# ---- RDMA --------------------------------------------------------------------


def test_rdma_down_port_fails_and_names_it():
    row = check_rdma(fixture_ports(), {})
    assert row.status is Status.FAIL
    assert "mlx5_1/1 is DOWN, phys Polling" in row.detail
    assert "mlx5_0" not in row.detail  # the healthy port is not blamed
    assert row.data["active"] == 1 and row.data["not_active"] == 1


@pytest.mark.parametrize(
    ("hca", "status"),
    [("mlx5_0", Status.OK), ("^mlx5_1", Status.OK), ("=mlx5_0:1", Status.OK), ("mlx5", Status.FAIL),
     ("=mlx5_1:1", Status.FAIL), ("mlx5_1:2", Status.WARN)],
)  # fmt: skip
def test_rdma_considers_only_ports_nccl_ib_hca_selects(hca, status):
    row = check_rdma(fixture_ports(), {"NCCL_IB_HCA": hca})
    assert row.status is status, row.detail


def test_rdma_down_port_only_warns_when_ib_is_disabled():
    row = check_rdma(fixture_ports(), {"NCCL_IB_DISABLE": "1"})
    assert row.status is Status.WARN and "NCCL_IB_DISABLE=1" in row.detail


def test_rdma_unreadable_state_warns(tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(FIXTURE, root)
    (root / "class/infiniband/mlx5_1/ports/1/state").unlink()
    row = check_rdma(RdmaCollector(sysfs_root=str(root)).read_ports(), {})
    assert row.status is Status.WARN and "mlx5_1/1 state unreadable" in row.detail


def test_rdma_without_devices_is_skipped(tmp_path):
    results = hard_checks(sysfs_root=str(tmp_path), env={})
    assert [(r.name, r.status) for r in results] == [("etcd", Status.SKIP), ("rdma", Status.SKIP)]
    assert first_failure(results) is None


def test_nccl_list_parse():
    assert NcclList.parse("^=mlx5_1:1,mlx5_2") == NcclList(
        exclude=True, exact=True, items=(("mlx5_1", "1"), ("mlx5_2", None))
    )
    eth = NcclList.parse("eth,ib")
    assert eth.selects("eth0") and eth.selects("ib1") and not eth.selects("lo")
    assert not NcclList.parse("=eth").selects("eth0")
    assert not NcclList.parse("^docker").selects("docker0")


# ---- hard checks and the one line --------------------------------------------


class FakeEtcd:
    """Answers Status with scripted latencies, or raises; stands in for EtcdClient in pure-logic tests."""

    def __init__(self, latencies=(0.001,), error: Exception | None = None, label: str = "10.0.0.1:2379",
                 version: str = "3.5.17"):
        self.latencies = list(latencies)
        self.version = version
        self.error = error
        self.calls = 0
        self.config = SimpleNamespace(describe=lambda: label)

    def status_latency_s(self):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.version, self.latencies[min(self.calls - 1, len(self.latencies) - 1)]


def test_hard_checks_refuse_with_one_line_naming_the_port():
    results = hard_checks(etcd_client=FakeEtcd(), sysfs_root=str(FIXTURE), env={})
    assert [(r.name, r.status) for r in results] == [("etcd", Status.OK), ("rdma", Status.FAIL)]
    line = first_failure(results)
    assert line is not None and "\n" not in line
    assert line.startswith("pre-flight check 'rdma' failed: mlx5_1/1 is DOWN")
    assert "elastic-rt doctor" in line


def test_first_failure_counts_the_others():
    err = EtcdUnavailableError("etcd at 10.0.0.1:2379 did not answer within 2 s;\nis it running?")
    results = hard_checks(etcd_client=FakeEtcd(error=err), sysfs_root=str(FIXTURE), env={})
    line = first_failure(results)
    assert line is not None and "\n" not in line
    assert "'etcd' failed: etcd at 10.0.0.1:2379 did not answer within 2 s; is it running?" in line
    assert "(and 1 more)" in line
    assert first_failure([CheckResult(name="x", status=Status.WARN, detail="w")]) is None


# ---- etcd (pure logic; the real server is in tests/integration/test_doctor.py) ---


def test_etcd_latency_ignores_the_connecting_call():
    fake = FakeEtcd(latencies=(5.0, 0.003, 0.001, 0.002))
    row = check_etcd({"a:1": fake})
    assert row.status is Status.OK and fake.calls == 4
    assert row.data["endpoints"]["a:1"] == {"version": "3.5.17", "latency_s": 0.001}
    assert "a:1 v3.5.17 1.0 ms" in row.detail


def test_etcd_slow_or_partly_down_warns_all_down_fails():
    slow = check_etcd({"a:1": FakeEtcd(latencies=(0.5,))}, warn_latency_s=0.1)
    assert slow.status is Status.WARN and "latency above 100 ms" in slow.detail
    down = EtcdUnavailableError("etcd at b:2 did not answer")
    partly = check_etcd({"a:1": FakeEtcd(), "b:2": FakeEtcd(error=down)})
    assert partly.status is Status.WARN and "b:2 unreachable" in partly.detail and "1 of 2" in partly.detail
    both = check_etcd({"a:1": FakeEtcd(error=down), "b:2": FakeEtcd(error=RuntimeError("x"))})
    assert both.status is Status.FAIL and "no endpoint answered" in both.detail and "RuntimeError: x" in both.detail
    assert check_etcd(None).status is Status.SKIP


@pytest.mark.parametrize(("version", "warned"), [("3.5.1", True), ("3.5.4", True), ("3.5.5", False),
                                                 ("3.4.23", False), ("3.6.0", False), ("3.5.10", False)])
def test_an_etcd_version_with_a_known_crash_warns(version, warned):
    row = check_etcd({"a:1": FakeEtcd(version=version)})
    assert (row.status is Status.WARN) is warned
    assert ("etcd-io/etcd#14110" in row.detail and "3.5.5 or later" in row.detail) is warned


# ---- clock ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "expected"),
    [(timex(), Status.OK), (timex(synchronized=False), Status.WARN), (timex(offset_s=0.7), Status.FAIL)],
)
def test_kernel_clock(status, expected):
    assert check_kernel_clock(lambda: status, max_offset_s=0.5).status is expected


def test_kernel_clock_hint_only_without_ntp_servers():
    unsync = lambda: timex(synchronized=False)  # noqa: E731
    assert "--ntp-server" in check_kernel_clock(unsync, max_offset_s=0.5).detail
    assert "--ntp-server" not in check_kernel_clock(unsync, max_offset_s=0.5, ntp_given=True).detail


def test_kernel_clock_unreadable_warns():
    def denied():
        raise HealthCheckError("adjtimex failed: errno 1 (Operation not permitted)")

    row = check_kernel_clock(denied, max_offset_s=0.5)
    assert row.status is Status.WARN and "Operation not permitted" in row.detail


@pytest.mark.parametrize(("shift_s", "expected"), [(0.2, Status.OK), (-0.8, Status.FAIL)])
def test_ntp_offset_against_loopback_server(shift_s, expected):
    with LoopbackNtpServer(shift_s=shift_s) as server:
        row = check_ntp(server.addr, sntp.query, max_offset_s=0.5, timeout_s=2.0)
    assert row.status is expected, row.detail
    assert row.data["offset_s"] == pytest.approx(shift_s, abs=0.05)
    assert row.name == f"ntp {server.addr}"


def test_ntp_silent_server_fails_its_row_quickly():
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        start = time.monotonic()
        results = run_doctor(DoctorOptions(ntp_servers=(addr,), timeout_s=0.2, sysfs_root="/nonexistent"), sources())
        assert time.monotonic() - start < 3.0  # one timeout, not one per sample
    finally:
        silent.close()
    row = {r.name: r for r in results}[f"ntp {addr}"]
    assert row.status is Status.FAIL and "did not answer within 0.2 s" in row.detail


# ---- NCCL environment ---------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "warning"),
    [
        ({"NCCL_IB_DISABLE": "1"}, "NCCL_IB_DISABLE=1 while 1 RDMA port is ACTIVE"),
        ({"NCCL_SOCKET_IFNAME": "ib"}, "NCCL_SOCKET_IFNAME=ib names no interface here (have eth0, lo)"),
        ({"NCCL_SOCKET_IFNAME": "=eth"}, "names no interface"),
        ({"NCCL_SOCKET_IFNAME": "^eth"}, "excludes every interface"),
        ({"GLOO_SOCKET_IFNAME": "eth0,eth1"}, "no interface eth1 here"),
        ({"NCCL_IB_HCA": "mlx5_9"}, "NCCL_IB_HCA=mlx5_9 matches no RDMA device (have mlx5_0, mlx5_1)"),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, "a failed collective hangs"),
    ],
)
def test_nccl_env_warns_on_suspicious_settings(env, warning):
    row = check_nccl_env(env, interfaces=["eth0", "lo"], ports=fixture_ports())
    assert row.status is Status.WARN and warning in row.detail, row.detail


def test_nccl_env_reports_only_related_variables():
    env = {"NCCL_SOCKET_IFNAME": "eth", "NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
           "HOME": "/root", "PASSWORD": "x"}  # fmt: skip
    row = check_nccl_env(env, interfaces=["eth0", "lo"], ports=fixture_ports())
    assert row.status is Status.OK, row.detail
    assert row.detail == "NCCL_DEBUG=INFO NCCL_SOCKET_IFNAME=eth TORCH_NCCL_ASYNC_ERROR_HANDLING=1"
    assert set(row.data["variables"]) == {"NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


def test_nccl_env_reads_interfaces_from_the_sysfs_root(tmp_path):
    root = sysfs_with_net(tmp_path / "sys", "ens1f0", "lo")
    results = run_doctor(DoctorOptions(sysfs_root=str(root)), sources(env={"NCCL_SOCKET_IFNAME": "eth0"}))
    row = {r.name: r for r in results}["nccl env"]
    assert row.status is Status.WARN and "(have ens1f0, lo)" in row.detail
    results = run_doctor(DoctorOptions(sysfs_root=str(root)), sources(env={"NCCL_SOCKET_IFNAME": "ens"}))
    assert {r.name: r for r in results}["nccl env"].status is Status.OK


# ---- GPUs and free space --------------------------------------------------------


def test_gpus():
    two = check_gpus(lambda: GpuInfo(names=("NVIDIA H200", "NVIDIA H200"), cuda_version="12.8"), {})
    assert two.status is Status.OK and two.detail == "2 x NVIDIA H200 (CUDA 12.8)"
    none = lambda: GpuInfo(names=(), cuda_version=None)  # noqa: E731
    assert check_gpus(none, {}).status is Status.WARN
    assert check_gpus(none, {"CUDA_VISIBLE_DEVICES": ""}).status is Status.WARN
    asked = check_gpus(none, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert asked.status is Status.FAIL and "CUDA_VISIBLE_DEVICES=0,1" in asked.detail


def test_free_space_real_disk(tmp_path):
    ok = check_free_space(f"file://{tmp_path}", min_free_bytes=0)
    assert ok.status is Status.OK and str(tmp_path) in ok.detail
    assert 0 < ok.data["free_bytes"] <= ok.data["total_bytes"]
    too_little = check_free_space(str(tmp_path), min_free_bytes=2**62)
    assert too_little.status is Status.FAIL and "below --min-free-gb" in too_little.detail


def test_free_space_measures_the_nearest_existing_parent(tmp_path):
    row = check_free_space(str(tmp_path / "a" / "b"), min_free_bytes=0)
    assert row.status is Status.OK and row.data["path"] == str(tmp_path)
    assert f"not created yet; measured at {tmp_path}" in row.detail


def test_free_space_threshold_is_inclusive(tmp_path):
    def usage(free):
        return lambda path: shutil._ntuple_diskusage(100 * GIB, 100 * GIB - free, free)

    assert check_free_space(str(tmp_path), min_free_bytes=10 * GIB, disk_usage=usage(10 * GIB)).status is Status.OK
    assert check_free_space(str(tmp_path), min_free_bytes=10 * GIB, disk_usage=usage(10 * GIB - 1)).failed


@pytest.mark.parametrize("url", ["memory://ckpt", "s3://bucket/ckpt"])
def test_free_space_skips_remote_protocols(url):
    row = check_free_space(url, min_free_bytes=10 * GIB)
    assert row.status is Status.SKIP and row.detail.startswith("cannot measure free space on")


# ---- the runner, the table and the CLI -----------------------------------------


def test_a_check_that_raises_becomes_a_failed_row():
    def broken():
        raise RuntimeError("nvml exploded")

    results = run_doctor(DoctorOptions(sysfs_root="/nonexistent"), sources(gpu_probe=broken))
    by_name = {r.name: r for r in results}
    assert by_name["gpus"].status is Status.FAIL and by_name["gpus"].detail == "RuntimeError: nvml exploded"
    assert list(by_name) == ["etcd", "clock", "rdma", "nccl env", "gpus", "checkpoint space"]


def test_run_check_times_each_check():
    ticks = iter([10.0, 10.25])
    row = run_check("x", lambda: CheckResult(name="x", status=Status.OK, detail="d"), clock=lambda: next(ticks))
    assert row.elapsed_s == 0.25 and row.status is Status.OK


def test_table_and_json():
    results = run_doctor(DoctorOptions(sysfs_root=str(FIXTURE)), sources())
    table = doctor.render_table(results).splitlines()
    assert table[0].split() == ["check", "status", "detail"]
    rows = {line.split("  ")[0].strip(): line for line in table[2:2 + len(results)]}
    assert set(rows) == {r.name for r in results}
    assert rows["rdma"].split()[1] == "fail" and rows["etcd"].split()[1] == "skip"
    assert table[-1] == "4 ok, 0 warn, 1 fail, 1 skip"
    doc = json.loads(doctor.render_json(results))
    assert doc["ok"] is False
    assert [c["status"] for c in doc["checks"]] == ["skip", "ok", "fail", "ok", "ok", "ok"]
    assert all(c["elapsed_s"] >= 0 for c in doc["checks"])


def parse(*argv: str):
    return build_parser().parse_args(["doctor", *argv])


def test_cli_defaults_and_run(tmp_path):
    args = parse("--sysfs-root", str(FIXTURE), "--checkpoint-url", str(tmp_path), "--min-free-gb", "0")
    assert args.func is doctor.run and args.checkpoint_url != "" and args.ntp_server == []
    out = io.StringIO()
    assert doctor.run(args, out=out) == 1  # the fixture's DOWN port
    assert "rdma" in out.getvalue() and "mlx5_1/1 is DOWN" in out.getvalue()
    defaults = doctor.options_from_args(parse())
    assert defaults == DoctorOptions()


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--rdzv-endpoint", "h:99999"], "invalid port"),
        (["--rdzv-endpoint", "h:1", "--rdzv-conf", "user"], "expected key=value"),
        (["--ntp-server", "host:ntp"], "bad port in NTP server"),
        (["--max-clock-offset", "0"], "--max-clock-offset 0: must be a positive"),
        (["--min-free-gb", "-1"], "--min-free-gb -1"),
        (["--timeout", "nan"], "--timeout nan"),
    ],
)
def test_bad_flags_are_config_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        doctor.options_from_args(parse(*argv))


def test_options_carry_etcd_tls_and_credentials():
    opts = doctor.options_from_args(
        parse("--rdzv-endpoint", "a:1,b", "--rdzv-conf", "ca_cert=/ca.pem,user=u,password=p", "--timeout", "1.5")
    )
    assert opts.etcd.endpoints == (("a", 1), ("b", 2379))
    assert (opts.etcd.ca_cert, opts.etcd.user, opts.etcd.password) == ("/ca.pem", "u", "p")
    assert opts.etcd.request_timeout_s == 1.5 and opts.timeout_s == 1.5


def test_doctor_reads_rdzv_conf_as_launch_does():
    """One builder (rendezvous.registration): endpoints, TLS and credential keys and their
    aliases; doctor's --timeout replaces read_timeout."""
    conf = {"ssl_cert": "c.pem", "ssl_cert_key": "k.pem", "ca_cert": "ca.pem", "username": "u",
            "password": "p", "read_timeout": "9"}
    cfg = doctor.etcd_config("h1:2379,[::1]:2380,h3", conf, timeout_s=2.0)
    assert cfg.endpoints == (("h1", 2379), ("::1", 2380), ("h3", 2379))
    assert (cfg.cert, cfg.key, cfg.ca_cert, cfg.user, cfg.password) == ("c.pem", "k.pem", "ca.pem", "u", "p")
    assert cfg.request_timeout_s == 2.0
    with pytest.raises(ConfigError, match="rdzv-endpoint"):
        doctor.etcd_config("h1:99999", {}, timeout_s=2.0)
