"""Run `elastic-rt launch` processes as nodes on one machine; read their output; kill them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "launch" / "train_example.py")


class Node:
    """One agent process in a session of its own, so that killpg kills the whole node."""

    def __init__(self, args: list[str], *, name: str, env: dict | None = None, cmd: list[str] | None = None) -> None:
        self.name = name
        self.cmd = cmd or [sys.executable, "-m", "elastic_rt.cli", "launch", *args]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env=full_env, cwd=str(ROOT),
        )
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout_s: float, *, after: float = 0.0) -> re.Match:
        """First line matching `pattern` that arrived after monotonic time `after`."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for t, line in self.lines:
                    if t >= after:
                        m = rx.search(line)
                        if m:
                            return m
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: no line matching {pattern!r} within {timeout_s} s:\n"
                                       + self.output[-4000:])
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise TimeoutError(f"{self.name} exited ({self.proc.returncode}) before {pattern!r}:\n"
                                       + self.output[-4000:])
                self._cond.wait(min(left, 0.5))

    def matches(self, pattern: str) -> list[re.Match]:
        rx = re.compile(pattern)
        with self._cond:
            return [m for _, line in self.lines if (m := rx.search(line))]

    def wait_exit(self, timeout_s: float) -> int:
        """The exit code, once the agent exited and its output was read to the end (the reader
        thread may lag behind the exit on a loaded machine: its last lines would be missed)."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"{self.name} still running after {timeout_s} s:\n{self.output[-4000:]}") from exc
        self._reader.join(timeout=10)  # EOF once every holder of the pipe (workers included) is gone
        return code

    def worker_pids(self) -> list[int]:
        """The agent's workers (not its idle warm workers, which have no RANK yet)."""
        return [p for p, started in self._worker_main_children() if started]

    def warm_pids(self) -> list[int]:
        """The agent's idle warm workers (started ahead, waiting for their rank)."""
        return [p for p, started in self._worker_main_children() if not started]

    def _worker_main_children(self) -> list[tuple[int, bool]]:
        out = []
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        for c in children:
            try:
                if "elastic_rt.worker.main" in " ".join(c.cmdline()):
                    out.append((c.pid, "RANK" in c.environ()))
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def worker_pid(self, local_rank: int, timeout_s: float = 60) -> int:
        """The pid of this node's worker with LOCAL_RANK=local_rank, polling until it runs."""
        deadline = time.monotonic() + timeout_s
        while True:
            for pid in self.worker_pids():
                try:
                    if psutil.Process(pid).environ().get("LOCAL_RANK") == str(local_rank):
                        return pid
                except psutil.Error:
                    continue
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name}: no worker with LOCAL_RANK={local_rank}:\n{self.output[-2000:]}")
            time.sleep(0.1)

    def kill_node(self) -> None:
        """SIGKILL the agent and everything in its session, like a machine that loses power."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def cleanup(self) -> None:
        """Kill the node and every descendant, including workers in sessions of their own
        (torchrun starts each worker with setsid, so killpg alone would leave them)."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        if self.proc.poll() is None:
            self.kill_node()
        for p in kids + _session_members(self.proc.pid):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def _session_members(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return out


def launch_args(endpoint: str, run_id: str, node_id: str, *, nnodes: str, nproc: int = 2,
                steps: int = 40, step_sleep: float = 0.1, extra: list[str] | None = None,
                job_args: list[str] | None = None) -> list[str]:
    return [
        "--nnodes", nnodes, "--nproc-per-node", str(nproc),
        "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--node-id", node_id,
        "--local-addr", "127.0.0.1", "--metrics-port", "0", "--tee", "3",
        "--rdzv-conf", "last_call_timeout=3",
        *(extra or []),
        EXAMPLE, "--steps", str(steps), "--step-sleep", str(step_sleep), *(job_args or []),
    ]
