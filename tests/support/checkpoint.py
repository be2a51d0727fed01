"""Pause points in a checkpoint save, for tests: a CheckpointManager whose writer stops where told.

The package has no test hooks. PausingCheckpointManager overrides the manager's writer
factory (`_make_writer`) and wraps each rank's DCP writer so that a hook runs at three phases:

  "staging"  the writer got this rank's plan (prepare_local_plan); the copy to host memory
             (async saves) has not started, nothing is written yet
  "written"  this rank's shard files are on storage (after write_data); nothing is committed
  "commit"   rank 0 only: every rank's files are written and gathered; the writer's token is about
             to be checked and the manifest created (not retention's own token check)

A hook may block (to hold a save at that point), raise (to fail it) or return.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Protocol

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint.writer import ChecksumWriter
from elastic_rt.errors import CheckpointError

PHASE_STAGING = "staging"
PHASE_WRITTEN = "written"
PHASE_COMMIT = "commit"


class PauseHook(Protocol):
    """Called by each rank's writer at the phases above."""

    def __call__(self, *, rank: int, step: int, phase: str) -> None: ...


class PausingWriter(ChecksumWriter):
    """The package's writer, calling `hook` at the "staging" and "written" phases (the manager calls "commit")."""

    def __init__(self, *args: Any, hook: PauseHook, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hook = hook

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._hook(rank=self.rank, step=self.step, phase=PHASE_STAGING)
        return super().prepare_local_plan(plan)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        future.wait()  # the shard is on storage before the hook runs
        self._hook(rank=self.rank, step=self.step, phase=PHASE_WRITTEN)
        return future


class PausingCheckpointManager(CheckpointManager):
    """CheckpointManager(url, ..., pause_hook=hook): every save's writer calls hook."""

    def __init__(self, url: str, *, pause_hook: PauseHook, **kwargs: Any) -> None:
        self._pause_hook = pause_hook
        super().__init__(url, **kwargs)
        guard, check = self._guard, self._guard.check
        step = {"now": -1}
        self._in_retention = threading.local()

        def check_after_hook() -> None:
            if not getattr(self._in_retention, "active", False):
                self._pause_hook(rank=self.rank, step=step["now"], phase=PHASE_COMMIT)
            check()

        guard.check = check_after_hook  # type: ignore[method-assign]
        self._step_box = step

    def _apply_retention(self, newest_step: int) -> None:
        self._in_retention.active = True
        try:
            super()._apply_retention(newest_step)
        finally:
            self._in_retention.active = False

    def save(self, step: int, state: Any) -> bool:
        self._step_box["now"] = step
        return super().save(step, state)

    def _make_writer(self, fs: Any, path: str, **kwargs: Any) -> ChecksumWriter:
        return PausingWriter(fs, path, hook=self._pause_hook, **kwargs)


class EventPauseHook:
    """In-process: at `phase`, set `reached` and block the writer until `release` is set."""

    def __init__(self, phase: str = PHASE_WRITTEN, *, timeout_s: float = 60.0) -> None:
        self.phase = phase
        self.timeout_s = timeout_s
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, *, rank: int, step: int, phase: str) -> None:
        if phase != self.phase:
            return
        self.reached.set()
        if not self.release.wait(self.timeout_s):
            raise CheckpointError(f"test pause at {phase!r} not released within {self.timeout_s} s")


class FilePauseHook:
    """Across processes: at `phase` ("written"), if PATH exists, create PATH.rank<r>.paused and wait
    until PATH is removed (so a test can SIGKILL or SIGSTOP a rank mid-save)."""

    def __init__(self, path: str, *, phase: str = PHASE_WRITTEN, poll_s: float = 0.01,
                 max_wait_s: float = 300.0) -> None:
        self.path = path
        self.phase = phase
        self.poll_s = poll_s
        self.max_wait_s = max_wait_s

    def marker(self, rank: int) -> str:
        return f"{self.path}.rank{rank}.paused"

    def __call__(self, *, rank: int, step: int, phase: str) -> None:
        if phase != self.phase or not os.path.exists(self.path):
            return
        with open(self.marker(rank), "w") as f:
            f.write(f"{step}\n")
        deadline = time.monotonic() + self.max_wait_s
        while os.path.exists(self.path):
            if time.monotonic() > deadline:
                raise CheckpointError(f"test pause file {self.path} was not removed within {self.max_wait_s:.0f} s")
            time.sleep(self.poll_s)
