"""A lease that lapsed says whose silence it was: a process that did not run, or an etcd that did not renew.

Real etcd, real processes: a node whose process is really stopped (SIGSTOP) past its lease's TTL, and a node whose
lease a peer revokes while its keep-alives go out on time.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig
from elastic_rt.rendezvous.etcd_reachability import EtcdHealth
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.lease import NodeLease

TTL_S = 2.0

_CHILD = textwrap.dedent("""
    import json, sys, time
    from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig
    from elastic_rt.rendezvous.etcd_reachability import EtcdHealth
    from elastic_rt.rendezvous.keys import RunKeys
    from elastic_rt.rendezvous.lease import NodeLease

    host, port, run_id, ttl = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    client = EtcdClient(EtcdConfig(endpoints=((host, port),), request_timeout_s=10.0))
    lease = NodeLease(client, RunKeys(run_id), "n0", ttl_s=ttl, info={"addr": "127.0.0.1"},
                      health=EtcdHealth(node_id="n0"), local_addr="127.0.0.1",
                      on_beat=lambda: print("beat", flush=True))
    lease.start()
    deadline = time.monotonic() + 60
    while not lease.lapses and time.monotonic() < deadline:
        time.sleep(0.05)
    lapse = lease.lapses[0] if lease.lapses else None
    print(json.dumps(None if lapse is None else {"cause": lapse.cause, "silence": lapse.longest_silence_s,
                                                 "unrenewed": lapse.unrenewed_s, "beats": lapse.beats,
                                                 "said": lapse.describe()}), flush=True)
    lease.stop(revoke=True)
    client.close()
""")


def _lines(proc: subprocess.Popen) -> queue.Queue:
    out: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [out.put(line.strip()) for line in proc.stdout], daemon=True).start()
    return out


def _next(out: queue.Queue, want, timeout_s: float) -> str:
    """The first line that `want` accepts, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        line = out.get(timeout=max(0.01, deadline - time.monotonic()))
        if want(line):
            return line


def _client(host: str, port: int) -> EtcdClient:
    return EtcdClient(EtcdConfig(endpoints=((host, port),), request_timeout_s=10.0))


def _node_lease(client: EtcdClient, run_id: str, on_beat, **kw) -> NodeLease:
    """Node n0's lease at TTL_S through `client`; each confirmed beat calls `on_beat`."""
    return NodeLease(client, RunKeys(run_id), "n0", ttl_s=TTL_S, info={"addr": "127.0.0.1"},
                     health=EtcdHealth(node_id="n0"), local_addr="127.0.0.1", on_beat=on_beat, **kw)


def _first_lapse(lease: NodeLease, timeout_s: float, why: str):
    """The lease's first lapse, once it has one (within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not lease.lapses and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lease.lapses, why
    return lease.lapses[0]


def _gone(etcd_client, key: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if etcd_client.get(key)[0] is None:
            return True
        time.sleep(0.05)
    return False


def test_a_lapse_while_the_process_was_stopped_is_put_on_the_process(etcd_server, etcd_client, run_id):
    m = etcd_server.members[0]
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, m.host, str(m.client_port), run_id, str(TTL_S)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out = _lines(proc)
        for _ in range(2):
            _next(out, lambda line: line == "beat", 30)  # its lease is kept alive
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            assert _gone(etcd_client, RunKeys(run_id).alive("n0"), TTL_S + 10), "the stopped node's lease did not lapse"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        stopped_for = time.monotonic() - stopped
        lapse = json.loads(_next(out, lambda line: line != "beat", 30))
        assert lapse is not None, "the lease was not found gone after the process ran again"
        assert lapse["cause"] == "process", lapse
        assert TTL_S <= lapse["silence"] <= stopped_for + 2 * TTL_S, (lapse, stopped_for)
        assert "did not run" in lapse["said"]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_lapse_of_a_lease_revoked_while_beats_went_on_time_is_put_on_etcd(etcd_server, etcd_client, run_id):
    m = etcd_server.members[0]
    client = _client(m.host, m.client_port)
    beats = threading.Semaphore(0)
    lease = _node_lease(client, run_id, beats.release)
    try:
        first = lease.start()
        for _ in range(2):
            assert beats.acquire(timeout=30), "no beat confirmed"
        etcd_client.revoke_lease(first)
        lapse = _first_lapse(lease, 30, "the revoked lease was not found gone")
        assert lapse.cause == "etcd" and lapse.longest_silence_s < TTL_S and lapse.beats >= 1, lapse
        assert "etcd did not renew them" in lapse.describe()
        assert lease.lease_id not in (0, first), "the node did not register again under a new lease"
    finally:
        lease.stop(revoke=True)
        client.close()


@pytest.mark.parametrize("finder", ["lease thread", "another thread"])
def test_a_lapse_while_the_lease_thread_was_held_in_a_callback_is_put_on_the_thread(etcd_server, run_id, finder):
    """A beat's callback (the agent's on_beat: the run lease, the view) that blocks past the TTL holds the lease
    thread: the lapse says so, not that the process did not run; also when another thread finds the lapse (the
    rendezvous, told 'lease not found', calls check_now()) while the lease thread is still held."""
    m = etcd_server.members[0]
    client = _client(m.host, m.client_port)
    beats, released = threading.Semaphore(0), threading.Event()
    hold = {"armed": False}

    def on_beat() -> None:
        beats.release()
        if hold["armed"]:
            hold["armed"] = False
            released.wait(TTL_S + 10)  # until the test has seen the lease run out

    lease = _node_lease(client, run_id, on_beat)
    try:
        lease.start()
        assert beats.acquire(timeout=30), "no beat confirmed"
        hold["armed"] = True
        assert beats.acquire(timeout=30), "no beat confirmed"  # this one's callback holds the thread
        checker = _client(m.host, m.client_port)
        try:
            assert _gone(checker, RunKeys(run_id).alive("n0"), TTL_S + 10), "the held node's lease did not lapse"
            if finder == "another thread":
                lease.check_now()  # the lease thread is still in its callback
        finally:
            released.set()
            checker.close()
        lapse = _first_lapse(lease, 30, "the lapsed lease was not found gone")
        assert lapse.cause == "held" and max(lapse.held_s, lapse.stuck_s) >= TTL_S - 1 and lapse.late_s < 1.0, lapse
        assert "its lease thread was held" in lapse.describe()
    finally:
        released.set()
        lease.stop(revoke=True)
        client.close()


def test_a_lapse_while_the_lease_thread_backed_off_is_put_on_the_backoff(etcd_server, run_id):
    """etcd receives every keep-alive but answers 2 s late: the lease thread gives the member up after 1.5 beats and
    backs off (here 4 s, past the TTL) before the next beat, so the lease runs out: the lapse names the backoff."""
    from elastic_rt.chaos.proxy import TcpProxy
    from elastic_rt.rendezvous.etcd_reachability import Backoff

    m = etcd_server.members[0]
    beats = threading.Semaphore(0)
    with TcpProxy(m.host, m.client_port) as proxy:
        client = _client(proxy.listen_host, proxy.port)
        lease = _node_lease(client, run_id, beats.release, backoff=Backoff(base_s=4.0, cap_s=4.0, rng=lambda: 1.0))
        try:
            lease.start()
            assert beats.acquire(timeout=30), "no beat confirmed"
            proxy.delay(2.0, answers_only=True)
            lapse = _first_lapse(lease, 60, "the lease did not lapse while its thread backed off past the TTL")
            assert lapse.cause == "backoff" and lapse.backoff_s >= TTL_S, lapse
        finally:
            proxy.delay(0.0)
            lease.stop(revoke=True)
            client.close()
