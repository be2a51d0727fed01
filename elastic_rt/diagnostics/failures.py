"""Why did a worker fail: one cause per failure, from its exit status, its error file and the kernel's OOM record."""

from __future__ import annotations

import json
import os
import re
import signal
import sysconfig
from dataclasses import dataclass
from typing import Iterable

from elastic_rt.decisions import COLLECTIVE_PATTERNS, FailureCause

# The causes, in the order an operator reads them (elastic_rt_worker_failures_total{cause}).
CAUSES: tuple[FailureCause, ...] = tuple(FailureCause)

# Signals someone sends to end a process (kill, the OOM killer, a scheduler); the others are faults.
_TERMINATING = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}

_MEMORY_EXCEPTIONS = ("MemoryError", "OutOfMemoryError")  # torch.OutOfMemoryError is CUDA/accelerator OOM
_CUDA_OOM = re.compile(r"CUDA out of memory|CUBLAS_STATUS_ALLOC_FAILED|HIP out of memory", re.IGNORECASE)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


@dataclass(frozen=True, kw_only=True)
class ErrorRecord:
    """What a worker's error file (torchelastic's format) says."""

    message: str  # "ValueError: boom"
    callstack: str = ""  # traceback.format_exc() text

    @property
    def exc_type(self) -> str:
        return self.message.split(":", 1)[0].strip()


@dataclass(frozen=True, kw_only=True)
class ClassifiedFailure:
    """One classified worker failure."""

    cause: FailureCause
    detail: str  # the words for the log line: "ValueError: boom", "SIGSEGV", "exit code 3"
    frame: str = ""  # user-code frame that raised: "train.py:42 in step"
    collective: tuple[str, str] | None = None  # (backend, kind) when a collective backend spoke


def read_error_file(path: str | None) -> ErrorRecord | None:
    """The record in a torchelastic error file, or None (no file, not JSON, not that format)."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, str):
        return ErrorRecord(message=msg)
    if isinstance(msg, dict):
        extra = msg.get("extraInfo") or {}
        return ErrorRecord(message=str(msg.get("message", "")), callstack=str(extra.get("py_callstack", "")))
    return None


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # elastic_rt itself
    return tuple(sorted(os.path.realpath(d) + os.sep for d in dirs if d))


def user_frame(callstack: str, library_dirs: Iterable[str] | None = None) -> str:
    """'file:line in function' of the innermost frame outside the standard library, site-packages
    and elastic-rt in the last traceback of `callstack` (else the innermost frame at all)."""
    libs = tuple(library_dirs) if library_dirs is not None else _library_dirs()
    block = callstack.rsplit("Traceback (most recent call last):", 1)[-1]
    frames = [m for line in block.splitlines() if (m := _FRAME.match(line))]
    if not frames:
        return ""

    def is_library(path: str) -> bool:
        return path.startswith("<") or os.path.realpath(path).startswith(libs)

    chosen = next((m for m in reversed(frames) if not is_library(m["file"])), frames[-1])
    return f"{os.path.basename(chosen['file'])}:{chosen['line']} in {chosen['func'].strip()}"


def collective_error(text: str) -> tuple[str, str] | None:
    """(backend, kind) when `text` is a collective backend's timeout or abort message."""
    for rx, backend, kind in COLLECTIVE_PATTERNS:
        if rx.search(text):
            return backend, kind
    return None


def _collective_cause(coll: tuple[str, str]) -> FailureCause:
    return FailureCause.COLLECTIVE_TIMEOUT if coll[1] == "timeout" else FailureCause.COLLECTIVE_ERROR


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def classify(*, exitcode: int, error: ErrorRecord | None = None, oom_evidence: str | None = None,
             stderr_tail: str = "", watchdog_dumped: bool = False,
             library_dirs: Iterable[str] | None = None) -> ClassifiedFailure:
    """The cause of one failed worker.

    exitcode: as torch reports it (negative: killed by that signal). error: its error file.
    oom_evidence: how the kernel's OOM kill of this pid was established (None: no evidence).
    stderr_tail: the end of its stderr, when the agent has it (a C++ abort leaves no error file).
    watchdog_dumped: NCCL's watchdog wrote a flight recorder dump for this rank (it does so on a
    collective timeout, just before it aborts the process).
    """
    if error is not None and error.message:
        frame = user_frame(error.callstack, library_dirs) if error.callstack else ""
        coll = collective_error(error.message)
        if coll is not None:
            cause = _collective_cause(coll)
            return ClassifiedFailure(cause=cause, detail=error.message, frame=frame, collective=coll)
        if error.exc_type.rsplit(".", 1)[-1] in _MEMORY_EXCEPTIONS or _CUDA_OOM.search(error.message):
            return ClassifiedFailure(cause=FailureCause.OOM, detail=error.message, frame=frame)
        return ClassifiedFailure(cause=FailureCause.EXCEPTION, detail=error.message, frame=frame)
    signum = -exitcode if exitcode < 0 else None
    via_shell = ""
    if signum is None and 128 < exitcode <= 128 + 64:
        signum, via_shell = exitcode - 128, f" (exit code {exitcode}: killed under a shell)"
    if signum is not None:
        name = signal_name(signum) + via_shell
        if signum == signal.SIGKILL and oom_evidence:
            return ClassifiedFailure(cause=FailureCause.OOM,
                                     detail=f"SIGKILL by the kernel OOM killer ({oom_evidence})")
        if signum in _TERMINATING:
            return ClassifiedFailure(cause=FailureCause.KILLED, detail=f"{name} from outside the agent")
        coll = collective_error(stderr_tail) if stderr_tail else None
        if coll is not None:
            cause = _collective_cause(coll)
            return ClassifiedFailure(cause=cause, detail=f"{name} after: {_last_match_line(stderr_tail)}",
                                     collective=coll)
        if signum == signal.SIGABRT and watchdog_dumped:
            return ClassifiedFailure(
                cause=FailureCause.COLLECTIVE_TIMEOUT, collective=("nccl", "timeout"),
                detail=f"{name} after NCCL's watchdog dumped its flight recorder (collective timeout)")
        return ClassifiedFailure(cause=FailureCause.SIGNAL, detail=name)
    coll = collective_error(stderr_tail) if stderr_tail else None
    if coll is not None:
        cause = _collective_cause(coll)
        return ClassifiedFailure(cause=cause, detail=f"exit code {exitcode} after: {_last_match_line(stderr_tail)}",
                                 collective=coll)
    return ClassifiedFailure(cause=FailureCause.EXIT, detail=f"exit code {exitcode} without an exception")


def _last_match_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if collective_error(ln)]
    return (lines[-1] if lines else text.strip().splitlines()[-1])[:300]


def describe(cause: ClassifiedFailure, *, limit: int = 300) -> str:
    """The cause as it appears in the one failure line."""
    detail = " ".join(cause.detail.split())
    if len(detail) > limit:
        detail = detail[: limit - 3] + "..."
    where = f" at {cause.frame}" if cause.frame else ""
    return f"cause={cause.cause}: {detail}{where}"


def stderr_tail(path: str | None, max_bytes: int = 16384) -> str:
    """The end of a worker's stderr log ('' when it went to the console or is unreadable)."""
    if not path or not os.path.isfile(path):
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
