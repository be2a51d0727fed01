"""/livez and /readyz of real agents: a failed collective probe fails readiness, never liveness; a wedged
monitor loop fails liveness within its threshold and recovers when the loop does."""

from __future__ import annotations

import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from etcd_testbed.server import free_port
from tests.chaos.harness import Node, launch_args
from tests.chaos.test_health_e2e import poll, scrape, value
from tests.chaos.test_launch_e2e import _rank0, nodes  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

WEDGED_AGENT = str(Path(__file__).with_name("wedged_agent.py"))


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def with_metrics_port(args: list[str], port: int) -> list[str]:
    args = list(args)
    args[args.index("--metrics-port") + 1] = str(port)
    return args


def test_failed_probe_fails_readyz_and_keeps_livez(etcd_endpoint, run_id, nodes):  # noqa: F811
    ports = [free_port(), free_port()]
    started = []
    for name, port in zip("ab", ports):
        args = launch_args(etcd_endpoint, run_id, name, nnodes="2", nproc=1, steps=100_000, step_sleep=0.1,
                           # 256 MiB cannot be all-reduced in 10 ms on any machine: the probe fails for certain (with
                           # the default 4 MiB, two agents that start their probes together can finish in time)
                           extra=["--probe-timeout", "0.01", "--probe-bytes", str(256 << 20)])
        started.append(Node(with_metrics_port(args, port), name=name))
    nodes.extend(started)
    for port, node in zip(ports, started):
        status, body = poll(lambda: (r := get(port, "/readyz"))[0] == 503 and r, 120, f"{node.name}: /readyz 503")
        # one line, naming the check, the round and the probe's own error
        assert body.count("\n") == 1 and body.startswith("probe failed: round "), body
        assert "collective probe" in body, body
        status, verbose = get(port, "/readyz?verbose")
        lines = verbose.splitlines()
        assert status == 503 and lines[-1] == "readyz check failed", verbose
        assert [ln.split(" ")[0] for ln in lines[:-1]] == ["[+]etcd", "[-]probe", "[+]rdma", "[+]clock"], verbose
        # liveness is untouched: the agent works, the job trains on
        assert get(port, "/livez") == (200, "ok\n")
        assert get(port, "/healthz") == (200, "ok\n")
        status, live = get(port, "/livez?verbose")
        assert status == 200 and live.startswith("[+]monitor ok: "), live
        s = scrape(port)
        assert value(s, "elastic_rt_health_check", kind="readiness", check="probe") == 0
        assert value(s, "elastic_rt_health_check", kind="liveness", check="monitor") == 1
        assert value(s, "elastic_rt_health_check", kind="readiness", check="rdma") == 1
        assert (value(s, "elastic_rt_probe_failures_total") or 0) >= 1
        assert value(s, "elastic_rt_agent_last_tick_age_seconds") is not None
    # the job trains on (steps after all of the above), never restarted for the probe (--probe-failure-action
    # report), until the test stops it as a preemption would
    checked = time.monotonic()
    _rank0(*started)[0].wait_for(r"\]:step=\d+ ", 120, after=checked)
    for n in started:
        assert not n.matches(r"restarting the worker group"), n.output[-3000:]
    for n in started:
        n.proc.send_signal(signal.SIGTERM)
    for n in started:
        assert n.wait_exit(120) == 128 + signal.SIGTERM, n.output[-3000:]
    assert sum(len(n.matches(r"stopped steps=\d+ world_size=2")) for n in started) == 1


def test_wedged_monitor_loop_fails_livez_within_its_threshold(etcd_endpoint, run_id, nodes, tmp_path):  # noqa: F811
    """The test hook (tests/chaos/wedged_agent.py) stops the monitor loop; the HTTP thread and the worker
    go on. Threshold: max(2 s floor set by the test, 50 x 0.1 s) = 5 s."""
    port, wedge = free_port(), tmp_path / "wedge"
    args = with_metrics_port(launch_args(etcd_endpoint, run_id, "a", nnodes="1", nproc=1, steps=100_000,
                                         step_sleep=0.05), port)
    n = Node(args, name="a", cmd=[sys.executable, WEDGED_AGENT, *args],
             env={"ELASTIC_RT_TEST_WEDGE_FILE": str(wedge), "ELASTIC_RT_TEST_LIVENESS_MIN_S": "2"})
    nodes.append(n)
    n.wait_for(r"step=5 ", 120)
    assert get(port, "/livez")[0] == 200
    wedge.touch()
    n.wait_for(r"wedged_agent: monitor loop stopped", 30)
    status, body = poll(lambda: (r := get(port, "/livez"))[0] == 503 and r, 5 + 30, "/livez 503")
    assert body.startswith("monitor failed: monitor loop last ticked ") and "(limit 5 s)" in body, body
    ticked_s = float(body.split("last ticked ")[1].split(" s ago")[0])
    assert ticked_s >= 5, body  # never before the threshold (the reason rounds to 0.1 s)
    assert get(port, "/healthz")[0] == 503  # the alias follows
    assert get(port, "/readyz")[0] == 200  # fitness is another question
    s = scrape(port)
    assert value(s, "elastic_rt_health_check", kind="liveness", check="monitor") == 0
    assert value(s, "elastic_rt_agent_last_tick_age_seconds") > 5
    wedge.unlink()
    poll(lambda: get(port, "/livez")[0] == 200, 30, "/livez 200 once the loop ticks again")
    resumed = time.monotonic()
    n.wait_for(r"\]:step=\d+ ", 60, after=resumed)  # the job trained through it and trains on
    n.proc.send_signal(signal.SIGTERM)  # the loop that ticks again is the one that handles the stop
    assert n.wait_exit(120) == 128 + signal.SIGTERM, n.output[-3000:]
    assert n.matches(r"stopped steps=\d+ world_size=1")
