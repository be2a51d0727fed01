"""Worker side of warm workers: import ahead, wait for the agent's start message, become the worker.

A warm worker is started by the agent through the worker entry point with
`--warm FD` before it knows its rank. It imports torch (and the modules named
by `--warm-imports`), then blocks reading one JSON message from FD: the
worker's full environment and where its stdout/stderr go. What it writes
to stdout/stderr before that is kept aside (it may be started while still
importing) and written first into the rank's log files at start, so that they
hold all the process wrote, as a cold worker's do (torch tails them for
--tee); an unused warm worker's output goes nowhere. It applies them and
returns the script's argv to the entry point, which runs the script exactly as
a cold worker would. EOF without a message (the agent closed the pool or died)
exits quietly. When anything is doubtful (a module in the script's directory
would shadow one it imported, the message is not what it expects) it executes
the cold command in place: same pid, same environment, nothing warm left.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import resource
import sys

# argv of a warm worker: python -u -m elastic_rt.worker.main --warm IN,READY [--warm-nice N]
#                        [--warm-imports a,b] -- SCRIPT ARGS...
# IN: the pipe the start message arrives on; READY: a pipe it writes one byte to once imported.
FLAG_FD = "--warm"
FLAG_NICE = "--warm-nice"
FLAG_IMPORTS = "--warm-imports"
# The last variable of a warm worker's initial environment: room to write the variables it learns
# at start into its /proc/<pid>/environ, so that tools reading it (chaos, ps e, benchmarks) see
# what a cold worker would show.
ENV_PAD = "ELASTIC_RT_WARM_PAD"
MAX_MESSAGE_BYTES = 16 << 20


class WarmOptions:
    """The warm flags taken off the front of the entry point's argv."""

    def __init__(self, fd: int, ready_fd: int, nice: int, imports: tuple[str, ...]) -> None:
        self.fd, self.ready_fd, self.nice, self.imports = fd, ready_fd, nice, imports


def split_argv(argv: list[str]) -> tuple[WarmOptions | None, list[str]]:
    """(options, the rest) when argv starts with the warm flags; (None, argv) otherwise."""
    if not argv or argv[0] != FLAG_FD or len(argv) < 2:
        return None, argv
    fd, _, ready_fd = argv[1].partition(",")
    nice, imports, rest = 0, (), argv[2:]
    while rest and rest[0] in (FLAG_NICE, FLAG_IMPORTS) and len(rest) >= 2:
        if rest[0] == FLAG_NICE:
            nice = int(rest[1])
        else:
            imports = tuple(m for m in rest[1].split(",") if m)
        rest = rest[2:]
    return WarmOptions(int(fd), int(ready_fd or -1), nice, imports), rest


def _can_renice_back(current: int) -> bool:
    """True when this process could return from a higher nice value to `current`."""
    if os.geteuid() == 0:
        return True
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    except (AttributeError, OSError, ValueError):
        return False
    return soft == resource.RLIM_INFINITY or 20 - soft <= current


def _renice_all_threads(value: int) -> None:
    """Linux keeps a nice value per thread: threads the imports started were niced with this one."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except OSError:
            pass


def _read_message(fd: int) -> bytes:
    chunks, total = [], 0
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
        if total > MAX_MESSAGE_BYTES:
            break
    os.close(fd)
    return b"".join(chunks)


def _shadowing(script: str, loaded_now: set[str], loaded_before: set[str]) -> list[str]:
    """Modules this process imported ahead that the script's directory would have shadowed
    (a cold worker puts that directory first on sys.path before the script imports anything)."""
    directory = os.path.dirname(os.path.abspath(script))
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    defined = set()
    for name in names:
        if name.endswith(".py") or name.endswith(".pyc"):
            defined.add(name.rsplit(".", 1)[0])
        elif name.endswith(".so"):
            defined.add(name.split(".", 1)[0])
        elif os.path.isfile(os.path.join(directory, name, "__init__.py")):
            defined.add(name)
    return sorted((loaded_now - loaded_before) & defined)


def _top_level_modules() -> set[str]:
    return {name.partition(".")[0] for name in list(sys.modules)}


class _Captured:
    """What fds 1 and 2 receive before the start message: kept in anonymous files, not the agent's
    console. At start each goes where a cold worker's output would have gone from its first byte:
    the rank's log file (torch tails it for --tee), or the inherited stream when not redirected."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, int]] = {}  # fd -> (the original, the capture)
        for fd in (1, 2):
            try:
                capture = _anonymous_file(f"elastic-rt-warm-{fd}")
            except OSError:
                continue  # left on the inherited stream: visible there, as before
            self._held[fd] = (os.dup(fd), capture)
            os.dup2(capture, fd)

    def apply(self, fd: int, path: str) -> None:
        """Send fd to `path` (truncated; "" means the original stream), after what it captured."""
        original, capture = self._held.pop(fd, (None, None))
        if path:
            dest = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        elif original is not None:
            dest = original
        else:
            return
        try:
            copied = _copy(capture, dest, 0) if capture is not None else 0
            os.dup2(dest, fd)
            if capture is not None:  # what another thread wrote between the copy and the dup2
                _copy(capture, dest, copied)
        finally:
            for other in {dest, original, capture} - {None}:
                os.close(other)


def _anonymous_file(name: str) -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    import tempfile

    with tempfile.TemporaryFile() as f:
        return os.dup(f.fileno())


def _copy(src: int, dst: int, offset: int) -> int:
    """Append src's bytes from `offset` on to dst; returns the offset reached."""
    while True:
        chunk = os.pread(src, 1 << 16, offset)
        if not chunk:
            return offset
        offset += len(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view):]


def _proc_env_bounds() -> tuple[int, int] | None:
    """(env_start, env_end) of this process from /proc/self/stat (fields 50 and 51)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        return int(fields[47]), int(fields[48])
    except (OSError, ValueError, IndexError):
        return None


def publish_environment(added: dict[str, str]) -> bool:
    """Write `added` over the pad variable at the end of this process's initial environment block,
    which is what /proc/<pid>/environ shows. Only the pad's bytes change; every other variable
    keeps its bytes and address. False (nothing written) when anything does not check out."""
    bounds = _proc_env_bounds()
    if bounds is None:
        return False
    start, end = bounds
    try:
        with open("/proc/self/environ", "rb") as f:
            block = f.read()
    except OSError:
        return False
    if len(block) != end - start or ctypes.string_at(start, end - start) != block:
        return False
    at = block.rfind(b"\0" + ENV_PAD.encode() + b"=")
    at = at + 1 if at >= 0 else (0 if block.startswith(ENV_PAD.encode() + b"=") else -1)
    if at < 0 or block.find(b"\0", at) != len(block) - 1:
        return False  # the pad is not the last variable
    data = b"".join(f"{k}={v}".encode() + b"\0" for k, v in added.items())
    room = len(block) - at
    if len(data) + 1 > room:
        return False
    ctypes.memmove(start + at, data + b"\0" * (room - len(data)), room)
    return True


def _exec_cold(argv: list[str], reason: str) -> None:
    print(f"elastic-rt warm worker (pid {os.getpid()}): {reason}; starting cold", file=sys.stderr, flush=True)
    cold = [sys.executable, *sys.orig_argv[1:sys.orig_argv.index(FLAG_FD)], "--", *argv]
    os.execve(sys.executable, cold, dict(os.environ))


def become_worker(opts: WarmOptions, argv: list[str]) -> list[str]:
    """Import ahead, wait for the start message, apply it; returns the script's argv.
    Exits 0 on EOF (never started); executes the cold command when warm is doubtful."""
    initial = dict(os.environ)
    captured = _Captured()
    original_nice = os.nice(0)
    if opts.nice > 0 and _can_renice_back(original_nice):
        os.nice(opts.nice)
    before = _top_level_modules()
    for name in opts.imports:
        try:
            importlib.import_module(name)
        except Exception:  # the script meets the same error itself, cold or warm
            pass
    if opts.ready_fd >= 0:
        try:
            os.write(opts.ready_fd, b"R")
            os.close(opts.ready_fd)
        except OSError:
            pass
    raw = _read_message(opts.fd)
    if not raw:
        os._exit(0)  # the agent closed the pool or died: nothing to run
    if os.nice(0) != original_nice:
        _renice_all_threads(original_nice)
    message = json.loads(raw)
    env: dict[str, str] = message["env"]
    for name, fd in (("stdout", 1), ("stderr", 2)):
        getattr(sys, name).flush()
        captured.apply(fd, message.get(name) or "")
    os.environ.pop(ENV_PAD, None)
    # exactly the cold worker's environment: also drop what the imports ahead set (torch's inductor sets
    # TORCHINDUCTOR_CACHE_DIR on import; a cold worker's script sets it when it imports, not before)
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    added = {}
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
        if initial.get(key) != value:
            added[key] = value
    if message.get("cpus"):  # --numa-binding: what numactl does for a cold worker (worker/numa.py); kept by exec
        from elastic_rt.worker.numa import bind_this_process

        bind_this_process(message["cpus"])
    if message.get("argv") != argv:
        _exec_cold(message.get("argv") or argv, "the agent asked for another command")
    if argv and argv[0] != "-m":
        shadowed = _shadowing(argv[0], _top_level_modules(), before)
        if shadowed:
            _exec_cold(argv, f"{', '.join(shadowed)} in the script's directory would shadow a module "
                             "imported ahead")
    publish_environment(added)
    return argv
