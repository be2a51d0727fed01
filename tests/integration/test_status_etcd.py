"""`elastic-rt status` against real etcd and real agent endpoints, without training: rendezvous handlers form a
round (advertising their /metrics), one agent serves real metrics and health, one does not answer, one is a
spare; the errors an operator can hit are one line each."""

from __future__ import annotations

import io
import json
import socket
import threading

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from etcd_testbed.server import free_port
from elastic_rt.cli import main
from elastic_rt.metrics.metrics_observer import MetricsObserver
from elastic_rt.rendezvous.etcd_client import EtcdClient
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.registration import (
    METRICS_HOST_KEY,
    METRICS_PORT_KEY,
    create_etcd_v3_handler,
    etcd_config_from_conf,
)
from elastic_rt.worker_reports.inbox import WorkerReports
from elastic_rt.status.command import StatusOptions, show
from tests.integration.test_etcd_tls_auth import ALICE_PW, RUN_OK, _tls_conf, auth_etcd, pki, tls_etcd  # noqa: F401
from tests.support.prometheus import wait_until


def _handler(endpoint: str, run_id: str, node: str, metrics_port: int, hi: int = 2):
    conf = {"last_call_timeout": 1, METRICS_HOST_KEY: "127.0.0.1", METRICS_PORT_KEY: str(metrics_port)}
    return create_etcd_v3_handler(RendezvousParameters("etcd-v3", endpoint, run_id, 2, hi, local_addr="127.0.0.1",
                                                       node_id=node, **conf))


def _status(endpoint: str, run_id: str, **kw) -> dict:
    out = io.StringIO()
    assert show(StatusOptions(endpoint=endpoint, run_id=run_id, as_json=True, timeout_s=kw.pop("timeout_s", 5), **kw),
                out=out) == 0
    return json.loads(out.getvalue())


def test_members_a_spare_an_agent_that_does_not_answer_and_a_lost_node(etcd_endpoint, etcd_client, run_id, tmp_path):
    observer = MetricsObserver(run_id=run_id, node="a", reports=WorkerReports(str(tmp_path)), sysfs_root=None)
    port_a = observer.serve("127.0.0.1", free_port())
    silent = socket.socket()  # listens, never answers: an agent that hangs
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    a, b = _handler(etcd_endpoint, run_id, "a", port_a), _handler(etcd_endpoint, run_id, "b", free_port())
    c = _handler(etcd_endpoint, run_id, "c", silent.getsockname()[1])
    try:
        formed = [threading.Thread(target=h.next_rendezvous) for h in (a, b)]
        for t in formed:
            t.start()
        for t in formed:
            t.join(60)
        assert a.membership and b.membership, "the round of a and b did not form"
        observer.on_restart("peer_lost")
        observer.on_rendezvous(round=a.membership.round, world_size=2, nodes=2, duration_s=0.2)
        observer.on_workers_started({0: 4242})
        observer.on_tick()
        c._start()  # registered (alive/c) while the round runs at MAX 2: a spare
        etcd_client.put(RunKeys(run_id).alive("z"), b"\x80not json")  # a key elastic-rt did not write

        s = wait_until("c registered", lambda: (st := _status(etcd_endpoint, run_id, timeout_s=0.5))
                       and "c" in {n["node"] for n in st["nodes"]} and st, 30)
        nodes = {n["node"]: n for n in s["nodes"]}
        assert {n: v["state"] for n, v in nodes.items()} == {"a": "training", "b": "training", "c": "spare",
                                                             "z": "unknown"}, nodes
        assert nodes["a"]["answered"] and nodes["a"]["address"] == f"127.0.0.1:{port_a}"
        assert nodes["a"]["activity"].startswith("monitor loop ticked") and nodes["a"]["restarts"] == 1
        assert nodes["b"]["error"] == "not answering: connection refused", nodes["b"]
        assert nodes["c"]["error"] == "not answering: no answer in time", nodes["c"]
        assert any(p.startswith("node z: its key /elastic-rt/") for p in s["problems"]), s["problems"]
        assert s["last_failure"]["reason"] == "peer_lost" and s["last_failure"]["seen_by"] == ["a"]

        b.leave()  # its lease is revoked: lost from the round that still stands
        s = _status(etcd_endpoint, run_id)
        assert {n["node"]: n["state"] for n in s["nodes"]}["b"] == "lost"
    finally:
        for h in (a, b, c):
            h.leave()
            h.close()
        observer.close()
        silent.close()


def test_a_run_that_does_not_exist(etcd_endpoint, run_id, capsys):
    assert main(["status", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"elastic-rt status: error: no run {run_id!r} in etcd (nothing under /elastic-rt/{run_id}/); "
                   "check --rdzv-id and --rdzv-endpoint"]


def test_unreachable_etcd_is_one_line(capsys):
    endpoint = f"127.0.0.1:{free_port()}"
    assert main(["status", "--rdzv-endpoint", endpoint, "--rdzv-id", "job42", "--timeout", "0.5"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"elastic-rt status: error: etcd at {endpoint} is not reachable") and "Traceback" not in line


def test_a_run_of_the_torch_backend_is_refused_not_unpickled(etcd_endpoint, etcd_client, run_id, capsys):
    etcd_client.put(RunKeys(run_id).state, b"\x80\x04pickled")
    assert main(["status", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "uses --rdzv-backend etcd-v3-torch" in line


def test_watch_goes_on_while_etcd_does_not_answer():
    out = io.StringIO()
    opts = StatusOptions(endpoint=f"127.0.0.1:{free_port()}", run_id="job42", timeout_s=0.3, watch_s=0.1)
    assert show(opts, out=out, sleep=lambda _s: None, frames=2) == 0
    lines = [line for line in out.getvalue().splitlines() if line]
    assert len(lines) == 2 and all("is not reachable" in line and "trying again in 0.1 s" in line for line in lines)


@pytest.mark.parametrize("as_json", [True, False])
def test_a_finished_run(etcd_endpoint, run_id, as_json):
    a, b = (_handler(etcd_endpoint, run_id, n, free_port()) for n in "ab")
    threads = [threading.Thread(target=h.next_rendezvous) for h in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    a.shutdown()  # closes the run and leaves, as the agent does when the job succeeded
    b.leave()
    b.close()
    out = io.StringIO()
    show(StatusOptions(endpoint=etcd_endpoint, run_id=run_id, as_json=as_json), out=out)
    if as_json:
        s = json.loads(out.getvalue())
        assert s["finished"] and {n["node"]: n["state"] for n in s["nodes"]} == {"a": "finished", "b": "finished"}
    else:
        assert out.getvalue().startswith(f"run {run_id}: finished (closed)")


def test_over_tls_and_with_a_user_as_launch_takes_them(tls_etcd, auth_etcd, pki, tmp_path, capsys):  # noqa: F811
    """--rdzv-endpoint https://... with the TLS files, and a user whose role grants the run's prefix only."""
    pw = tmp_path / "pw"
    pw.write_text(ALICE_PW + "\n")
    # auth_etcd is plaintext: a user over it is allowed in so many words
    tls, user = _tls_conf(pki), {"user": "alice", "password_file": str(pw), "allow_plaintext_auth": "1"}
    for cluster, conf, run in ((tls_etcd, tls, "tls-status"), (auth_etcd, user, RUN_OK)):
        client = EtcdClient(etcd_config_from_conf(cluster.members[0].url, conf, timeout_s=5))
        try:
            client.put(RunKeys(run).round, b"0")
            client.put(RunKeys(run).alive("a"), json.dumps({"addr": "127.0.0.1", "nnodes": [1, 2]}).encode())
        finally:
            client.close()
        flags = ",".join(f"{k}={v}" for k, v in conf.items())
        assert main(["status", "--rdzv-endpoint", cluster.members[0].url, "--rdzv-id", run, "--rdzv-conf", flags,
                     "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["round"] == 0 and [n["node"] for n in s["nodes"]] == ["a"] and s["nnodes"] == [1, 2], s
    # bob's role does not cover alice's run: one line, exit 2
    bob = tmp_path / "bob"
    bob.write_text("bob-pw")
    assert main(["status", "--rdzv-endpoint", auth_etcd.members[0].url, "--rdzv-id", RUN_OK,
                 "--rdzv-conf", f"user=bob,password_file={bob},allow_plaintext_auth=1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("elastic-rt status: error: ") and "permission" in line.lower(), line
