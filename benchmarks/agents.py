"""Agents for a benchmark: `elastic-rt launch` processes in sessions of their own, their output lines with
arrival times, a wait for a line, and a kill of everything they started (workers carry a tag)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN_SCRIPT = os.path.join(ROOT, "tests", "chaos", "scripts", "plain_ddp_steps.py")
TAG_ENV = "ELASTIC_RT_BENCH_TAG"


class Agent:
    """One `elastic-rt launch ARGS` process; every process it starts inherits TAG_ENV=tag."""

    def __init__(self, args: list[str], *, tag: str, cmd_prefix: list[str] | None = None) -> None:
        self.tag = tag
        cmd = [*(cmd_prefix or []), sys.executable, "-m", "elastic_rt.cli", "launch", *args]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT, **{TAG_ENV: tag}),
                                     start_new_session=True, errors="replace")
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float, *, after: float = 0.0) -> tuple[float, re.Match] | None:
        """(arrival time, match) of the first line matching `pattern` that arrived after `after`; None on
        timeout or when the agent exited without it."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for t, line in self.lines:
                    if t >= after and (m := rx.search(line)):
                        return t, m
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    return None
                self._cond.wait(min(left, 0.5))

    def count(self, pattern: str, *, after: float = 0.0, before: float = float("inf")) -> int:
        rx = re.compile(pattern)
        with self._cond:
            return sum(1 for t, line in self.lines if after <= t < before and rx.search(line))

    def text(self) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines)

    def kill(self) -> None:
        """SIGKILL the agent's session and every process carrying its tag (workers have sessions of their own)."""
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get(TAG_ENV) == self.tag:
                    p.kill()
            except (psutil.Error, OSError):
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._reader.join(10)
