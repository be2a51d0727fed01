"""Per-worker step heartbeat: a 52-byte record the worker writes and the agent reads."""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from elastic_rt.worker_env import WorkerEnvironment

log = logging.getLogger(__name__)

# Record layout (little-endian, 52 bytes at offset 0 of the file):
#   magic    4s   b"ERHB"; once the script is done: b"ERHR" if it returned (or exited 0),
#                 b"ERHD" if it raised or exited non-zero (both: finished)
#   pid      u32  the writer's pid
#   seq      u64  number of progress events (report_step calls and optimizer steps) by
#                 this writer (1 for the first)
#   step     i64  the last step passed to report_step; without any, the number of
#                 optimizer steps
#   mono_ns  i64  the writer's CLOCK_MONOTONIC in nanoseconds (system-wide on Linux)
#   compute_ns u64  total compute time of the timed steps (goodput/compute.py): outside backward()
#   timed    u64  number of timed steps in compute_ns
#   crc      u32  zlib.crc32 of the 48 bytes above; a torn read fails it
_MAGIC = b"ERHB"
_MAGIC_FINISHED = b"ERHD"
_MAGIC_RETURNED = b"ERHR"
_BODY = struct.Struct("<4sIQqqQQ")  # magic, pid, seq, step, mono_ns, compute_ns, timed  (48 bytes)
_CRC = struct.Struct("<I")
RECORD_SIZE = _BODY.size + _CRC.size  # 52 bytes
_READ_ATTEMPTS = 3


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """One decoded heartbeat record, as seen by the agent."""

    pid: int
    seq: int
    step: int
    timestamp_s: float  # CLOCK_MONOTONIC of the writer, seconds
    age_s: float  # reader's clock minus timestamp_s, clamped at 0
    finished: bool = False  # the script returned or raised: the process is exiting, not stuck
    returned: bool = False  # finished by returning (or exit status 0): its work is done
    compute_ns: int = 0  # total compute time (outside backward()) of `timed_steps` steps
    timed_steps: int = 0


def encode_record(*, pid: int, seq: int, step: int, mono_ns: int, compute_ns: int = 0, timed: int = 0) -> bytes:
    """Return the on-disk bytes of one heartbeat record."""
    body = _BODY.pack(_MAGIC, pid & 0xFFFFFFFF, seq, step, mono_ns, compute_ns, timed)
    return body + _CRC.pack(zlib.crc32(body))


def decode_record(data: bytes) -> tuple[int, int, int, int, int, int] | None:
    """Return (pid, seq, step, mono_ns, compute_ns, timed), or None for a short, torn or foreign record."""
    if len(data) < RECORD_SIZE:
        return None
    body = data[: _BODY.size]
    (crc,) = _CRC.unpack_from(data, _BODY.size)
    if zlib.crc32(body) != crc:
        return None
    magic, pid, seq, step, mono_ns, compute_ns, timed = _BODY.unpack(body)
    if magic not in (_MAGIC, _MAGIC_FINISHED, _MAGIC_RETURNED) or seq == 0:
        return None
    return pid, seq, step, mono_ns, compute_ns, timed


def allocate(fd: int) -> None:
    """Give the record real blocks (not a sparse file): a write through the mapping into a page the file system
    cannot back kills the writer with SIGBUS; here a full disk is an OSError (ENOSPC) instead, before any write."""
    os.posix_fallocate(fd, 0, RECORD_SIZE)


class HeartbeatWriter:
    """Worker side: writes the record into a shared mapping of the heartbeat file.

    A write is a memcpy into the page cache (no system call), so it can be called
    every step. The reader sees it through read(2) because Linux keeps MAP_SHARED
    file mappings and the page cache coherent.
    """

    def __init__(self, path: str, *, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._path = path
        self._clock_ns = clock_ns
        self._pid = os.getpid()
        self._seq = 0
        self._step = 0
        self._explicit = False  # report_step was called: its steps win over the optimizer count
        self._compute: tuple[int, int] = (0, 0)  # (compute_ns, timed steps) from goodput/compute.py
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            allocate(fd)
            self._map = mmap.mmap(fd, RECORD_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    @property
    def path(self) -> str:
        return self._path

    def report(self, step: int) -> None:
        """An explicit step (report_step): progress, and from now on the step number shown."""
        self._explicit = True
        self._step = step
        self._write()

    def tick(self, advance: bool = True) -> None:
        """Progress without a step number (an optimizer step): counts the steps itself
        (when `advance`) unless report_step gave explicit ones."""
        if advance and not self._explicit:
            self._step += 1
        self._write()

    def set_compute(self, compute_ns: int, timed: int) -> None:
        """The compute timer's totals, carried by the next record."""
        self._compute = (compute_ns, timed)

    def finish(self, returned: bool = False) -> None:
        """The script is done (returned: True if it returned or exited 0, False if it raised);
        interpreter teardown can take seconds."""
        self._write(_MAGIC_RETURNED if returned else _MAGIC_FINISHED)

    def _write(self, magic: bytes = _MAGIC) -> None:
        self._seq += 1
        body = _BODY.pack(magic, self._pid, self._seq, self._step, self._clock_ns(), *self._compute)
        self._map[0:RECORD_SIZE] = body + _CRC.pack(zlib.crc32(body))

    def close(self) -> None:
        self._map.close()


class _NullWriter:
    """Stands in when the process was not started by an elastic-rt agent."""

    path = None

    def report(self, step: int) -> None:
        return None

    def tick(self, advance: bool = True) -> None:
        return None

    def set_compute(self, compute_ns: int, timed: int) -> None:
        return None

    def finish(self, returned: bool = False) -> None:
        return None

    def close(self) -> None:
        return None


_writer: HeartbeatWriter | _NullWriter | None = None
_writer_lock = threading.Lock()


def _open_writer(path: str | None) -> HeartbeatWriter | _NullWriter:
    if not path:
        return _NullWriter()
    try:
        return HeartbeatWriter(path)
    except OSError as exc:
        # The worker must keep training even if the agent's heartbeat dir is gone or its disk is full.
        log.warning("heartbeat file %s cannot be opened (%s); step heartbeats are off", path, exc)
        return _NullWriter()


def _get_writer() -> HeartbeatWriter | _NullWriter:
    global _writer
    writer = _writer
    if writer is None:
        with _writer_lock:
            if _writer is None:
                _writer = _open_writer(WorkerEnvironment.from_env().heartbeat_file)
            writer = _writer
    return writer


def report_step(step: int) -> None:
    """Tell the agent this worker finished `step`. Cheap enough for every step.

    The file comes from ELASTIC_RT_HEARTBEAT_FILE (set by the agent); without it
    this is a no-op, so a training script also runs without elastic-rt.
    Under elastic-rt every optimizer step already counts as progress (see
    install_optimizer_progress); call this for loops without a torch optimizer, or to
    show your own step numbers (they then win over the optimizer step count).
    """
    _get_writer().report(step)


def report_finished(returned: bool = False) -> None:
    """Worker entry point: the script returned (`returned`) or raised; do not judge the exit as a hang."""
    _get_writer().finish(returned)


_counted_optimizer: "weakref.ref[Any] | None" = None
_step_timer: Callable[[Any], tuple[int, int] | None] | None = None  # goodput/compute.py's step end, if installed


def set_step_timer(step_ended: Callable[[Any], tuple[int, int] | None] | None) -> None:
    """Call step_ended(optimizer) -> (compute_ns, timed steps), or None, at each counted optimizer step;
    the totals go into the record."""
    global _step_timer
    _step_timer = step_ended


def optimizer_step_hook(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    """torch's global optimizer step post hook: every optimizer.step() is progress. The step
    number follows the first optimizer that steps (a GAN's second optimizer does not double it)."""
    global _counted_optimizer
    counted = _counted_optimizer() if _counted_optimizer is not None else None
    if counted is None:
        _counted_optimizer = weakref.ref(optimizer)
        counted = optimizer
    writer = _get_writer()
    if counted is optimizer and _step_timer is not None and (totals := _step_timer(optimizer)) is not None:
        writer.set_compute(*totals)
    writer.tick(counted is optimizer)


def install_optimizer_progress(optimizer_module: Any) -> Any:
    """Register optimizer_step_hook with torch.optim.optimizer (given as the module); returns the handle."""
    return optimizer_module.register_optimizer_step_post_hook(optimizer_step_hook)


def _reset_after_fork() -> None:
    # A forked child (a DataLoader worker, a fork-started trainer) must not reuse the
    # parent's mapping and sequence; it re-opens the file if it ever reports a step.
    global _writer, _writer_lock, _counted_optimizer
    _writer = None
    _writer_lock = threading.Lock()
    _counted_optimizer = None


os.register_at_fork(after_in_child=_reset_after_fork)


def report_to(path: str | None) -> None:
    """Send this process's step reports to the heartbeat file `path` from now on, or, with None, to the file
    ELASTIC_RT_HEARTBEAT_FILE names at the next report (none: reports go nowhere). The file reported to before
    is closed and the optimizer step count starts over. The worker entry point calls it once it knows its file;
    a file that cannot be opened is one warning and no heartbeats, as at the first report."""
    global _writer, _counted_optimizer
    with _writer_lock:
        if _writer is not None:
            _writer.close()
        _writer = None if path is None else _open_writer(path)
        _counted_optimizer = None


def prepare_heartbeat_file(path: str) -> str | None:
    """Agent side, before starting a worker: remove a stale record and allocate a zeroed one (read as "no record
    yet"). Returns why that failed (a full or read-only log dir: the worker then runs without heartbeats, and
    without hang detection), or None. Never raises."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            allocate(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        try:
            os.unlink(path)  # not a sparse file left for the worker to map
        except OSError:
            pass
        return exc.strerror or str(exc)
    return None


def read_heartbeat(path: str, *, clock: Callable[[], float] = time.monotonic) -> Heartbeat | None:
    """Agent side: the last record in `path`, or None if missing, empty or garbage.

    `clock` must read CLOCK_MONOTONIC (as time.monotonic does) to give a true age.
    CLOCK_MONOTONIC is one clock for the whole host on Linux, so the agent and its
    workers agree, unless a worker runs in a different time namespace (unshare -T),
    which containers do not do by default.
    A torn read (the worker wrote while we read) fails the checksum and is retried.
    """
    for _ in range(_READ_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.debug("heartbeat %s unreadable: %s", path, exc)
            return None
        try:
            data = os.pread(fd, RECORD_SIZE, 0)
        except OSError as exc:
            log.debug("heartbeat %s unreadable: %s", path, exc)
            return None
        finally:
            os.close(fd)
        if len(data) < RECORD_SIZE or not any(data):
            return None  # created but never written
        decoded = decode_record(data)
        if decoded is not None:
            pid, seq, step, mono_ns, compute_ns, timed = decoded
            ts = mono_ns / 1e9
            return Heartbeat(pid=pid, seq=seq, step=step, timestamp_s=ts, age_s=max(0.0, clock() - ts),
                             finished=data[:4] in (_MAGIC_FINISHED, _MAGIC_RETURNED),
                             returned=data[:4] == _MAGIC_RETURNED, compute_ns=compute_ns, timed_steps=timed)
    return None


class HeartbeatReader:
    """Agent side: reads the heartbeat files of the local workers, keyed by local rank."""

    def __init__(self, paths: dict[int, str], *, clock: Callable[[], float] = time.monotonic) -> None:
        self._paths = dict(paths)
        self._clock = clock

    @property
    def paths(self) -> dict[int, str]:
        return dict(self._paths)

    def read(self) -> dict[int, Heartbeat | None]:
        return {rank: read_heartbeat(path, clock=self._clock) for rank, path in self._paths.items()}
