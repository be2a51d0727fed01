"""The agent's event journal: one JSON object per line in <log dir>/goodput-<node>.jsonl, read back by
`elastic-rt report`. Every line has time (Unix seconds), mono (the agent's monotonic clock), event,
run_id, node and pid; the other fields depend on the event (docs/goodput.md lists them)."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

FILE_GLOB = "goodput-*.jsonl"


def journal_path(log_dir: str, node: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node) or "node"
    return os.path.join(log_dir, f"goodput-{safe}.jsonl")


class EventLog:
    """Appends events; a write that fails (disk full, directory gone) is logged once and dropped."""

    def __init__(self, path: str, *, run_id: str, node: str, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._base = {"run_id": run_id, "node": node, "pid": os.getpid()}
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._failed = False
        self._file = None
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        if not self._failed:
            log.warning("goodput journal %s cannot be written (%s); events are not recorded", self.path, exc)
        self._failed = True

    def wall_at(self, mono: float) -> float:
        """Unix time of a reading of the monotonic clock."""
        return self._wall_clock() - (self._clock() - mono)

    def write(self, event: str, *, at: float | None = None, **fields: Any) -> None:
        """One line; `at` (monotonic) dates an event that happened before now."""
        mono = self._clock() if at is None else at
        record = {"time": round(self.wall_at(mono), 6), "mono": round(mono, 6), "event": event,
                  **self._base, **fields}
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line)
            except OSError as exc:
                self._fail(exc)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None


def read_events(path: str) -> Iterator[dict]:
    """The events of one journal; a torn last line (the agent was killed mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "event" in record and "time" in record:
                yield record
