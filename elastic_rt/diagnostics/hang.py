"""Pure hang detection over the local workers' step heartbeats: the timeout rule and the verdict (clock injected)."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from elastic_rt.errors import ConfigError
from elastic_rt.worker_reports.heartbeat import Heartbeat

# The automatic hang timeout (docs/failures.md explains the choice).
AUTO_FLOOR_S = 300.0  # never less: first-step compilation is not judged, but a recompile, an eval or a save is
AUTO_STEP_FACTOR = 20.0  # x the median step time: a slow model is judged on its own scale
AUTO_PAUSE_FACTOR = 2.0  # x the longest pause between two steps seen so far (evaluation, checkpoint save)
AUTO_BACKOFF = 2.0  # the floor doubles after each hang restart, so a legitimate long pause cannot crash-loop

# psutil process states that explain a hang by themselves; named before ranks that merely wait.
SUSPECT_STATES = ("stopped", "tracing-stop", "disk-sleep", "zombie", "dead")


class HangTimeout:
    """The hang timeout: fixed, or (auto) learned from the step times seen so far.

    auto = max(floor_s x backoff^hang_restarts, step_factor x median step time,
               pause_factor x longest pause between two steps).
    Only intervals between two steps of one worker count: the time to the first step
    after a (re)start (compilation, checkpoint loading) never does.
    """

    def __init__(self, *, fixed_s: float | None = None, floor_s: float = AUTO_FLOOR_S,
                 step_factor: float = AUTO_STEP_FACTOR, pause_factor: float = AUTO_PAUSE_FACTOR,
                 backoff: float = AUTO_BACKOFF, window: int = 256) -> None:
        if fixed_s is not None and not fixed_s > 0:
            raise ConfigError(f"hang timeout must be > 0 s, got {fixed_s!r}")
        if not floor_s > 0:
            raise ConfigError(f"hang timeout floor must be > 0 s, got {floor_s!r}")
        self._fixed_s = None if fixed_s is None else float(fixed_s)
        self._floor_s = float(floor_s)
        self._step_factor = step_factor
        self._pause_factor = pause_factor
        self._backoff = backoff
        self._step_times: deque[float] = deque(maxlen=window)
        self._longest_pause_s = 0.0
        self._hang_restarts = 0

    @property
    def auto(self) -> bool:
        return self._fixed_s is None

    def observe_interval(self, interval_s: float, steps: int) -> None:
        """`steps` progress events happened in `interval_s` (one worker, its own clock)."""
        if steps <= 0 or interval_s < 0:
            return
        per_step = interval_s / steps  # exact when steps == 1, else a lower bound of the longest
        self._step_times.append(per_step)
        self._longest_pause_s = max(self._longest_pause_s, per_step)

    def on_hang_restart(self) -> None:
        self._hang_restarts += 1

    def median_step_s(self) -> float | None:
        return statistics.median(self._step_times) if self._step_times else None

    def current_s(self) -> float:
        if self._fixed_s is not None:
            return self._fixed_s
        median = self.median_step_s() or 0.0
        return max(self._floor_s * self._backoff ** self._hang_restarts, self._step_factor * median,
                   self._pause_factor * self._longest_pause_s)

    def describe(self) -> str:
        if self._fixed_s is not None:
            return f"hang timeout {self._fixed_s:g} s"
        median = self.median_step_s()
        floor = self._floor_s * self._backoff ** self._hang_restarts
        return (f"auto hang timeout {self.current_s():.0f} s = max({floor:g} s, {self._step_factor:g} x median step "
                f"{(median or 0.0):.3g} s, {self._pause_factor:g} x longest pause {self._longest_pause_s:.3g} s)")


@dataclass(frozen=True, kw_only=True)
class RankStall:
    """One local worker that made no progress for the timeout."""

    local_rank: int
    pid: int | None  # from its last heartbeat record (None: it never reported)
    last_step: int | None
    last_progress_s: float | None  # CLOCK_MONOTONIC of its last record (the worker's own clock)
    stalled_s: float


@dataclass(frozen=True, kw_only=True)
class HangVerdict:
    """The outcome of one HangDetector.check()."""

    hung: bool
    stuck: tuple[int, ...] = ()  # local ranks judged hung, sorted
    stalled_s: float = 0.0  # the longest time without progress among the stuck
    reason: str = ""
    stalls: tuple[RankStall, ...] = ()  # one per rank without progress for half the timeout, in local-rank order
    timeout_s: float = 0.0


def first_stopped(stalls: Iterable[RankStall], states: Mapping[int, str] | None = None) -> RankStall | None:
    """The rank that stopped progressing first: a rank whose process state explains a hang by
    itself (stopped, disk-sleep, ...) before ranks that wait (sleeping, or running: a CUDA wait
    can spin); then the earliest last step by the workers' own clock; then the lowest rank."""
    states = states or {}

    def key(s: RankStall):
        suspect = states.get(s.local_rank, "") in SUSPECT_STATES
        last = s.last_progress_s if s.last_progress_s is not None else float("-inf")
        return (not suspect, last, s.local_rank)

    ordered = sorted(stalls, key=key)
    return ordered[0] if ordered else None


@dataclass
class _WorkerTrack:
    last_key: tuple[int, int] | None = None  # (pid, seq) of the last record seen
    last_progress_at: float | None = None  # detector clock when progress was seen
    last_beat: Heartbeat | None = None


class HangDetector:
    """Says whether the local worker group is hung.

    Rules (one detector per agent, reset by start() whenever workers are (re)started):
    - Progress is any new heartbeat record (a new (pid, seq)): every optimizer step (the
      worker entry point hooks torch's optimizers) and every report_step call counts.
    - A worker is *armed* by its first record after start(). A worker that never makes a
      step (no optimizer, no report_step) is never armed, so the detector never fires for it.
    - An armed worker that shows no progress for the timeout is hung, even if the others
      progress: they will block in its next collective anyway.
    - A worker whose script returned or raised (a finished record) is no longer judged:
      the interpreter's teardown of a torch process can take seconds.
    - judge_silent_workers=False (default): a worker that has not reported yet is not
      judged. With True it is judged from the later of its start and the first record of
      any local worker; this catches a rank stuck before its first step.
    - Progress time is the detector's clock at the observation that saw the new record,
      so the poll interval adds to the detection latency but the verdict never depends on
      the worker's clock. Step intervals for the auto timeout use the worker's clock.
    """

    def __init__(
        self,
        *,
        hang_timeout_s: float | None = None,
        timeout: HangTimeout | None = None,
        clock: Callable[[], float] = time.monotonic,
        judge_silent_workers: bool = False,
    ) -> None:
        if timeout is None:
            if hang_timeout_s is None:
                raise ConfigError("a hang detector needs a timeout (hang_timeout_s or timeout)")
            timeout = HangTimeout(fixed_s=hang_timeout_s)
        self.timeout = timeout
        self._clock = clock
        self._judge_silent = judge_silent_workers
        self._started_at = clock()
        self._first_report_at: float | None = None
        self._workers: dict[int, _WorkerTrack] = {}

    @property
    def hang_timeout_s(self) -> float:
        return self.timeout.current_s()

    def start(self, local_ranks: Iterable[int]) -> None:
        """Forget the workers: these were just (re)started. The learned step times stay."""
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
        if beat.finished:  # the script is done; its process is exiting
            self._workers.pop(local_rank, None)
            return
        key = (beat.pid, beat.seq)
        if key == track.last_key:
            return
        now = self._clock()
        prev = track.last_beat
        if prev is not None and prev.pid == beat.pid and beat.seq > prev.seq:
            self.timeout.observe_interval(beat.timestamp_s - prev.timestamp_s, beat.seq - prev.seq)
        track.last_key = key
        track.last_progress_at = now
        track.last_beat = beat
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
        timeout_s = self.timeout.current_s()
        stalls: dict[int, float] = {}
        for rank, track in self._workers.items():
            if track.last_progress_at is not None:
                stalled = now - track.last_progress_at
            elif self._judge_silent and self._first_report_at is not None:
                stalled = now - max(self._started_at, self._first_report_at)
            else:
                continue
            stalls[rank] = stalled
        stuck = tuple(sorted(r for r, stalled in stalls.items() if stalled >= timeout_s))
        if not stuck:
            return HangVerdict(hung=False, timeout_s=timeout_s)
        # Who stopped first is chosen among every rank without progress for half the timeout, not only those
        # past it: the ranks of a lock-step group stop within a monitor tick of each other, and the one past
        # the timeout first is merely the one whose last step this agent happened to see first.
        candidates = tuple(sorted(r for r, stalled in stalls.items() if stalled >= timeout_s / 2))
        worst = max(stalls[r] for r in stuck)
        silent = [r for r in stuck if self._workers[r].last_progress_at is None]
        detail = f"; never reported: {silent}" if silent else ""
        reason = (f"local rank(s) {list(stuck)} made no step progress for {worst:.1f} s "
                  f"({self.timeout.describe()}){detail}")
        details = []
        for rank in candidates:
            beat = self._workers[rank].last_beat
            details.append(RankStall(local_rank=rank, pid=beat.pid if beat else None,
                                     last_step=beat.step if beat else None,
                                     last_progress_s=beat.timestamp_s if beat else None, stalled_s=stalls[rank]))
        return HangVerdict(hung=True, stuck=stuck, stalled_s=worst, reason=reason, stalls=tuple(details),
                           timeout_s=timeout_s)
