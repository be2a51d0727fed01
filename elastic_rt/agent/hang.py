"""Pure hang detection over the local workers' step heartbeats (clock injected)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from elastic_rt.errors import ConfigError
from elastic_rt.reporting.heartbeat import Heartbeat


@dataclass(frozen=True, kw_only=True)
class HangVerdict:
    """The outcome of one HangDetector.check()."""

    hung: bool
    stuck: tuple[int, ...] = ()  # local ranks judged hung, sorted
    stalled_s: float = 0.0  # the longest time without progress among the stuck
    reason: str = ""


@dataclass
class _WorkerTrack:
    last_key: tuple[int, int] | None = None  # (pid, seq) of the last record seen
    last_progress_at: float | None = None  # detector clock when progress was seen


class HangDetector:
    """Says whether the local worker group is hung.

    Rules (one detector per agent, reset by start() whenever workers are (re)started):
    - Progress is any new heartbeat record (a new (pid, seq)): every report_step call
      counts, whatever the step value. Call report_step from the training loop only.
    - A worker is *armed* by its first record after start(). A script that never calls
      report_step is never armed, so the detector never fires for it.
    - An armed worker that shows no progress for hang_timeout_s is hung, even if the
      others progress: they will block in its next collective anyway.
    - judge_silent_workers=False (default): a worker that has not reported yet is not
      judged (scripts often report from one rank only). With True it is judged from
      the later of its start and the first record of any local worker; this catches
      a rank stuck before its first step while the others are already training.
    - Progress time is the detector's clock at the observation that saw the new
      record, so the poll interval adds to the detection latency but the verdict
      never depends on the worker's clock.
    hang_timeout_s must exceed the longest legitimate pause between two steps
    (first-step compilation, evaluation, a blocking checkpoint save).
    """

    def __init__(
        self,
        *,
        hang_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        judge_silent_workers: bool = False,
    ) -> None:
        if not hang_timeout_s > 0:
            raise ConfigError(f"hang timeout must be > 0 s, got {hang_timeout_s!r}")
        self._timeout_s = float(hang_timeout_s)
        self._clock = clock
        self._judge_silent = judge_silent_workers
        self._started_at = clock()
        self._first_report_at: float | None = None
        self._workers: dict[int, _WorkerTrack] = {}

    @property
    def hang_timeout_s(self) -> float:
        return self._timeout_s

    def start(self, local_ranks: Iterable[int]) -> None:
        """Forget everything: these workers were just (re)started."""
        self._started_at = self._clock()
        self._first_report_at = None
        self._workers = {rank: _WorkerTrack() for rank in local_ranks}

    def remove(self, local_rank: int) -> None:
        """Stop judging a worker that exited (successfully or not)."""
        self._workers.pop(local_rank, None)

    def observe(self, local_rank: int, beat: Heartbeat | None) -> None:
        """Feed the latest record of one worker (None: no readable record yet)."""
        track = self._workers.get(local_rank)
        if track is None or beat is None:
            return
        key = (beat.pid, beat.seq)
        if key == track.last_key:
            return
        now = self._clock()
        track.last_key = key
        track.last_progress_at = now
        if self._first_report_at is None:
            self._first_report_at = now

    def observe_all(self, beats: Mapping[int, Heartbeat | None]) -> None:
        for rank, beat in beats.items():
            self.observe(rank, beat)

    def armed(self) -> tuple[int, ...]:
        """Local ranks that have reported at least once since start()."""
        return tuple(sorted(r for r, t in self._workers.items() if t.last_progress_at is not None))

    def check(self) -> HangVerdict:
        now = self._clock()
        stalls: dict[int, float] = {}
        for rank, track in self._workers.items():
            if track.last_progress_at is not None:
                stalled = now - track.last_progress_at
            elif self._judge_silent and self._first_report_at is not None:
                stalled = now - max(self._started_at, self._first_report_at)
            else:
                continue
            if stalled >= self._timeout_s:
                stalls[rank] = stalled
        if not stalls:
            return HangVerdict(hung=False)
        stuck = tuple(sorted(stalls))
        worst = max(stalls.values())
        silent = [r for r in stuck if self._workers[r].last_progress_at is None]
        detail = f"; never reported: {silent}" if silent else ""
        reason = (
            f"local rank(s) {list(stuck)} made no step progress for {worst:.1f} s "
            f"(hang timeout {self._timeout_s:g} s){detail}"
        )
        return HangVerdict(hung=True, stuck=stuck, stalled_s=worst, reason=reason)
