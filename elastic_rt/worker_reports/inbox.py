"""Agent side of worker reporting: the local workers' heartbeats and checkpoint reports, one place to read them."""

from __future__ import annotations

import logging
import os
import threading
from typing import Iterable

from elastic_rt.worker_reports.checkpoint import CheckpointReport, CheckpointReportReader
from elastic_rt.worker_reports.heartbeat import Heartbeat, HeartbeatReader, prepare_heartbeat_file

log = logging.getLogger(__name__)


class WorkerReports:
    """What the workers of this node report to their agent through files in `directory`.

    The agent calls start() before each set of workers runs; the metrics (at scrape time)
    and the restart policy (every monitor tick) read the same heartbeats from here.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._reader = HeartbeatReader({})
        self._checkpoints = CheckpointReportReader(directory)
        self._failed: dict[int, str] = {}  # local rank -> why its heartbeat file could not be allocated

    def heartbeat_path(self, local_rank: int) -> str:
        return os.path.join(self.directory, f"worker-{local_rank}")

    def start(self, local_ranks: Iterable[int]) -> None:
        """New workers: forget the old records (a restarted worker starts from nothing) and allocate new ones. A
        record that cannot be allocated (a full log dir) is said once, in one line: that worker runs without
        heartbeats (and without hang detection) until the disk has room at a later start."""
        paths = {rank: self.heartbeat_path(rank) for rank in local_ranks}
        failed = {rank: why for rank, path in paths.items() if (why := prepare_heartbeat_file(path)) is not None}
        if failed and failed != self._failed:
            log.warning("heartbeat files of local rank(s) %s cannot be allocated in %s (%s); those workers run "
                        "without step heartbeats and hang detection (free space in --log-dir)", sorted(failed),
                        self.directory, "; ".join(sorted(set(failed.values()))))
        elif self._failed and not failed:
            log.info("heartbeat files allocated in %s again: step heartbeats are on", self.directory)
        self._failed = failed
        with self._lock:
            self._reader = HeartbeatReader(paths)

    def heartbeats(self) -> dict[int, Heartbeat | None]:
        with self._lock:
            reader = self._reader
        return reader.read()

    def new_checkpoint(self) -> CheckpointReport | None:
        """The newest checkpoint report, once per change; None when nothing new arrived."""
        return self._checkpoints.read_new()
