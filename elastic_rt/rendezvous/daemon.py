"""A daemon thread for the agent's own loops (a connection's reader, the lease's beats, the peers' liveness watch),
started without threading.Thread's machinery.

threading.Thread builds an Event, a Condition, an exception hook and a weak-set entry per thread, and start() blocks
until the new thread has run (a switch there and back) so that it can be listed in threading.enumerate(). An agent
starts two such threads in its first round and three once it has peers; measured on this project's 2-core machines,
after the pause before a round, a Thread's start costs 0.27 ms of process CPU where a bare thread costs 0.16 (the
thread's first run included). These loops need only a start, a join with a deadline, and to know whether the calling
thread is theirs. They do not appear in threading.enumerate() (running() lists them, thread_name() says a running
one's name); an exception that escapes one is logged with its name. What they give up: logging's %(threadName)s says
threading's Dummy-N in them (elastic-rt's log lines carry no thread name), threading keeps that dummy entry after
the thread ends (its documented behaviour for threads it did not start), and a forked child sees them as still
running (elastic-rt forks no process that keeps its rendezvous objects).
"""

from __future__ import annotations

import _thread
import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)

_RUNNING: dict[int, "Daemon"] = {}  # a running Daemon's thread ident -> the Daemon


def thread_name() -> str:
    """The calling thread's name: a Daemon's own (threading would call it Dummy-N), else threading's."""
    running = _RUNNING.get(_thread.get_ident())
    return running.name if running is not None else threading.current_thread().name


def running() -> list["Daemon"]:
    """The Daemons whose threads run now (threading.enumerate() does not list them)."""
    return list(_RUNNING.values())


class Daemon:
    """A daemon thread that runs `target()` once start() is called. Keep the object before starting it: the thread
    may run, and ask is_current(), before start() returns."""

    def __init__(self, target: Callable[[], object], name: str) -> None:
        self.name = name
        self._target = target
        self._done = _thread.allocate_lock()  # held from start() until the target returned or raised
        self._started = self._finished = False
        self.ident: int | None = None  # the thread's while it runs (None before and after: idents are reused)
        self.native_id: int | None = None  # the kernel's thread id (/proc/self/task/<id>), once the thread runs

    def start(self) -> Daemon:
        self._done.acquire()
        self._started = True
        _thread.start_new_thread(self._main, ())  # its ident is set by the thread itself, first (is_current)
        return self

    def _main(self) -> None:
        self.ident = _thread.get_ident()
        self.native_id = _thread.get_native_id()
        _RUNNING[self.ident] = self
        try:
            self._target()
        except BaseException:  # noqa: BLE001 - a daemon's death is logged, never silent
            log.exception("thread %s failed", self.name)
        finally:
            _RUNNING.pop(self.ident, None)
            self.ident = None  # a later thread may get the same ident at once: it is not this one
            self._finished = True
            self._done.release()

    def is_current(self) -> bool:
        """Whether the calling thread is this one (while it runs)."""
        return self.ident is not None and _thread.get_ident() == self.ident

    def is_alive(self) -> bool:
        return self._started and not self._finished

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the thread's target returned, at most `timeout` seconds (None: without limit); whether it did
        (True for a Daemon never started). From the thread itself, returns False at once."""
        if self.is_current():
            return False
        if not self._done.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        self._done.release()
        return True
