"""The /metrics, /livez, /readyz (and /healthz) HTTP exporter, on free loopback ports."""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Gauge

from elastic_rt.errors import ConfigError, ElasticRTError
from elastic_rt.metrics.exporter import MetricsExporter
from elastic_rt.checks.model import CheckResult
from elastic_rt.metrics.health_endpoints import LIVENESS, READINESS, HealthChecks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def started(registry: CollectorRegistry, **kw) -> MetricsExporter:
    """Start on a free port; retry if another process grabbed it in between."""
    for _ in range(5):
        exporter = MetricsExporter(registry=registry, host="127.0.0.1", port=free_port(), **kw)
        try:
            exporter.start()
            return exporter
        except ConfigError:
            continue
    raise RuntimeError("no free port found in 5 tries")


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def poll(fn, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s} s (last: {last!r})")
        time.sleep(0.05)


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Gauge("elastic_rt_world_size", "doc", ["run_id"], registry=reg).labels("r").set(8)
    return reg


@pytest.fixture
def state() -> dict:
    return {"monitor": (True, "monitor loop ticked 0.1 s ago"), "probe": (True, "all-reduce in 1.2 ms"),
            "rdma": (True, "2 port(s) active")}


@pytest.fixture
def health(state):
    liveness = HealthChecks(LIVENESS, [("monitor", lambda: state["monitor"])])
    readiness = HealthChecks(READINESS, [(n, (lambda n=n: state[n])) for n in ("probe", "rdma")])
    return {"liveness": liveness, "readiness": readiness}


def test_metrics_endpoint_serves_the_injected_registry(registry):
    with started(registry) as exporter:
        status, ctype, body = get(exporter.url + "/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        assert 'elastic_rt_world_size{run_id="r"} 8.0' in body
        assert "python_gc" not in body  # the global registry is not served
        status, _, body = get(exporter.url + "/nope")
        assert status == 404 and "/livez" in body and "/readyz" in body


def test_livez_readyz_and_the_healthz_alias(registry, health, state):
    with started(registry, **health) as exporter:
        for path in ("/livez", "/readyz", "/healthz", "/livez/", "/readyz/probe"):
            assert get(exporter.url + path)[::2] == (200, "ok\n"), path
        # a failed probe fails readiness only: liveness (and its /healthz alias) stays 200
        state["probe"] = (False, "round 2: collective probe failed: timed out after 0.01 s")
        status, _, body = get(exporter.url + "/readyz")
        assert status == 503
        assert body == "probe failed: round 2: collective probe failed: timed out after 0.01 s\n"
        assert get(exporter.url + "/livez")[::2] == (200, "ok\n")
        assert get(exporter.url + "/healthz")[::2] == (200, "ok\n")
        # one line naming every failing check
        state["rdma"] = (False, "mlx5_1 port 1 is DOWN (state 1)")
        status, _, body = get(exporter.url + "/readyz")
        assert status == 503 and body.count("\n") == 1
        assert body.startswith("probe failed: ") and "; rdma failed: mlx5_1 port 1 is DOWN" in body
        # a wedged agent fails liveness with the seconds since the last tick
        state["monitor"] = (False, "monitor loop last ticked 42.0 s ago (limit 30 s): the agent is wedged")
        for path in ("/livez", "/healthz"):
            status, _, body = get(exporter.url + path)
            assert status == 503 and body == f"monitor failed: {state['monitor'][1]}\n", path


def test_verbose_lists_every_check_in_the_kubernetes_format(registry, health, state):
    with started(registry, **health) as exporter:
        status, _, body = get(exporter.url + "/readyz?verbose")
        assert status == 200
        assert body.splitlines() == ["[+]probe ok: all-reduce in 1.2 ms", "[+]rdma ok: 2 port(s) active",
                                     "readyz check passed"]
        state["rdma"] = (False, "mlx5_1 port 1 is DOWN (state 1)")
        status, _, body = get(exporter.url + "/readyz?verbose=1")
        assert status == 503
        assert body.splitlines() == ["[+]probe ok: all-reduce in 1.2 ms",
                                     "[-]rdma failed: mlx5_1 port 1 is DOWN (state 1)", "readyz check failed"]
        assert get(exporter.url + "/livez?verbose")[::2] == (
            200, "[+]monitor ok: monitor loop ticked 0.1 s ago\nlivez check passed\n")


def test_single_check_paths_and_exclude(registry, health, state):
    state["rdma"] = (False, "mlx5_1 port 1 is DOWN (state 1)")
    with started(registry, **health) as exporter:
        assert get(exporter.url + "/readyz/probe")[::2] == (200, "ok\n")
        assert get(exporter.url + "/readyz/rdma")[0] == 503
        assert get(exporter.url + "/readyz/nosuchcheck")[0] == 404
        assert get(exporter.url + "/readyz?exclude=rdma")[::2] == (200, "ok\n")
        status, _, body = get(exporter.url + "/readyz?exclude=rdma&verbose")
        assert status == 200 and "rdma" not in body and "[+]probe ok" in body


def test_a_check_that_raises_fails_itself_not_the_endpoint(registry):
    def boom() -> CheckResult:
        raise RuntimeError("store unreachable\nsecond line")

    readiness = HealthChecks(READINESS, [("store", boom), ("fine", lambda: (True, "fine"))])
    with started(registry, readiness=readiness) as exporter:
        status, _, body = get(exporter.url + "/readyz?verbose")
        assert status == 503
        assert "[-]store failed: check raised RuntimeError: store unreachable second line" in body
        assert "[+]fine ok: fine" in body
        assert get(exporter.url + "/livez")[::2] == (200, "ok\n")  # no liveness checks given: alive


def test_head_requests_get_the_status_without_a_body(registry, health, state):
    state["probe"] = (False, "timed out")
    with started(registry, **health) as exporter:
        req = urllib.request.Request(exporter.url + "/readyz", method="HEAD")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 503 and info.value.read() == b""


def test_probes_answer_with_32_idle_connections_held_open(registry, health):
    """Idle connections (a port scanner, a client that connects and sends nothing) hold no thread and no slot:
    /livez and /readyz answer 200 with twice the cap of them open, and so do scrapes."""
    idle: list[socket.socket] = []
    with started(registry, request_timeout_s=30.0, **health) as exporter:
        threads_before = threading.active_count()
        try:
            for _ in range(32):
                idle.append(socket.create_connection(("127.0.0.1", exporter.port), timeout=10))
            idle[-1].sendall(b"GET /metr")  # one dribbles half a request line
            for path in ("/livez", "/readyz", "/healthz", "/metrics"):
                assert get(exporter.url + path)[0] == 200, path
            assert threading.active_count() <= threads_before + 1  # at most a finishing answer's thread
        finally:
            while idle:
                idle.pop().close()


def test_scrapes_past_the_cap_get_503_and_probes_still_answer(registry, health):
    """Past the cap of requests being answered, a scrape is answered 503 at once; probes have slots of their own,
    never behind scrapes. Freed slots serve again."""
    release = threading.Event()
    entered: list[int] = []

    class Stuck:  # a collector that hangs, as a wedged sysfs read would
        def collect(self):
            entered.append(1)
            release.wait(30)
            return []

    registry.register(Stuck())
    with started(registry, max_connections=2, **health) as exporter:
        stuck = [threading.Thread(target=get, args=(exporter.url + "/metrics",)) for _ in range(2)]
        for t in stuck:
            t.start()
        try:
            poll(lambda: len(entered) == 2, 10, "both slots taken by the stuck scrapes")
            status, _, body = get(exporter.url + "/metrics")
            assert status == 503 and body.startswith("busy: too many concurrent connections")
            for path in ("/livez", "/readyz"):
                assert get(exporter.url + path)[0] == 200, path
        finally:
            release.set()
            for t in stuck:
                t.join(30)
        poll(lambda: get(exporter.url + "/metrics")[0] == 200, 10, "served again once slots are free")


def test_a_silent_client_loses_its_slot_after_the_request_timeout(registry):
    with started(registry, max_connections=1, request_timeout_s=0.5) as exporter:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=10) as silent:
            # the server drops the silent connection after its timeout: the client sees EOF
            silent.settimeout(10)
            assert silent.recv(1024) == b""
            poll(lambda: get(exporter.url + "/livez")[0] == 200, 10, "the slot freed")


def test_start_logs_the_bound_address_and_what_it_means(registry, caplog):
    caplog.set_level(logging.INFO, logger="elastic_rt.metrics.exporter")
    with started(registry) as exporter:
        line = [r.getMessage() for r in caplog.records if "serving /metrics" in r.getMessage()][0]
        assert f"127.0.0.1:{exporter.port}" in line and "this address only" in line and "--metrics-host" in line
        assert "at most 16 requests at once" in line


def test_ipv6_all_interfaces_also_serves_ipv4(registry):
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    exporter = MetricsExporter(registry=registry, host="::", port=free_port())
    try:
        exporter.start()
    except ConfigError as exc:
        pytest.skip(f"cannot bind :: here: {exc}")
    with exporter:
        assert get(f"http://[::1]:{exporter.port}/livez")[0] == 200
        assert get(f"http://127.0.0.1:{exporter.port}/livez")[0] == 200  # dual stack (IPV6_V6ONLY off)


def test_port_in_use_is_a_clear_typed_error(registry):
    with started(registry) as first:
        second = MetricsExporter(registry=registry, host="127.0.0.1", port=first.port)
        with pytest.raises(ConfigError) as info:
            second.start()
        msg = str(info.value)
        assert str(first.port) in msg and "--metrics-port" in msg and "in use" in msg
        assert isinstance(info.value, ElasticRTError)


def test_stop_releases_the_port(registry):
    exporter = started(registry)
    port = exporter.port
    exporter.stop()
    again = MetricsExporter(registry=registry, host="127.0.0.1", port=port)
    with again:
        assert get(again.url + "/livez")[0] == 200
    again.stop()  # idempotent


def test_port_zero_is_off(registry):
    exporter = MetricsExporter(registry=registry, host="127.0.0.1", port=0)
    exporter.start()
    assert not exporter.enabled
    exporter.stop()


def test_bad_port_and_cap_are_config_errors(registry):
    with pytest.raises(ConfigError, match="--metrics-port"):
        MetricsExporter(registry=registry, host="127.0.0.1", port=70000)
    with pytest.raises(ConfigError, match="at least 1 connection"):
        MetricsExporter(registry=registry, host="127.0.0.1", port=9402, max_connections=0)
