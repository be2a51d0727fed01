"""Clock health: SNTP against a loopback server, adjtimex, skew estimation, clock metrics."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from elastic_rt.errors import ConfigError, HealthCheckError
from elastic_rt.collectors import sntp
from elastic_rt.collectors.clock import (
    ClockMetrics,
    SkewEstimate,
    SkewSample,
    estimate_skew,
    measure_skew,
    skew_warning,
)
from elastic_rt.collectors.timex import TimexCollector, TimexStatus, read_timex


class LoopbackNtpServer:
    """Answers SNTP requests on 127.0.0.1 with its clock shifted by `shift_s`."""

    def __init__(self, *, shift_s: float, stratum: int = 2, leap: int = 0) -> None:
        self.shift_s = shift_s
        self.stratum = stratum
        self.leap = leap
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(512)
            except socket.timeout:
                continue
            except OSError:
                return
            t2 = time.time() + self.shift_s
            client_xmit = struct.unpack_from("!Q", data, 40)[0]
            first = (self.leap << 6) | (4 << 3) | 4
            t3 = time.time() + self.shift_s
            reply = struct.pack(
                "!BBbbII4sQQQQ", first, self.stratum, 0, -20, 0, 0, b"LOCL",
                sntp.to_ntp(t2), client_xmit, sntp.to_ntp(t2), sntp.to_ntp(t3),
            )  # fmt: skip
            self.sock.sendto(reply, peer)

    def __enter__(self) -> "LoopbackNtpServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_sntp_measures_a_known_offset():
    with LoopbackNtpServer(shift_s=0.250) as server:
        # As ntpd does, trust the exchange with the smallest round trip: on a loaded
        # machine one exchange can be delayed asymmetrically by the scheduler.
        results = [sntp.query(server.addr, timeout_s=2.0) for _ in range(3)]
    best = min(results, key=lambda r: r.round_trip_s)
    assert best.offset_s == pytest.approx(0.250, abs=0.010)
    assert all(0 <= r.round_trip_s < 0.5 for r in results)
    assert best.stratum == 2 and best.server == server.addr


def test_sntp_negative_offset_with_injected_local_clock():
    # Our clock runs 1.5 s ahead of the (unshifted) server: the server is 1.5 s behind.
    with LoopbackNtpServer(shift_s=0.0) as server:
        result = sntp.query(server.addr, timeout_s=2.0, clock=lambda: time.time() + 1.5)
    assert result.offset_s == pytest.approx(-1.5, abs=0.010)


def test_sntp_silent_server_times_out_quickly():
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        start = time.monotonic()
        with pytest.raises(HealthCheckError, match=r"did not answer within 0.2 s"):
            sntp.query(addr, timeout_s=0.2)
        assert time.monotonic() - start < 2.0
    finally:
        silent.close()


def test_sntp_closed_port_is_a_clear_error():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nobody listens: ICMP port unreachable -> refused (or a timeout)
    with pytest.raises(HealthCheckError, match=addr):
        sntp.query(addr, timeout_s=0.5)


@pytest.mark.parametrize(("stratum", "leap", "match"), [(0, 0, "kiss-of-death"), (2, 3, "not synchronized")])
def test_sntp_rejects_unusable_servers(stratum, leap, match):
    with LoopbackNtpServer(shift_s=0.0, stratum=stratum, leap=leap) as server:
        with pytest.raises(HealthCheckError, match=match):
            sntp.query(server.addr, timeout_s=2.0)


def test_parse_server():
    assert sntp.parse_server("time.example.org") == ("time.example.org", 123)
    assert sntp.parse_server("10.0.0.1:1123") == ("10.0.0.1", 1123)
    assert sntp.parse_server("[::1]:124") == ("::1", 124)
    assert sntp.parse_server("fd00::1") == ("fd00::1", 123)
    with pytest.raises(ConfigError):
        sntp.parse_server("host:notaport")


def test_ntp_timestamp_round_trip():
    t = 1_700_000_000.123456
    assert sntp.from_ntp(sntp.to_ntp(t)) == pytest.approx(t, abs=1e-6)


def test_adjtimex_returns_sane_values():
    st = read_timex()
    assert isinstance(st.synchronized, bool) and isinstance(st.unsync_flag, bool)
    assert st.max_error_s >= 0 and st.estimated_error_s >= 0
    assert 0 < st.tick_s < 1
    assert 0 <= st.state <= 5


def test_skew_estimator_picks_the_fastest_round_trip():
    samples = [
        (100.0, 100.9, 101.0),  # slow (1 s) and asymmetric: offset 0.4 by itself
        (200.0, 200.35, 200.1),  # 0.1 s round trip: offset 0.3
        (300.0, 300.32, 300.04),  # 0.04 s round trip: offset 0.30
    ]
    est = estimate_skew(samples)
    assert est.offset_s == pytest.approx(0.30)
    assert est.round_trip_s == pytest.approx(0.04)
    assert est.error_bound_s == pytest.approx(0.02)
    assert est.samples == 3


def test_skew_estimator_drops_backward_samples_and_needs_one():
    assert estimate_skew([(10.0, 5.0, 9.0), (10.0, 10.5, 10.2)]).samples == 1
    with pytest.raises(HealthCheckError):
        estimate_skew([])
    with pytest.raises(HealthCheckError):
        estimate_skew([SkewSample(t_send_local=2.0, t_remote=1.0, t_recv_local=1.0)])


def test_measure_skew_with_shifted_clocks():
    """Local clock ticks 10 ms per read; the remote is the same clock shifted by -0.75 s."""
    ticks = iter(range(1000))
    asked: list[int] = []

    def local() -> float:
        return 5000.0 + next(ticks) * 0.010

    def remote(k: int) -> float:
        # Read between our two reads: take a local tick and shift it.
        asked.append(k)
        return local() - 0.75

    est = measure_skew(remote, samples=5, clock=local)
    assert est.offset_s == pytest.approx(-0.75, abs=1e-9)
    assert est.round_trip_s == pytest.approx(0.020)
    assert asked == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError):
        measure_skew(remote, samples=0, clock=local)


def test_skew_warning_thresholds():
    assert skew_warning(0.2, 1.0) is None
    assert skew_warning(-0.5, 1.0) is None
    warn = skew_warning(-0.6, 1.0)
    assert warn is not None and "-0.600 s" in warn and "60%" in warn and "approaching" in warn
    assert "exceeds" in skew_warning(1.5, 1.0)
    assert skew_warning(0.3, 1.0, fraction=0.25) is not None
    with pytest.raises(ConfigError):
        skew_warning(0.1, 0)


def test_clock_metrics_in_own_registry():
    reg = CollectorRegistry()
    fake = TimexStatus(
        synchronized=True, unsync_flag=False, offset_s=-0.002, estimated_error_s=0.001,
        max_error_s=0.05, frequency_adjustment_ratio=1.00001, tick_s=0.01, status=0x2001, state=0,
    )  # fmt: skip
    m = ClockMetrics(registry=reg, run_id="r1", node="n0", timex_reader=lambda: fake)
    m.on_ntp(sntp.NtpResult(server="ntp1:123", offset_s=0.004, round_trip_s=0.0009, stratum=2, leap=0))
    m.on_ntp_failure("ntp2")
    m.on_skew(SkewEstimate(offset_s=-0.3, round_trip_s=0.002, error_bound_s=0.001, samples=8))
    base = {"run_id": "r1", "node": "n0"}
    assert reg.get_sample_value("elastic_rt_clock_ntp_offset_seconds", {**base, "server": "ntp1:123"}) == 0.004
    assert reg.get_sample_value("elastic_rt_clock_ntp_round_trip_seconds", {**base, "server": "ntp1:123"}) == 0.0009
    assert reg.get_sample_value("elastic_rt_clock_ntp_query_failures_total", {**base, "server": "ntp2"}) == 1
    assert reg.get_sample_value("elastic_rt_clock_skew_seconds", base) == -0.3
    assert reg.get_sample_value("elastic_rt_clock_skew_error_bound_seconds", base) == 0.001
    assert reg.get_sample_value("elastic_rt_clock_timex_sync_status", base) == 1
    assert reg.get_sample_value("elastic_rt_clock_timex_offset_seconds", base) == -0.002
    assert reg.get_sample_value("elastic_rt_clock_timex_maxerror_seconds", base) == 0.05


def test_timex_collector_on_this_machine_and_when_unavailable():
    reg = CollectorRegistry()
    reg.register(TimexCollector())
    assert reg.get_sample_value("elastic_rt_clock_timex_sync_status") in (0.0, 1.0)
    assert reg.get_sample_value("elastic_rt_clock_timex_maxerror_seconds") >= 0

    def broken() -> TimexStatus:
        raise HealthCheckError("adjtimex failed: errno 1 (Operation not permitted)")

    reg2 = CollectorRegistry()
    reg2.register(TimexCollector(reader=broken))
    assert reg2.get_sample_value("elastic_rt_clock_timex_sync_status") is None
