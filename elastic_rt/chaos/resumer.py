"""The detached resumer of a chaos pause: a process in a session of its own that sends SIGCONT to the paused
processes at the pause's deadline, so that a pause always ends even when the command that paused them is killed
(SIGKILL, a closed terminal's SIGHUP)."""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import psutil

from elastic_rt.chaos.processes import RefusedError


def fault_line(action: str, *, run_id: str, node: str | None, pids: list[int], **extra) -> str:
    """One JSON line: time (UTC, ISO 8601), action, run id, node, target pids and details."""
    record = {
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "action": action, "run_id": run_id, "node": node, "host": socket.gethostname(), "pids": pids,
    }
    record.update(extra)
    return json.dumps(record, sort_keys=False)


@dataclass(frozen=True, kw_only=True)
class Target:
    """A process as found: its pid and start time (a pid reused by another process is never signalled)."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, p: psutil.Process) -> Target:
        return cls(pid=p.pid, create_time=p.create_time())

    def encode(self) -> str:
        return f"{self.pid}:{self.create_time!r}"

    @classmethod
    def decode(cls, text: str) -> Target:
        pid, _, created = text.partition(":")
        return cls(pid=int(pid), create_time=float(created))

    def process(self) -> psutil.Process | None:
        """The process, if it is still the one found."""
        try:
            p = psutil.Process(self.pid)
            return p if p.create_time() == self.create_time else None
        except psutil.NoSuchProcess:
            return None

    def running(self) -> bool:
        """Still the process found, and not a zombie (killed, not yet reaped by its parent)."""
        p = self.process()
        try:
            return p is not None and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def start_resumer(targets: list[psutil.Process], *, run_id: str, node: str | None, action: str,
                  ready_timeout_s: float = 30.0) -> subprocess.Popen:
    """Start the resumer for `targets` and wait until it runs; arm() then gives it the deadline. When it resumes
    them after this command is gone, it prints the `resume` line to this command's stdout. RefusedError when it
    did not start: pause nothing then."""
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "elastic_rt.chaos.resumer", "--parent", Target.of(psutil.Process()).encode(), "--ready-fd", str(write_fd), "--run-id", run_id,
           "--node", node or "", "--after", action,
           *[arg for p in targets for arg in ("--target", Target.of(p).encode())]]
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True,
                                close_fds=True)
    finally:
        os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], ready_timeout_s)
        if not ready or os.read(read_fd, 1) != b"r":
            proc.kill()
            proc.wait()
            raise RefusedError("the resumer that ends the pause at its deadline did not start; nothing paused")
    finally:
        os.close(read_fd)
    return proc


def arm(proc: subprocess.Popen, deadline: float) -> None:
    """The targets are stopped: SIGCONT at `deadline` (time.monotonic(), one clock for every process of the host).
    A resumer whose stdin closes before this (this command killed just after its SIGSTOP) resumes at once."""
    try:
        proc.stdin.write(f"{deadline!r}\n".encode())
        proc.stdin.close()
    except OSError:  # the resumer is gone: this command resumes them itself
        pass


def stop_resumer(proc: subprocess.Popen) -> None:
    """The pause ended here: the resumer is not needed (it is this command's own child)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def resume(targets: list[Target]) -> list[int]:
    """SIGCONT to each target that is still the process found; the pids signalled."""
    done = []
    for t in targets:
        p = t.process()
        if p is None:
            continue
        try:
            p.send_signal(signal.SIGCONT)
            done.append(t.pid)
        except psutil.NoSuchProcess:
            continue
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elastic-rt-chaos-resumer")
    p.add_argument("--parent", type=Target.decode, required=True)
    p.add_argument("--target", type=Target.decode, action="append", default=[])
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--node", default="")
    p.add_argument("--after", required=True)
    args = p.parse_args(argv)
    for sig in (signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    os.write(args.ready_fd, b"r")
    os.close(args.ready_fd)
    try:
        deadline = float(sys.stdin.readline())
    except ValueError:  # stdin closed without a deadline: the command was killed right after its SIGSTOP
        deadline = time.monotonic()
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 1.0))
    pids = resume(args.target)
    if not args.parent.running():  # the command that paused them is gone: say it in its place
        line = fault_line("resume", run_id=args.run_id, node=args.node or None, pids=sorted(pids), after=args.after,
                          early=False, by="resumer")
        try:
            print(line, flush=True)
        except OSError:  # nobody reads that stdout any more
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
