"""The worker entry point, in real processes: optimizer steps are progress, errors are recorded without
@record, stacks come on the reserved signal, flight recorder dumps come on request (gloo)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from elastic_rt.diagnostics import flight_recorder as fr
from elastic_rt.diagnostics.failures import read_error_file, user_frame
from elastic_rt.diagnostics.stacks import StackCollector, WorkerRef, parse_signal, raw_path
from etcd_testbed.server import free_port
from elastic_rt.worker_reports.heartbeat import read_heartbeat
from elastic_rt.worker_env import ENV_FLIGHT_RECORDER, ENV_HEARTBEAT_DIR, ENV_STACK_SIGNAL

SIG = parse_signal("SIGRTMIN+6")


def worker(tmp_path, script: str, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    full_env = dict(os.environ, LOCAL_RANK="0", PYTHONUNBUFFERED="1", **{ENV_HEARTBEAT_DIR: str(tmp_path)},
                    **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "elastic_rt.worker.main", "--", str(path), *args],
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def wait_line(proc: subprocess.Popen, text: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {text!r} from the worker (rc {proc.poll()}): {proc.stderr.read()[-2000:]}")


def test_optimizer_steps_are_progress_and_explicit_steps_win(tmp_path):
    proc = worker(tmp_path, """
        import sys
        print("torch imported before the script:", "torch" in sys.modules)
        import torch
        from torch.optim.optimizer import _global_optimizer_post_hooks
        print("hooks:", [h.__name__ for h in _global_optimizer_post_hooks.values()])
        p = torch.nn.Parameter(torch.zeros(2))
        opt, other = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([p], lr=0.1)
        for _ in range(5):
            p.grad = torch.ones(2)
            opt.step()
            other.step()  # a second optimizer is progress but does not count steps twice
        from elastic_rt import report_step
        report_step(100)
        opt.step()
    """)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "torch imported before the script: False" in out
    assert "hooks: ['optimizer_step_hook']" in out
    beat = read_heartbeat(str(tmp_path / "worker-0"))
    # 10 optimizer steps + report_step + 1 step, then the entry point's finished record; the explicit step wins
    assert (beat.seq, beat.step, beat.finished) == (13, 100, True)


def test_progress_hook_can_be_turned_off(tmp_path):
    proc = worker(tmp_path, """
        import torch
        p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.ones(2)
        torch.optim.SGD([p], lr=0.1).step()
    """, env={"ELASTIC_RT_NO_PROGRESS_HOOK": "1"})
    assert proc.wait(timeout=120) == 0
    beat = read_heartbeat(str(tmp_path / "worker-0"))
    assert (beat.seq, beat.step, beat.finished) == (1, 0, True)  # no progress, only the finished record


def test_an_exception_is_recorded_without_record(tmp_path):
    error_file = tmp_path / "error.json"
    proc = worker(tmp_path, """
        def load(path):
            raise FileNotFoundError(path)
        load("/data/missing")
    """, env={"TORCHELASTIC_ERROR_FILE": str(error_file)})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "FileNotFoundError: /data/missing" in err  # the usual traceback, too
    rec = read_error_file(str(error_file))
    assert rec.message == "FileNotFoundError: /data/missing"
    assert user_frame(rec.callstack) == "job.py:3 in load"


def test_stacks_of_a_blocked_worker_and_a_script_that_takes_the_signal(tmp_path):
    blocked = worker(tmp_path, """
        import threading
        def wait_for_peer():
            print("ready", flush=True)
            threading.Event().wait()
        wait_for_peer()
    """, env={ENV_STACK_SIGNAL: str(SIG)})
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    taker = worker(other_dir, f"""
        import signal, threading
        signal.signal({SIG}, lambda *a: print("user handler ran", flush=True))
        print("ready", flush=True)
        threading.Event().wait()
    """, env={ENV_STACK_SIGNAL: str(SIG)})
    plain = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        for p in (blocked, taker, plain):
            wait_line(p, "ready")
        deadline = time.monotonic() + 30  # "ready" is printed just before it blocks
        while psutil.Process(blocked.pid).status() != "sleeping" and time.monotonic() < deadline:
            time.sleep(0.01)
        refs = [WorkerRef(local_rank=0, global_rank=4, pid=blocked.pid, raw_path=raw_path(str(tmp_path), 0)),
                WorkerRef(local_rank=1, global_rank=5, pid=taker.pid, raw_path=raw_path(str(other_dir), 0)),
                WorkerRef(local_rank=2, global_rank=6, pid=plain.pid, raw_path=str(tmp_path / "none"))]
        out = StackCollector(root=str(tmp_path / "stacks"), sig=SIG).collect(refs, label="hang",
                                                                          notes={0: "last step 7"})
        files = sorted(os.listdir(out))
        assert files == [f"rank4-local0-pid{blocked.pid}.txt", f"rank5-local1-pid{taker.pid}.txt",
                         f"rank6-local2-pid{plain.pid}.txt"]
        first = open(os.path.join(out, files[0])).read()
        assert "process state: sleeping" in first and "last step 7" in first
        assert "in wait_for_peer" in first and "(most recent call first)" in first
        assert "installed its own handler" in open(os.path.join(out, files[1])).read()
        assert "no stack handler" in open(os.path.join(out, files[2])).read()
        assert all(p.poll() is None for p in (blocked, taker, plain))  # nobody was killed by the signal
    finally:
        for p in (blocked, taker, plain):
            p.kill()
            p.wait()
    assert "user handler ran" not in taker.stdout.read()


def _exits_on_the_signal(tmp_path, writes: str) -> tuple[subprocess.Popen, WorkerRef]:
    """A process that catches the stack signal and exits on it, after appending `writes` to its raw file (as a
    worker on its way out after SIGTERM does: its dump may come, or it may be gone first)."""
    raw = raw_path(str(tmp_path), 0)
    open(raw, "w").close()
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, threading
        def leave(*_):
            with open({raw!r}, "a") as f:
                f.write({writes!r})
            os._exit(0)
        signal.signal({SIG}, leave)
        print("ready", flush=True)
        threading.Event().wait()
    """)], stdout=subprocess.PIPE, text=True)
    wait_line(proc, "ready")
    return proc, WorkerRef(local_rank=0, global_rank=3, pid=proc.pid, raw_path=raw)


@pytest.mark.parametrize("writes,expected", [("", "the process exited before it answered"),
                                             ("Current thread 0x1 (most recent call first):\n", "Current thread 0x1")])
def test_stacks_wait_ends_when_the_worker_exits(tmp_path, writes, expected):
    """SIGTERM's grace ran out on a worker that is exiting: the collection ends as soon as it is gone (with what it
    wrote, if anything), not at the end of wait_s, which would hold the restart and the next round."""
    proc, ref = _exits_on_the_signal(tmp_path, writes)
    now = [0.0]

    def sleep(s: float) -> None:  # the first poll found it alive: let it exit, then go on in fake time
        proc.wait(timeout=60)
        now[0] += s

    try:
        out = StackCollector(root=str(tmp_path / "stacks"), sig=SIG, wait_s=3.0, clock=lambda: now[0], sleep=sleep,
                             py_spy="").collect([ref], label="sigterm-grace-expired")
    finally:
        proc.kill()
        proc.wait()
    text = open(os.path.join(out, f"rank3-local0-pid{ref.pid}.txt")).read()
    assert expected in text and "no dump within" not in text
    assert now[0] < 3.0  # ended one poll after the exit, not at the deadline


def test_stacks_of_a_worker_whose_handler_is_gone_are_not_asked_for(tmp_path):
    """The entry point's handler was installed (its raw file exists) and is gone, as after Python's shutdown
    removed it: the signal is not sent (it would kill the process), and the file says why."""
    ref_file = raw_path(str(tmp_path), 0)
    open(ref_file, "w").close()
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        wait_line(proc, "ready")
        ref = WorkerRef(local_rank=0, global_rank=2, pid=proc.pid, raw_path=ref_file)
        out = StackCollector(root=str(tmp_path / "stacks"), sig=SIG, py_spy="").collect([ref], label="x")
        text = open(os.path.join(out, f"rank2-local0-pid{proc.pid}.txt")).read()
        assert f"its handler for signal {SIG} is gone: the process is shutting down" in text
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_flight_recorder_dump_on_request_with_gloo(tmp_path):
    proc = worker(tmp_path, """
        import sys, time, torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
        for _ in range(3):
            dist.all_reduce(torch.ones(8))
        print("ready", flush=True)
        time.sleep(600)
    """, str(free_port()), env={ENV_FLIGHT_RECORDER: "1", "TORCH_FR_BUFFER_SIZE": "100"})
    try:
        wait_line(proc, "ready")
        target = str(tmp_path / "dump.json")
        written = fr.request_dumps({fr.fifo_path(str(tmp_path), 0): target}, wait_s=30)
        assert written, proc.stderr.read()[-2000:] if proc.poll() is not None else "no dump"
        data = fr.load_dump(target)
        names = [e["profiling_name"] for e in data["entries"]]
        assert names.count("gloo:all_reduce") == 3
        # gloo marks a collective completed a moment after it returns: the last one may still show as pending
        assert re.fullmatch(r"no collective pending|pg 0 #3 gloo:all_reduce sizes \[\[8\]\]: joined by ranks \[0\]",
                            fr.summarise({0: data})), fr.summarise({0: data})
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("text,expected", [("SIGRTMIN+6", int(signal.SIGRTMIN) + 6), ("usr2", int(signal.SIGUSR2)),
                                           ("40", 40), ("off", None), ("", None)])
def test_parse_signal(text, expected):
    assert parse_signal(text) == expected
