"""Metrics and hang detection end to end: two real nodes scraped over HTTP, a worker SIGSTOPped."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from etcd_testbed.server import free_port
from tests.chaos.harness import Node, launch_args
from tests.chaos.test_launch_e2e import _rank0, nodes  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run_id", "node"))))] = s.value
    return out


def value(samples, name, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def total(samples, name) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def poll(fn, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except OSError as exc:
            last = exc
        time.sleep(0.2)
    raise TimeoutError(f"{what} within {timeout_s} s (last: {last})")


@pytest.mark.long  # tests/integration/test_prometheus_e2e.py scrapes real agents through worker and node
# losses; every metric asserted here draws a dashboard panel there (test_every_dashboard_panel_draws)
def test_scrape_two_nodes_before_and_after_worker_kill(etcd_endpoint, run_id, nodes):  # noqa: F811
    ports = [free_port(), free_port()]
    started = []
    for name, port in zip("ab", ports):
        args = launch_args(etcd_endpoint, run_id, name, nnodes="2", steps=300, step_sleep=0.05)
        args[args.index("--metrics-port") + 1] = str(port)
        started.append(Node(args, name=name))
    nodes.extend(started)
    a, b = started
    leader, other = _rank0(a, b)
    leader.wait_for(r"step=3 ", 120)
    for port in ports:
        s = poll(lambda: scrape(port), 30, "metrics served")
        assert value(s, "elastic_rt_world_size") == 4
        assert value(s, "elastic_rt_nodes") == 2
        assert total(s, "elastic_rt_restarts_total") == 0
        assert value(s, "elastic_rt_rendezvous_rounds_total") == 1
        assert len([k for k in s if k[0] == "elastic_rt_worker_resident_memory_bytes"]) == 2
        poll(lambda: (value(scrape(port), "elastic_rt_probe_latency_seconds") or 0) > 0, 60, "probe latency")
        poll(lambda: value(scrape(port), "elastic_rt_clock_skew_seconds") is not None, 60, "clock skew")
    os.kill(other.worker_pids()[0], signal.SIGKILL)
    for port in ports:
        # the round is counted at rendezvous, the recovery once the new workers are running
        s = poll(lambda: (x := scrape(port)) and total(x, "elastic_rt_restarts_total") >= 1
                 and value(x, "elastic_rt_rendezvous_rounds_total") == 2
                 and value(x, "elastic_rt_last_recovery_duration_seconds") is not None and x,
                 120, "restart and recovery counted")
        assert total(s, "elastic_rt_restarts_total") == 1  # one restart per node, whatever its reason
        assert value(s, "elastic_rt_world_size") == 4
        assert (value(s, "elastic_rt_last_recovery_duration_seconds") or 0) > 0
    # the node that lost a worker restarted for it, or for the round its peer opened first
    s_other = scrape(ports[started.index(other)])
    assert (value(s_other, "elastic_rt_restarts_total", reason="worker_failure")
            + value(s_other, "elastic_rt_restarts_total", reason="round_advanced")) == 1
    for n in started:
        assert n.wait_exit(240) == 0, n.output[-3000:]


@pytest.mark.long  # for CI's time: test_hang_plain_script.py SIGSTOPs a worker
def test_sigstopped_worker_is_a_hang_and_the_group_restarts(etcd_endpoint, run_id, nodes):  # noqa: F811
    n = Node(launch_args(etcd_endpoint, run_id, "a", nnodes="1", steps=60, step_sleep=0.05,
                         extra=["--hang-timeout", "5"]), name="a")
    nodes.append(n)
    n.wait_for(r"step=5 ", 120)
    stopped_at = time.monotonic()
    os.kill(n.worker_pids()[-1], signal.SIGSTOP)
    n.wait_for(r"restarting the worker group: hang", 60, after=stopped_at)
    assert n.wait_exit(240) == 0, n.output[-3000:]
    assert n.matches(r"done steps=60 world_size=2")


def test_metrics_port_in_use_and_silent_ntp_server_do_not_stop_the_agent(etcd_endpoint, run_id, nodes):  # noqa: F811
    with socket.socket() as busy, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent_ntp:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        silent_ntp.bind(("127.0.0.1", 0))
        args = launch_args(etcd_endpoint, run_id, "a", nnodes="1", steps=5,
                           extra=["--ntp-server", f"127.0.0.1:{silent_ntp.getsockname()[1]}"])
        args[args.index("--metrics-port") + 1] = str(busy.getsockname()[1])
        n = Node(args, name="a")
        nodes.append(n)
        assert n.wait_exit(180) == 0, n.output[-3000:]
    assert n.matches(r"metrics port \d+ .*already in use.*--metrics-port.*continuing without")
    assert n.matches(r"NTP server 127\.0\.0\.1:\d+: ")
    assert n.matches(r"done steps=5 world_size=2")
