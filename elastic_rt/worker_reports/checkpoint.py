"""Checkpoint figures from the workers to their agent: one small JSON file, replaced atomically."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from elastic_rt.worker_env import ENV_HEARTBEAT_FILE

FILE_NAME = "checkpoint.json"


@dataclass(frozen=True, kw_only=True)
class CheckpointReport:
    step: int
    save_duration_s: float
    blocked_s: float


def report_checkpoint(*, step: int, save_duration_s: float, blocked_s: float, env=None) -> None:
    """Worker side: record the last committed checkpoint (a no-op outside elastic-rt)."""
    env = os.environ if env is None else env
    hb = env.get(ENV_HEARTBEAT_FILE)
    if not hb:
        return
    path = os.path.join(os.path.dirname(hb), FILE_NAME)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"step": int(step), "save_duration_s": float(save_duration_s),
                       "blocked_s": float(blocked_s)}, f)
        os.replace(tmp, path)
    except OSError:
        return  # metrics are best effort; training goes on


class CheckpointReportReader:
    """Agent side: the newest report, once per change of the file."""

    def __init__(self, directory: str) -> None:
        self._path = os.path.join(directory, FILE_NAME)
        self._seen: tuple[int, int] | None = None

    def read_new(self) -> CheckpointReport | None:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        key = (st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return None
        self._seen = key
        try:
            with open(self._path) as f:
                data = json.load(f)
            return CheckpointReport(step=int(data["step"]), save_duration_s=float(data["save_duration_s"]),
                                    blocked_s=float(data["blocked_s"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
