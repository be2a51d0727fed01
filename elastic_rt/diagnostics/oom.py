"""Evidence that the kernel's OOM killer killed a worker: its record in /dev/kmsg, or its cgroup's oom_kill count."""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from typing import Callable

log = logging.getLogger(__name__)

# "Memory cgroup out of memory: Killed process 15952 (python3) total-vm:..." and
# "oom-kill:constraint=CONSTRAINT_MEMCG,...,task=python3,pid=15952,uid=0" (kernel >= 4.19)
_KILLED = re.compile(rb"(?:Killed process|oom-kill:.*?,pid=)\s*(\d+)")
_KEEP_PIDS = 4096


class KernelLog:
    """Reads new /dev/kmsg records (root or CAP_SYSLOG) and remembers the pids the OOM killer killed.

    Opened once by the agent, positioned at the end: only kills after that are seen.
    Unreadable (container without /dev/kmsg, dmesg_restrict) -> available is False.
    """

    def __init__(self, path: str = "/dev/kmsg", *, skip_existing: bool = True) -> None:
        self.path = path
        self._fd: int | None = None
        self._killed: dict[int, str] = {}
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            log.debug("%s unreadable (%s): OOM kills are told by cgroup counters only", path, exc)
            return
        if skip_existing:
            os.lseek(fd, 0, os.SEEK_END)  # /dev/kmsg: after the last record
        self._fd = fd

    @property
    def available(self) -> bool:
        return self._fd is not None

    def _drain(self) -> None:
        if self._fd is None:
            return
        while True:
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records were overwritten before we read them: go on
                    continue
                return
            if not record:
                return
            for line in record.splitlines():
                m = _KILLED.search(line)
                if m:
                    self._killed[int(m.group(1))] = line.split(b";", 1)[-1].decode("utf-8", "replace")[:200]
            while len(self._killed) > _KEEP_PIDS:
                self._killed.pop(next(iter(self._killed)))

    def oom_killed(self, pid: int) -> str | None:
        """The kernel's line about the OOM kill of `pid`, or None."""
        self._drain()
        return self._killed.get(pid)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _oom_kill_count(path: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


class CgroupOomCounters:
    """oom_kill counters of the memory cgroups workers run in (v2 memory.events, v1 memory.oom_control).

    snapshot(pid) at worker start; increased(pid) after it died says whether an OOM kill
    happened in its cgroup meanwhile (not which process: kmsg tells that).
    """

    def __init__(self, *, cgroup_root: str = "/sys/fs/cgroup", proc_root: str = "/proc") -> None:
        self._root = cgroup_root
        self._proc = proc_root
        self._baseline: dict[int, tuple[str, int]] = {}

    def counter_file(self, pid: int) -> str | None:
        """The oom_kill counter file of the memory cgroup `pid` is in, or None."""
        try:
            with open(os.path.join(self._proc, str(pid), "cgroup")) as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        candidates = []
        for line in lines:
            hid, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            rel = path.lstrip("/")
            if "memory" in controllers.split(","):  # cgroup v1 memory hierarchy
                candidates.append(os.path.join(self._root, "memory", rel, "memory.oom_control"))
            elif hid == "0" and controllers == "":  # cgroup v2 unified hierarchy
                candidates += [os.path.join(self._root, rel, "memory.events"),
                               os.path.join(self._root, "unified", rel, "memory.events")]
        return next((c for c in candidates if _oom_kill_count(c) is not None), None)

    def snapshot(self, pid: int) -> None:
        path = self.counter_file(pid)
        if path is not None:
            self._baseline[pid] = (path, _oom_kill_count(path) or 0)

    def increased(self, pid: int) -> str | None:
        """'<file>: oom_kill a -> b' when the counter rose since snapshot(pid), else None."""
        entry = self._baseline.get(pid)
        if entry is None:
            return None
        path, before = entry
        now = _oom_kill_count(path)
        if now is not None and now > before:
            return f"{path}: oom_kill {before} -> {now}"
        return None

    def forget(self) -> None:
        self._baseline.clear()


class OomEvidence:
    """Both sources together: the kernel log names the pid; the cgroup counter is the fallback."""

    def __init__(self, *, kernel_log: KernelLog | None = None, cgroups: CgroupOomCounters | None = None,
                 settle_s: float = 0.1, sleep: Callable[[float], None] = time.sleep) -> None:
        self.kernel_log = kernel_log if kernel_log is not None else KernelLog()
        self.cgroups = cgroups if cgroups is not None else CgroupOomCounters()
        self._settle_s = settle_s
        self._sleep = sleep

    def on_worker_started(self, pid: int) -> None:
        self.cgroups.snapshot(pid)

    def for_pid(self, pid: int) -> str | None:
        """How we know `pid` was OOM-killed (None: no evidence). Call for SIGKILLed workers only:
        the kernel logs the kill right after sending SIGKILL, so the record may trail the exit."""
        waited = 0.0
        while True:
            line = self.kernel_log.oom_killed(pid)
            if line:
                return f"kernel log: {line}"
            if not self.kernel_log.available or waited >= self._settle_s:
                break
            self._sleep(0.05)
            waited += 0.05
        counted = self.cgroups.increased(pid)
        return f"cgroup {counted}" if counted else None

    def close(self) -> None:
        self.kernel_log.close()
