"""A stale rank 0 end to end: real agents and etcd, the node hosting rank 0 SIGSTOPped while its rank 0 is
about to commit a save; the other node re-forms without it and keeps saving; the stopped rank 0 resumes."""

from __future__ import annotations

import io
import os
import re
import signal
import time
from contextlib import redirect_stderr, redirect_stdout

import psutil
import pytest

from elastic_rt.checkpoint.cli import main as ckpt_cli
from elastic_rt.checkpoint.storage import CheckpointStore
from tests.chaos.harness import ROOT, Node
from tests.chaos.test_launch_e2e import nodes  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

SCRIPT = str(ROOT / "tests" / "chaos" / "scripts" / "ckpt_fenced_job.py")
SAVE_EVERY = 5
STEPS = 40


def _node(endpoint: str, run_id: str, node_id: str, url: str, pause_file: str) -> Node:
    args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--node-id", node_id, "--local-addr", "127.0.0.1", "--metrics-port", "0", "--tee", "3",
            "--rdzv-conf", "last_call_timeout=3", SCRIPT, "--url", url, "--steps", str(STEPS),
            "--save-every", str(SAVE_EVERY), "--step-sleep", "0.05", "--pause-file", pause_file]
    return Node(args, name=node_id)


def _signal_tree(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_file(path: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)
    with open(path) as f:
        return f.read().strip()


def _wait_gone(pid: int, timeout_s: float) -> None:
    """The process exited (a zombie counts: its parent, the agent, is stopped and cannot reap it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {pid} still running {timeout_s} s after it was resumed")
        time.sleep(0.05)


def test_a_stale_rank0_resumed_mid_save_commits_nothing_and_the_new_group_checkpoints_verify(
        etcd_endpoint, run_id, tmp_path, nodes):  # noqa: F811
    url = f"file://{tmp_path}/ckpt"
    pause_file = str(tmp_path / "pause")
    with open(pause_file, "w") as f:
        f.write("2")  # rank 0 of the first group of 2 holds its first commit
    a = _node(etcd_endpoint, run_id, "a", url, pause_file)
    b = _node(etcd_endpoint, run_id, "b", url, pause_file)
    nodes.extend([a, b])
    paused_step, old_round = (int(x) for x in _wait_file(f"{pause_file}.rank0.paused", 240).split())
    # the node whose worker is global rank 0 (it prints the lines; the tee may lag behind the marker)
    deadline = time.monotonic() + 60
    start = rf"\]:start step=\d+ world_size=2 round={old_round}$"
    while not (found := [n for n in (a, b) if n.matches(start)]):
        if time.monotonic() > deadline:
            raise TimeoutError("no start line:\n" + a.output[-3000:] + "\n----\n" + b.output[-3000:])
        time.sleep(0.1)
    stale = found[0]
    survivor = b if stale is a else a
    worker = stale.worker_pid(0)
    agent_tree = [stale.proc.pid] + [p.pid for p in psutil.Process(stale.proc.pid).children(recursive=True)]
    _signal_tree(agent_tree, signal.SIGSTOP)  # the whole node freezes: agent, lease beats, workers
    try:
        # the survivor re-forms alone, resumes from the last commit before paused_step and saves past it
        m = survivor.wait_for(rf"\]:checkpoint saved step={paused_step + SAVE_EVERY} round=(\d+)", 180)
        assert int(m.group(1)) > old_round
        os.remove(pause_file)
        # rank 0 resumes first, its agent still frozen (a host waking up in any order)
        _signal_tree([worker], signal.SIGCONT)
        _wait_gone(worker, 120)
    finally:
        _signal_tree(agent_tree, signal.SIGCONT)
    refused = stale.wait_for(r"\]:checkpoint refused: (.*)$", 60).group(1)
    stale.kill_node()  # it has done what is under test; rejoining would only re-form the survivor again
    assert refused.startswith(f"saving step {paused_step} to {url} failed") and "not committing" in refused, refused
    assert survivor.wait_exit(240) == 0, survivor.output[-3000:]

    saved_by_new = {}  # step -> round of its last save, by the groups formed after the stale one
    for line in survivor.matches(r"\]:checkpoint saved step=(\d+) round=(\d+)"):
        if int(line.group(2)) > old_round:
            saved_by_new[int(line.group(1))] = int(line.group(2))
    assert paused_step in saved_by_new and max(saved_by_new) == STEPS
    store = CheckpointStore(url)
    entries = {e.step: e for e in store.list()}
    assert not [e.step for e in entries.values() if e.damaged]
    for step, rnd in saved_by_new.items():  # nothing deleted or replaced: the manifest is the new group's
        entry = entries[step]
        assert entry.committed and entry.manifest.writer.round == rnd, (step, entry)
        assert not store.verify_files(entry.data_dir(entry.manifest), entry.manifest.files), step
    # no manifest of the stale round at or after the paused step, in any generation
    assert not [(e.step, c.generation) for e in entries.values() for c in e.commits
                if e.step >= paused_step and c.manifest.writer.round == old_round]
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        assert ckpt_cli(["ckpt", "verify", url]) == 0, out.getvalue()  # what an operator runs: every file checked
    assert not re.search(r"FAILED|damaged", out.getvalue()), out.getvalue()
