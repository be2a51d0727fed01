"""Agent side of worker reporting: the local workers' heartbeats and checkpoint reports, one place to read them."""

from __future__ import annotations

import os
import threading
from typing import Iterable

from elastic_rt.reporting.checkpoint import CheckpointReport, CheckpointReportReader
from elastic_rt.reporting.heartbeat import Heartbeat, HeartbeatReader, prepare_heartbeat_file


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

    def heartbeat_path(self, local_rank: int) -> str:
        return os.path.join(self.directory, f"worker-{local_rank}")

    def start(self, local_ranks: Iterable[int]) -> None:
        """New workers: forget the old records (a restarted worker starts from nothing)."""
        paths = {rank: self.heartbeat_path(rank) for rank in local_ranks}
        for path in paths.values():
            prepare_heartbeat_file(path)
        with self._lock:
            self._reader = HeartbeatReader(paths)

    def heartbeats(self) -> dict[int, Heartbeat | None]:
        with self._lock:
            reader = self._reader
        return reader.read()

    def new_checkpoint(self) -> CheckpointReport | None:
        """The newest checkpoint report, once per change; None when nothing new arrived."""
        return self._checkpoints.read_new()
