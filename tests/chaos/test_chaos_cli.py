"""`elastic-rt chaos`: drills against a real standalone job and real processes; refusals for anything else."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from elastic_rt.chaos.cut import CutPlan, run_cut_etcd
from etcd_testbed.server import EtcdCluster, free_port
from elastic_rt.chaos.injectors import Drill
from elastic_rt.chaos.processes import Node as RunNode
from elastic_rt.chaos.processes import RefusedError, RunProcesses, parse_agent_cmdline
from elastic_rt.cli import main as cli_main
from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig
from tests.chaos.harness import ROOT, Node, launch_args

PLAIN_SCRIPT = """
import argparse, os, time
import torch, torch.distributed as dist
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int); p.add_argument("--sleep", type=float)
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
for step in range(a.steps):
    dist.all_reduce(t)
    t.fill_(1.0)
    if rank == 0:
        print(f"plain step={step}", flush=True)
    time.sleep(a.sleep)
if rank == 0:
    print(f"plain done steps={a.steps} world={dist.get_world_size()}", flush=True)
dist.destroy_process_group()
"""


def _wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)
    return value


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def job(tmp_path, run_id):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    node = Node(["--standalone", "--nproc-per-node", "2", "--rdzv-id", run_id, "--metrics-port", "0",
                 "--tee", "3", "--max-restarts", "3", "--node-id", "n0", "--monitor-interval", "0.1",
                 str(script), "--steps", "400", "--sleep", "0.05"], name="n0")
    yield node
    node.cleanup()


@pytest.mark.long  # for CI's time: test_cut_etcd_drill_cuts_and_heals_a_client_of_the_run drives the same CLI
@pytest.mark.slow
def test_pause_then_kill_worker_of_a_live_job_and_it_recovers(job, run_id, sleeper, capsys):
    job.wait_for(r"plain step=3\b", 180)
    workers = _wait(lambda: len(job.worker_pids()) == 2 and job.worker_pids(), 30, "two workers")

    # refused: a random process, a worker named under another run id, the agent as a worker
    for args in (["kill-worker", "--run-id", run_id, "--pid", str(sleeper.pid)],
                 ["kill-worker", "--run-id", run_id + "-other", "--pid", str(workers[0])],
                 ["kill-node", "--run-id", run_id + "-other", "--pid", str(job.proc.pid)],
                 ["pause-worker", "--run-id", run_id, "--pid", str(job.proc.pid)]):
        assert cli_main(["chaos", *args]) == 2, args
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith("elastic-rt chaos: error: pid ") and "refusing to touch it" in err
    assert sleeper.poll() is None and all(psutil.pid_exists(p) for p in workers)

    # pause rank 1 for 1 s: stopped while the drill waits, running again after
    pause = subprocess.Popen([sys.executable, "-m", "elastic_rt.cli", "chaos", "pause-worker", "--run-id", run_id,
                              "--rank", "1", "--duration", "1"], stdout=subprocess.PIPE, text=True,
                             cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    first = json.loads(pause.stdout.readline())
    assert first["action"] == "pause-worker" and first["rank"] == 1 and first["node"] == "n0"
    (paused,) = first["pids"]
    assert paused in workers and psutil.Process(paused).status() == psutil.STATUS_STOPPED
    rest, _ = pause.communicate(timeout=60)
    assert pause.returncode == 0 and json.loads(rest)["action"] == "resume"
    assert psutil.Process(paused).status() != psutil.STATUS_STOPPED

    assert cli_main(["chaos", "kill-worker", "--run-id", run_id, "--rank", "1"]) == 0
    (fault,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert fault["action"] == "kill-worker" and fault["run_id"] == run_id and fault["node"] == "n0"
    assert fault["pids"][0] in workers and fault["signal"] == "SIGKILL" and fault["time"].endswith("Z")
    assert job.wait_exit(300) == 0, job.output[-3000:]
    assert job.matches(r"restarting the worker group")
    assert job.matches(r"plain done steps=400 world=2")


# ---- injectors driven with a given process selection (real processes, no job) ---------------

def _fake_run(run_id: str, agent: subprocess.Popen, workers: list[subprocess.Popen], endpoints=()) -> RunProcesses:
    node = RunNode(agent=psutil.Process(agent.pid), node_id="fake", endpoints=tuple(endpoints),
                   workers=[psutil.Process(w.pid) for w in workers])
    return RunProcesses(run_id=run_id, nodes=[node])


def test_kill_node_kills_the_tree_it_was_given_and_nothing_else(run_id, sleeper):
    agent = subprocess.Popen(["sleep", "300"])
    worker = subprocess.Popen(["sleep", "300"])
    lines: list[str] = []
    try:
        pids = Drill(_fake_run(run_id, agent, [worker]), emit=lines.append).kill_node()
        assert sorted(pids) == sorted([agent.pid, worker.pid])
        assert agent.wait(30) == -9 and worker.wait(30) == -9
        assert sleeper.poll() is None
        assert json.loads(lines[0])["action"] == "kill-node"
    finally:
        for p in (agent, worker):
            p.kill()
            p.wait()


def test_pause_etcd_stops_only_the_member_serving_the_run(run_id, sleeper):
    agent = subprocess.Popen(["sleep", "300"])
    with EtcdCluster(1) as served, EtcdCluster(1) as other:
        m, o = served.members[0], other.members[0]
        run = _fake_run(run_id, agent, [], endpoints=[(m.host, m.client_port)])
        seen: list[str] = []

        def status_within(pid: int, wanted: bool, timeout_s: float = 5.0) -> str:
            """The process's status once it is (wanted=True) or is no longer (False) stopped, or at the deadline:
            the kernel applies SIGSTOP/SIGCONT asynchronously, so /proc may lag the signal by a moment."""
            deadline = time.monotonic() + timeout_s
            while True:
                status = psutil.Process(pid).status()
                if (status == psutil.STATUS_STOPPED) == wanted or time.monotonic() > deadline:
                    return status
                time.sleep(0.01)

        def emit(line: str) -> None:
            seen.append(status_within(m.proc.pid, True) if json.loads(line)["action"] == "pause-etcd" else "")

        try:
            drill = Drill(run, emit=emit)
            assert drill.pause_etcd(duration_s=0.2) == [m.proc.pid]
            assert seen[0] == psutil.STATUS_STOPPED
            assert status_within(m.proc.pid, False) != psutil.STATUS_STOPPED
            for pid, why in ((o.proc.pid, "is an etcd process but does not serve"),
                             (sleeper.pid, "is not an etcd process")):
                with pytest.raises(RefusedError, match=why):
                    drill.pause_etcd(duration_s=0.2, pids=[pid])
            assert psutil.Process(o.proc.pid).status() != psutil.STATUS_STOPPED
        finally:
            agent.kill()
            agent.wait()


def _stopped(pid: int) -> bool:
    return psutil.Process(pid).status() == psutil.STATUS_STOPPED


def _chaos(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "elastic_rt.cli", "chaos", *args], stdout=subprocess.PIPE,
                            text=True, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.slow
def test_a_sigkilled_or_hung_up_pause_etcd_still_resumes_etcd(run_id):
    """The command is SIGKILLed while etcd is stopped: its detached resumer sends SIGCONT at the deadline (and says
    so on the command's stdout). A SIGHUP (the operator's terminal closed) resumes at once, as Ctrl-C does."""
    with EtcdCluster(1) as cluster:
        m = cluster.members[0]
        agent = Node(launch_args(f"{m.host}:{m.client_port}", run_id, "a", nnodes="2"), name="a")  # waits for b
        try:
            _wait(lambda: agent.matches(r"liveness listener"), 120, "the agent registered in etcd")
            pause = _chaos("pause-etcd", "--run-id", run_id, "--duration", "4")
            first = json.loads(pause.stdout.readline())
            assert first["action"] == "pause-etcd" and first["pids"] == [m.proc.pid], first
            _wait(lambda: _stopped(m.proc.pid), 3, "etcd stopped")  # SIGSTOP lands when the kernel next runs it
            pause.kill()
            assert pause.wait(30) == -9
            last = json.loads(pause.stdout.readline())  # the resumer holds the command's stdout until it is done
            assert last["action"] == "resume" and last["by"] == "resumer" and last["pids"] == [m.proc.pid], last
            _wait(lambda: not _stopped(m.proc.pid), 30, "etcd resumed by the resumer")
            assert pause.stdout.read() == ""  # the resumer exited: nothing more

            pause = _chaos("pause-etcd", "--run-id", run_id, "--duration", "600")
            first = json.loads(pause.stdout.readline())
            _wait(lambda: _stopped(m.proc.pid), 30, "etcd stopped")
            pause.send_signal(signal.SIGHUP)
            rest, _ = pause.communicate(timeout=60)
            last = json.loads(rest)
            assert pause.returncode == 130 and last["action"] == "resume" and last["early"] is True, rest
            _wait(lambda: not _stopped(m.proc.pid), 30, "etcd resumed at the SIGHUP")
            assert not psutil.pid_exists(first["resumer_pid"])
        finally:
            agent.cleanup()


def test_cut_etcd_drill_cuts_and_heals_a_client_of_the_run(run_id, etcd_server):
    m = etcd_server.members[0]
    port = free_port()
    agent = subprocess.Popen(["sleep", "300"])
    using = threading.Event()
    using.set()
    run = _fake_run(run_id, agent, [], endpoints=[("127.0.0.1", port)])
    events: queue.Queue = queue.Queue()
    stop = threading.Event()
    plan = CutPlan(listen=("127.0.0.1", port), target=(m.host, m.client_port), mode="reset",
                   duration_s=8.0, poll_s=0.1)
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(run_cut_etcd(
        plan, run_id, emit=lambda line: events.put(json.loads(line)), stop=stop,
        find=lambda _: run if using.is_set() else RunProcesses(run_id=run_id))))
    t.start()
    client = EtcdClient(EtcdConfig(endpoints=(("127.0.0.1", port),), request_timeout_s=1.0))
    try:
        assert events.get(timeout=30)["action"] == "proxy-ready"
        cut = events.get(timeout=30)
        assert cut["action"] == "cut-etcd" and cut["pids"] == [agent.pid] and cut["node"] == "fake"
        with pytest.raises(EtcdUnavailableError):
            client.put("/cut", b"x")  # reset: refused at once, well within the 8 s cut
        assert events.get(timeout=60)["action"] == "heal-etcd"
        _wait(lambda: _put_ok(client), 30, "etcd through the healed proxy")
        using.clear()  # the run's agent is gone: the drill closes the proxy
        assert events.get(timeout=30)["action"] == "proxy-closed"
        t.join(30)
        assert result == [0]
    finally:
        stop.set()
        t.join(30)
        client.close()
        agent.kill()
        agent.wait()


def _put_ok(client: EtcdClient) -> bool:
    try:
        client.put("/cut", b"y")
        return True
    except EtcdUnavailableError:
        return False


def test_cut_etcd_refuses_when_no_agent_of_the_run_uses_the_proxy(run_id, etcd_server):
    m = etcd_server.members[0]
    plan = CutPlan(listen=("127.0.0.1", free_port()), target=(m.host, m.client_port), wait_agent_s=0.3, poll_s=0.1)
    with pytest.raises(RefusedError, match="no agent of run .* uses the proxy"):
        run_cut_etcd(plan, run_id, emit=lambda _: None, stop=threading.Event(),
                     find=lambda rid: RunProcesses(run_id=rid))


def test_agent_command_lines_are_recognised_and_wrappers_are_not():
    py = sys.executable
    info = parse_agent_cmdline([py, "-m", "elastic_rt.cli", "launch", "--rdzv-id", "r1", "--node-id", "a",
                                "--rdzv-endpoint", "h1:2379,[::1]:23", "train.py", "--rdzv-id", "nope"])
    assert info is not None and info.run_id == "r1" and info.node_id == "a"
    assert info.endpoints == (("h1", 2379), ("::1", 23))
    info = parse_agent_cmdline([py, "/venv/bin/elastic-rt", "launch", "--standalone", "x.py"])
    assert info is not None and info.run_id is None and info.endpoints == ()
    assert parse_agent_cmdline(["timeout", "9", "elastic-rt", "launch", "--rdzv-id", "r1", "x.py"]) is None
    assert parse_agent_cmdline([py, "-m", "elastic_rt.cli", "chaos", "kill-worker", "--run-id", "r1"]) is None
