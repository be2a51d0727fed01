"""Python stacks of stuck workers: faulthandler on a reserved signal in the worker, collection into the log dir by the agent.

Worker side (the entry point): faulthandler writes the stacks of every thread to a
per-worker file when the reserved signal arrives. faulthandler's handler runs in C,
so it works while the main thread is blocked in a collective and even while another
thread holds the GIL. If the script installs its own handler for that signal, its
handler wins: the worker marks the signal as taken and the agent stops sending it.

Agent side: before a hang restart kills the workers (and when SIGTERM's grace runs
out), the agent sends the signal to each worker that can answer, waits briefly for
the dumps, and writes one file per rank with the process state, the kernel's view
(wchan, kernel stack when readable) and the Python stacks.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import psutil

log = logging.getLogger(__name__)

DEFAULT_STACK_SIGNAL = "SIGRTMIN+6"  # see docs/failures.md: free in glibc, torch, Slurm and Lightning
_TAKEN_SUFFIX = ".taken"
EXITED = ("zombie", "dead", "gone")  # process_state()s of a process that will never write again
UNANSWERABLE = ("stopped", "tracing-stop", "disk-sleep", *EXITED)  # cannot run a handler
_worker_file: Any = None  # kept open for faulthandler for the life of the worker


def parse_signal(text: str) -> int | None:
    """'SIGRTMIN+6', 'SIGUSR2', '12' -> a signal number; 'off', '0', '' -> None."""
    text = (text or "").strip().upper()
    if text in ("", "0", "OFF", "NONE"):
        return None
    if text.isdigit():
        return int(text)
    base, plus, offset = text.partition("+")
    if not base.startswith("SIG"):
        base = "SIG" + base
    num = int(getattr(signal, base))  # AttributeError for an unknown name: the caller reports it
    return num + (int(offset) if plus else 0)


def raw_path(directory: str, local_rank: int) -> str:
    """Where the worker of `local_rank` has faulthandler write its dumps."""
    return os.path.join(directory, f"stacks-{local_rank}")


# ---- worker side -------------------------------------------------------------------------
def install_in_worker(sig: int, path: str) -> bool:
    """Register faulthandler for `sig`, writing to `path`; watch for the script taking `sig` over."""
    global _worker_file
    previous = signal.getsignal(sig)
    try:
        f = open(path, "w")
        f.write(f"# stacks of pid {os.getpid()}\n")
        f.flush()
        # chain=True re-raises into the previous handler; with none (SIG_DFL) that would kill us.
        faulthandler.register(sig, file=f, all_threads=True,
                              chain=previous not in (signal.SIG_DFL, signal.SIG_IGN))
    except (OSError, ValueError, RuntimeError) as exc:
        log.debug("stack dumps on signal %s unavailable: %s", sig, exc)
        return False
    _worker_file = f
    original = signal.signal

    def signal_guard(signalnum, handler):
        if signalnum == sig:  # the script wants this signal: let it have it, and tell the agent
            try:
                faulthandler.unregister(sig)
                with open(path + _TAKEN_SUFFIX, "w") as marker:
                    marker.write(f"{os.getpid()}\n")
            except OSError:
                pass
        return original(signalnum, handler)

    signal.signal = signal_guard
    return True


# ---- agent side --------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class WorkerRef:
    """One worker the agent may ask for its stacks."""

    local_rank: int
    global_rank: int
    pid: int
    raw_path: str


def _catches(pid: int, sig: int, proc_root: str = "/proc") -> bool:
    """Whether `pid` has a handler for `sig` (SigCgt in /proc/<pid>/status): sending a real-time
    signal to a process without one would kill it."""
    try:
        with open(os.path.join(proc_root, str(pid), "status")) as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def _read(path: str, limit: int = 8192) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read(limit).strip()
    except OSError as exc:
        return f"<unreadable: {exc.strerror or exc}>"


def _read_from(path: str, offset: int) -> str:
    """A worker's raw stacks file from `offset` (the size before this request) on."""
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def process_state(pid: int) -> str:
    """psutil's status ('running', 'sleeping', 'disk-sleep', 'stopped', ...) or 'gone'."""
    try:
        return psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return "gone"
    except psutil.AccessDenied:
        return "unknown"


class StackCollector:
    """Asks workers for their Python stacks and writes one file per rank under `root`."""

    def __init__(self, *, root: str, sig: int | None, wait_s: float = 3.0, settle_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 py_spy: str | None = None) -> None:
        self.root = root
        self.sig = sig
        self._wait_s = wait_s
        self._settle_s = settle_s
        self._clock = clock
        self._sleep = sleep
        self._py_spy = py_spy if py_spy is not None else (shutil.which("py-spy") or "")

    def collect(self, workers: Iterable[WorkerRef], *, label: str, notes: dict[int, str] | None = None) -> str:
        """Dump every worker's stacks into a new directory `<root>/<UTC time>-<label>`; returns it. A dump that
        cannot be written there (a full or read-only log dir) goes to the log instead; then the directory
        returned says so ("<dir> (not written: ...; in the log)"). Never raises OSError."""
        workers = sorted(workers, key=lambda w: w.global_rank)
        out_dir = os.path.join(self.root, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{label}")
        unwritable = ""
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as exc:
            unwritable = exc.strerror or str(exc)
        states = {w.pid: process_state(w.pid) for w in workers}
        asked: dict[int, int] = {}  # pid -> raw file size before the request
        why_not: dict[int, str] = {}
        for w in workers:
            reason = self._cannot_ask(w, states[w.pid])
            if reason:
                why_not[w.pid] = reason
                continue
            try:
                asked[w.pid] = os.path.getsize(w.raw_path)
                os.kill(w.pid, self.sig)
            except OSError as exc:
                why_not[w.pid] = f"could not signal it: {exc.strerror or exc}"
                asked.pop(w.pid, None)
        dumps, exited = self._wait_for(asked, {w.pid: w.raw_path for w in workers})
        for w in workers:
            body = dumps.get(w.pid)
            if body is None and w.pid in exited:
                body = "(no Python stacks: the process exited before it answered)\n"
            elif body is None:
                body = f"(no Python stacks: {why_not.get(w.pid, 'no dump within %g s' % self._wait_s)})\n"
                body += self._py_spy_dump(w.pid)
            header = [
                f"rank {w.global_rank} (local rank {w.local_rank}) pid {w.pid}",
                f"process state: {states[w.pid]}",
                f"wchan: {_read(f'/proc/{w.pid}/wchan')}",
            ]
            if notes and w.local_rank in notes:
                header.append(notes[w.local_rank])
            kernel = _read(f"/proc/{w.pid}/stack")
            text = "\n".join(header) + f"\nkernel stack:\n{kernel}\n\n{body}"
            path = os.path.join(out_dir, f"rank{w.global_rank}-local{w.local_rank}-pid{w.pid}.txt")
            if not unwritable:
                try:
                    with open(path, "w") as f:
                        f.write(text)
                    continue
                except OSError as exc:
                    unwritable = exc.strerror or str(exc)
            log.warning("stacks of rank %d (%s could not be written: %s):\n%s", w.global_rank, path, unwritable, text)
        return f"{out_dir} (not written: {unwritable}; in the log)" if unwritable else out_dir

    def _cannot_ask(self, w: WorkerRef, state: str) -> str:
        if self.sig is None:
            return "stack dumps are off (--stack-signal off)"
        if state in UNANSWERABLE:
            return f"the process is {state}: it cannot run a signal handler"
        if os.path.exists(w.raw_path + _TAKEN_SUFFIX):
            return f"the script installed its own handler for signal {self.sig}"
        if not os.path.exists(w.raw_path):
            return f"no stack handler for signal {self.sig} in this process (not started by the worker entry point?)"
        if not _catches(w.pid, self.sig):  # Python's shutdown removes faulthandler's handlers
            return f"its handler for signal {self.sig} is gone: the process is shutting down"
        return ""

    def _wait_for(self, asked: dict[int, int], paths: dict[int, str]) -> tuple[dict[int, str], set[int]]:
        """(new text in each asked worker's raw file, once it stopped growing; the asked workers that exited
        without answering). Ends when every worker answered or exited, or at the deadline: a worker that outlived
        SIGTERM's grace is often on its way out (saving, tearing down), and waiting the whole wait_s for one that
        is gone would hold the restart, and the round every other node waits on, for nothing."""
        deadline = self._clock() + self._wait_s
        sizes = dict(asked)
        stable_since: dict[int, float] = {}
        done: dict[int, str] = {}
        exited: set[int] = set()
        while asked and len(done) + len(exited) < len(asked):
            now = self._clock()
            for pid, before in asked.items():
                if pid in done or pid in exited:
                    continue
                gone = process_state(pid) in EXITED  # read before the size: then the file is final
                try:
                    size = os.path.getsize(paths[pid])
                except OSError:
                    if gone:
                        exited.add(pid)
                    continue
                if gone:
                    if size > before:
                        done[pid] = _read_from(paths[pid], before)
                    else:
                        exited.add(pid)
                    continue
                if size > before and size == sizes[pid]:
                    if now - stable_since.setdefault(pid, now) >= self._settle_s:
                        done[pid] = _read_from(paths[pid], before)
                else:
                    sizes[pid] = size
                    stable_since.pop(pid, None)
            if now >= deadline:
                break
            self._sleep(0.05)
        return done, exited

    def _py_spy_dump(self, pid: int) -> str:
        if not self._py_spy:
            return ""
        try:
            out = subprocess.run([self._py_spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True,
                                 text=True, timeout=10)
            return f"\npy-spy dump --nonblocking:\n{out.stdout or out.stderr}"
        except (OSError, subprocess.SubprocessError) as exc:
            return f"\npy-spy failed: {exc}\n"
