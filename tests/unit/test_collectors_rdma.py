"""RDMA sysfs collector against the fixture tree in tests/fixtures/sysfs."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from elastic_rt.collectors.rdma import RdmaCollector, SysfsValueError, parse_rate, parse_state

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"


def registry_for(root: Path | str) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(RdmaCollector(sysfs_root=str(root)))
    return reg


def val(reg: CollectorRegistry, name: str, device: str, **extra: str) -> float | None:
    return reg.get_sample_value(name, {"device": device, "port": "1", **extra})


def test_healthy_port():
    reg = registry_for(FIXTURE)
    assert val(reg, "elastic_rt_rdma_state_id", "mlx5_0") == 4
    assert val(reg, "elastic_rt_rdma_physical_state_id", "mlx5_0") == 5
    assert val(reg, "elastic_rt_rdma_rate_bytes_per_second", "mlx5_0") == 25e9  # 200 Gb/s
    for name in ("link_downed", "symbol_error", "link_error_recovery", "port_errors_received", "vl15_dropped"):
        assert val(reg, f"elastic_rt_rdma_{name}_total", "mlx5_0") == 0, name
    # port_xmit_data counts 4-byte words.
    assert val(reg, "elastic_rt_rdma_port_data_transmitted_bytes_total", "mlx5_0") == 4 * 2_500_000_000
    assert val(reg, "elastic_rt_rdma_port_data_received_bytes_total", "mlx5_0") == 4 * 2_400_000_000
    assert val(reg, "elastic_rt_rdma_port_packets_transmitted_total", "mlx5_0") == 38_000_000
    info = {"link_layer": "InfiniBand", "state": "ACTIVE", "phys_state": "LinkUp"}
    assert val(reg, "elastic_rt_rdma_port_info", "mlx5_0", **info) == 1


def test_faulty_port():
    reg = registry_for(FIXTURE)
    assert val(reg, "elastic_rt_rdma_state_id", "mlx5_1") == 1
    assert val(reg, "elastic_rt_rdma_physical_state_id", "mlx5_1") == 2
    assert val(reg, "elastic_rt_rdma_link_downed_total", "mlx5_1") == 3
    assert val(reg, "elastic_rt_rdma_symbol_error_total", "mlx5_1") == 1234
    assert val(reg, "elastic_rt_rdma_link_error_recovery_total", "mlx5_1") == 7
    assert val(reg, "elastic_rt_rdma_port_errors_received_total", "mlx5_1") == 12
    info = {"link_layer": "InfiniBand", "state": "DOWN", "phys_state": "Polling"}
    assert val(reg, "elastic_rt_rdma_port_info", "mlx5_1", **info) == 1


def test_every_required_error_counter_is_exported():
    text = generate_latest(registry_for(FIXTURE)).decode()
    for suffix in (
        "link_downed", "link_error_recovery", "symbol_error", "port_errors_received",
        "port_discards_transmitted", "port_receive_remote_physical_errors",
        "port_receive_switch_relay_errors", "local_link_integrity_errors",
        "excessive_buffer_overrun_errors", "vl15_dropped", "port_constraint_errors_transmitted",
        "port_constraint_errors_received",
    ):  # fmt: skip
        assert f'elastic_rt_rdma_{suffix}_total{{device="mlx5_1",port="1"}}' in text, suffix
        assert f"# TYPE elastic_rt_rdma_{suffix}_total counter" in text


def test_no_infiniband_directory_exports_nothing_and_logs_once(tmp_path, caplog):
    reg = registry_for(tmp_path)
    with caplog.at_level(logging.INFO, logger="elastic_rt.collectors.rdma"):
        for _ in range(3):
            text = generate_latest(reg).decode()
    assert "elastic_rt_rdma_state_id{" not in text
    assert reg.get_sample_value("elastic_rt_rdma_state_id", {"device": "mlx5_0", "port": "1"}) is None
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "does not exist" in msgs[0]


def test_garbage_and_unreadable_values_are_skipped_and_logged_once(tmp_path, caplog):
    root = tmp_path / "sys"
    shutil.copytree(FIXTURE, root)
    port = root / "class" / "infiniband" / "mlx5_1" / "ports" / "1"
    (port / "counters" / "symbol_error").write_text("N/A (no PMA)\n")
    (port / "rate").write_text("fast\n")
    # A directory where a file should be: open() fails with EISDIR even for root.
    (port / "counters" / "link_downed").unlink()
    (port / "counters" / "link_downed").mkdir()
    reg = registry_for(root)
    with caplog.at_level(logging.INFO, logger="elastic_rt.collectors.rdma"):
        for _ in range(2):
            assert val(reg, "elastic_rt_rdma_symbol_error_total", "mlx5_1") is None
            assert val(reg, "elastic_rt_rdma_link_downed_total", "mlx5_1") is None
            assert val(reg, "elastic_rt_rdma_rate_bytes_per_second", "mlx5_1") is None
            # Everything else on that port, and the other device, is still there.
            assert val(reg, "elastic_rt_rdma_state_id", "mlx5_1") == 1
            assert val(reg, "elastic_rt_rdma_link_error_recovery_total", "mlx5_1") == 7
            assert val(reg, "elastic_rt_rdma_state_id", "mlx5_0") == 4
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 3, msgs  # one per bad file, not per scrape
    assert any("symbol_error" in m for m in msgs) and any("rate" in m for m in msgs)


def test_missing_counters_directory_still_exports_state(tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(FIXTURE, root)
    shutil.rmtree(root / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters")
    reg = registry_for(root)
    assert val(reg, "elastic_rt_rdma_state_id", "mlx5_0") == 4
    assert val(reg, "elastic_rt_rdma_link_downed_total", "mlx5_0") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [("100 Gb/sec (4X EDR)\n", 12.5e9), ("2.5 Gb/sec (1X SDR)", 312.5e6), ("400 Gb/sec (4X NDR)", 50e9)],
)
def test_parse_rate(text, expected):
    assert parse_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "Gb/sec", "x Gb/sec", "100 furlongs"])
def test_parse_rate_rejects_garbage(text):
    with pytest.raises(SysfsValueError):
        parse_rate(text)


def test_parse_state():
    assert parse_state("4: ACTIVE\n") == (4, "ACTIVE")
    assert parse_state("5: LinkUp") == (5, "LinkUp")
    with pytest.raises(SysfsValueError):
        parse_state("ACTIVE")
