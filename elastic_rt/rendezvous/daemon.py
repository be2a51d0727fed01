"""A daemon thread for the agent's own loops (a connection's reader, the lease's beats, the peers' liveness watch),
started without threading.Thread's machinery.

threading.Thread builds an Event, a Condition, an exception hook and a weak-set entry per thread, and start() blocks
until the new thread has run (a switch there and back) so that it can be listed in threading.enumerate(). An agent
starts two such threads in its first round and three once it has peers; measured on this project's 2-core machines,
after the pause before a round, a Thread's start costs 0.27 ms of process CPU where a bare thread costs 0.16 (the
thread's first run included). These loops need only a start, a join with a deadline, and to know whether the calling
thread is theirs. They do not appear in threading.enumerate() (thread_name() says a running one's name); an exception that escapes
one is logged with its name.
"""

from __future__ import annotations

import _thread
import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)

_NAMES: dict[int, str] = {}  # a running Daemon's thread ident -> its name


def thread_name() -> str:
    """The calling thread's name: a Daemon's own (threading would call it Dummy-N), else threading's."""
    name = _NAMES.get(_thread.get_ident())
    return name if name is not None else threading.current_thread().name


class Daemon:
    """Runs `target()` on a new daemon thread at once."""

    def __init__(self, target: Callable[[], object], name: str) -> None:
        self.name = name
        self._target = target
        self._done = _thread.allocate_lock()
        self._done.acquire()  # released when target returns or raises
        self.ident: int | None = None
        self.native_id: int | None = None  # the kernel's thread id (/proc/self/task/<id>), once the thread runs
        self.ident = _thread.start_new_thread(self._main, ())

    def _main(self) -> None:
        self.ident = _thread.get_ident()  # before the target runs: it may ask is_current() before start returned
        self.native_id = _thread.get_native_id()
        _NAMES[self.ident] = self.name
        try:
            self._target()
        except BaseException:  # noqa: BLE001 - a daemon's death is logged, never silent
            log.exception("thread %s failed", self.name)
        finally:
            _NAMES.pop(self.ident, None)
            self._done.release()

    def is_current(self) -> bool:
        """Whether the calling thread is this one."""
        return _thread.get_ident() == self.ident

    def is_alive(self) -> bool:
        return self._done.locked()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the thread's target returned, at most `timeout` seconds (None: without limit); whether it did.
        From the thread itself, returns False at once (it cannot wait for its own end)."""
        if self.is_current():
            return False
        if not self._done.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        self._done.release()
        return True
