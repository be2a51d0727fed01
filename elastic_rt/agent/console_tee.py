"""The agent's console tee of worker output (--tee): whole lines only, each written and flushed in one piece.

torch's TailLog copies each worker's log file to the agent's console with one `readline()` after another
and writes whatever it read behind the rank's prefix. A `readline()` that meets the end of a file the
worker is still writing returns the part written so far; torch writes it, and the rest arrives later
behind a second prefix: `[default0]:indices step=2[default0]:4 epoch=0 ...`. A worker run with
PYTHONUNBUFFERED writes every print as two writes (the text, then the newline), and any write that
crosses a page of the file can be seen half done, so on a loaded machine some lines reach the console
split, glued to the next one, or with another stream's line between their halves.

Here the tail keeps a partial line until its newline arrives (or the worker's output ends, when what is
left becomes the last line), filters whole lines, and writes prefix and line in one call under one lock
shared by every tee of the agent, flushed at once (a console that is a pipe would otherwise flush 8 KiB
blocks that split lines against the agent's own log lines on stderr). A line longer than MAX_LINE_CHARS
is written in pieces of that size, each behind the prefix, rather than held without bound.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Iterator, TextIO

from elastic_rt.torch_seams import patched_tail_logfile

MAX_LINE_CHARS = 1 << 20
_WRITE = threading.Lock()  # one line at a time on the console, whichever rank's tail writes it


def tail_whole_lines(header: str, file: str, dst: TextIO, finished: threading.Event, interval_sec: float,
                     log_line_filter: Callable[[str], bool] | None = None) -> None:
    """Copy `file` (a worker's stdout or stderr log) to `dst` line by line behind `header` until `finished`
    is set and the file is read to its end; torch's tail_logfile contract, whole lines only."""
    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)
    pending = ""
    with open(file, errors="replace") as fp:
        while True:
            part = fp.readline(MAX_LINE_CHARS - len(pending))
            if part:
                pending += part
                if pending.endswith("\n") or len(pending) >= MAX_LINE_CHARS:
                    _emit(header, pending, dst, log_line_filter)
                    pending = ""
            elif finished.is_set():
                break  # the worker is gone and its file read to the end
            else:
                time.sleep(interval_sec)
    if pending:
        _emit(header, pending, dst, log_line_filter)


def _emit(header: str, line: str, dst: TextIO, log_line_filter: Callable[[str], bool] | None) -> None:
    if log_line_filter is not None and not log_line_filter(line):
        return
    text = f"{header}{line}" if line.endswith("\n") else f"{header}{line}\n"
    with _WRITE:
        dst.write(text)
        dst.flush()


@contextlib.contextmanager
def whole_line_tee() -> Iterator[None]:
    """While the block runs (the agent starting a worker group), the tees torch starts copy whole lines."""
    with patched_tail_logfile(tail_whole_lines):
        yield
