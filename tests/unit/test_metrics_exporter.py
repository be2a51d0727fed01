"""The /metrics and /healthz HTTP exporter, on free loopback ports."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Gauge

from elastic_rt.errors import ConfigError, ElasticRTError
from elastic_rt.metrics.exporter import MetricsExporter


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


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Gauge("elastic_rt_world_size", "doc", ["run_id"], registry=reg).labels("r").set(8)
    return reg


def test_metrics_endpoint_serves_the_injected_registry(registry):
    exporter = started(registry)
    try:
        status, ctype, body = get(exporter.url + "/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        assert 'elastic_rt_world_size{run_id="r"} 8.0' in body
        assert "python_gc" not in body  # the global registry is not served
        status, _, body = get(exporter.url + "/nope")
        assert status == 404
    finally:
        exporter.stop()


def test_healthz_ok_and_unhealthy_with_reason(registry):
    state = {"result": True}
    exporter = started(registry, healthy=lambda: state["result"])
    try:
        assert get(exporter.url + "/healthz")[::2] == (200, "ok\n")
        state["result"] = (False, "worker 3 hung for 300 s")
        status, _, body = get(exporter.url + "/healthz")
        assert status == 503 and "worker 3 hung for 300 s" in body
        state["result"] = False
        assert get(exporter.url + "/healthz")[0] == 503
    finally:
        exporter.stop()


def test_healthz_when_the_health_callable_raises(registry):
    def boom() -> bool:
        raise RuntimeError("store unreachable")

    exporter = started(registry, healthy=boom)
    try:
        status, _, body = get(exporter.url + "/healthz")
        assert status == 503 and "store unreachable" in body
    finally:
        exporter.stop()


def test_port_in_use_is_a_clear_typed_error(registry):
    first = started(registry)
    try:
        second = MetricsExporter(registry=registry, host="127.0.0.1", port=first.port)
        with pytest.raises(ConfigError) as info:
            second.start()
        msg = str(info.value)
        assert str(first.port) in msg and "--metrics-port" in msg and "in use" in msg
        assert isinstance(info.value, ElasticRTError)
    finally:
        first.stop()


def test_stop_releases_the_port(registry):
    exporter = started(registry)
    port = exporter.port
    exporter.stop()
    again = MetricsExporter(registry=registry, host="127.0.0.1", port=port)
    again.start()
    try:
        assert get(again.url + "/healthz")[0] == 200
    finally:
        again.stop()
    again.stop()  # idempotent


def test_port_zero_is_off(registry):
    exporter = MetricsExporter(registry=registry, host="127.0.0.1", port=0)
    exporter.start()
    assert not exporter.enabled
    exporter.stop()


def test_bad_port_is_a_config_error(registry):
    with pytest.raises(ConfigError, match="--metrics-port"):
        MetricsExporter(registry=registry, port=70000)
