"""Start the disk writing a file's pages while the rest of the file is still being produced.

A checkpoint shard is written to the page cache and then fsynced, and the fsync
is where the disk does all its work: the CPU (copying, checksumming) and the disk
take turns. Asking the kernel to start writeback of each large chunk as soon as
it is in the page cache (Linux sync_file_range with SYNC_FILE_RANGE_WRITE, which
does not wait) lets the disk work while the next chunk is copied and checksummed,
so the final fsync finds most pages already on their way. Durability still comes
from that fsync; this only moves the disk's work earlier.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Callable

SYNC_FILE_RANGE_WRITE = 2

log = logging.getLogger(__name__)

StartWriteback = Callable[[int, int, int], bool]  # (fd, offset, nbytes) -> started


def _load() -> StartWriteback | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError) as exc:  # not Linux/glibc: the fsync does all of it, as before
        log.debug("checkpoint writes: no sync_file_range here (%s); the final fsync does all the writing", exc)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start(fd: int, offset: int, nbytes: int) -> bool:
        # A failure (EINVAL on some file systems, ESPIPE on pipes) only loses the overlap;
        # real I/O errors surface at the fsync that follows. Callers may ignore the result.
        return fn(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) == 0

    return start


_START = _load()


def start_writeback() -> StartWriteback | None:
    """The platform's start-writeback call, or None where there is none."""
    return _START
