"""stop_tree on real process trees: grandchildren, SIGTERM ignored, children born during the grace period."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from elastic_rt.agent.process_tree import collect_tree, kill_tree, stop_tree

# A worker that starts a grandchild ignoring SIGTERM, prints both pids, and on SIGTERM starts
# one more child (as a DataLoader respawning its workers would) before it exits.
WORKER = r"""
import os, signal, subprocess, sys, time
IGNORE = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
def child():
    p = subprocess.Popen([sys.executable, "-c", IGNORE], stdout=subprocess.PIPE, text=True)
    p.stdout.readline()
    return p
first = child()
def on_term(*_):
    late = subprocess.Popen([sys.executable, "-c", IGNORE], stdout=subprocess.DEVNULL)
    print(late.pid, flush=True)
    time.sleep(600)  # ignore the SIGTERM itself: only SIGKILL ends this worker
signal.signal(signal.SIGTERM, on_term)  # before the pids are printed: the test signals as soon as it reads them
print(os.getpid(), first.pid, flush=True)
time.sleep(600)
"""


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@pytest.fixture
def worker():
    proc = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    yield proc
    for p in collect_tree([proc.pid]):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue
    proc.wait(timeout=30)


def test_kill_tree_kills_the_tree_and_leaves_the_exit_code_to_its_parent(worker):
    root, grandchild = (int(x) for x in worker.stdout.readline().split())
    assert sorted(kill_tree([root])) == sorted([root, grandchild])
    assert worker.wait(timeout=30) == -signal.SIGKILL  # not reaped by kill_tree: the code is still ours
    assert wait_gone([grandchild]) == []


def test_stop_tree_kills_grandchildren_and_children_born_during_the_grace_period(worker):
    root, grandchild = (int(x) for x in worker.stdout.readline().split())
    killed = stop_tree([root], sig=signal.SIGTERM, grace_s=3.0)
    line = worker.stdout.readline()
    assert line.strip(), "the SIGTERM handler did not start its child within the grace"
    late = int(line)  # started by the SIGTERM handler, during the grace
    worker.wait(timeout=30)
    assert wait_gone([root, grandchild, late]) == []
    assert {root, grandchild, late} <= set(killed)


def test_no_grace_kills_at_once(worker):
    root, grandchild = (int(x) for x in worker.stdout.readline().split())
    killed = stop_tree([root], sig=signal.SIGKILL, grace_s=0.0)
    worker.wait(timeout=30)
    assert wait_gone([root, grandchild]) == []
    assert set(killed) == {root, grandchild}


def test_an_exited_root_is_not_looked_up_again_by_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    handle = psutil.Process(proc.pid)
    proc.wait(timeout=30)  # reaped: the pid is free for anyone now
    assert collect_tree([handle]) == []
    assert stop_tree([handle], grace_s=0.0) == []
    assert stop_tree([proc.pid], grace_s=0.0) == []


def test_the_capture_hands_back_the_given_process_objects():
    """The grace-period pass signals through these objects, which psutil ties to (pid, create
    time), so they must be the caller's own, not new lookups of the same pids."""
    me = psutil.Process(os.getpid())
    assert collect_tree([me])[0] is me
