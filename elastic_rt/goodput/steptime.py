"""Per-rank step timing from the step heartbeats sampled every monitor tick: Δtime/Δstep between two
reports, and its median per window (robust to the odd long step: a checkpoint save, an evaluation);
and compute time per step (outside backward() and collectives, goodput/compute.py), which names the
slow rank of a lock-step job where step times are all the same: its mean per window, leaving out the
slowest tenth (a save, an evaluation). A mean, because in lock-step every delay of one rank delays the
job: a rank stalled on a third of its steps (a data loader, a CPU quota's bursts) holds the others back
by a third of a stall per step, and a median would not move."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from elastic_rt.worker_reports.heartbeat import Heartbeat


@dataclass(frozen=True)
class StepObservation:
    """`steps` steps of one local rank that took `duration_s` each on average (one tick's worth)."""

    local_rank: int
    duration_s: float
    steps: int


def weighted_median(values: Iterable[tuple[float, int]]) -> float:
    """Median of (value, weight) pairs: the smallest value with at least half the weight at or below it."""
    pairs = sorted((v, w) for v, w in values if w > 0)
    if not pairs:
        raise ValueError("weighted_median of nothing")
    half = sum(w for _, w in pairs) / 2.0
    acc = 0
    for v, w in pairs:
        acc += w
        if acc >= half:
            return v
    return pairs[-1][0]


@dataclass(frozen=True)
class WindowMedians:
    """One window's figures per local rank: median step time, and (trimmed mean) compute time where the
    workers time it."""

    step: dict[int, float]
    compute: dict[int, float]


def trimmed_mean(values: Iterable[tuple[float, int]], trim: float = 0.1) -> float:
    """Weighted mean of (value, weight) pairs without the top `trim` of the weight (the largest values)."""
    pairs = sorted((v, w) for v, w in values if w > 0)
    if not pairs:
        raise ValueError("trimmed_mean of nothing")
    keep = sum(w for _, w in pairs) * (1.0 - trim)
    total = weight = 0.0
    for v, w in pairs:
        take = min(float(w), keep - weight)
        if take <= 0:
            break
        total += v * take
        weight += take
    return total / weight


COMPUTE_TRIM = 0.1


class StepTimer:
    """Step time per local rank, from the workers' own report times (CLOCK_MONOTONIC of the writer).

    Works for any step length: with 1 ms steps one tick sees ~100 steps (their mean is one
    observation of weight 100); with 60 s steps most ticks see none. Two reports of the same
    step, or a step going back (a new worker), give no observation; neither does the switch from
    the optimizer step count to the script's own step numbers (a worker that resumed at step N
    shows 1, its first optimizer step, then N + 1 from report_step: not N steps in no time).
    """

    def __init__(self, *, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._last: dict[int, tuple[float, int, int]] = {}  # rank -> (report time, step, seq)
        self._window: dict[int, list[tuple[float, int]]] = {}
        self._last_compute: dict[int, tuple[int, int, int]] = {}  # rank -> (pid, compute_ns, timed)
        self._compute: dict[int, list[tuple[float, int]]] = {}
        self._window_start = clock()

    def reset(self, local_ranks: Iterable[int]) -> None:
        """New workers: forget the old ones' reports and start a fresh window."""
        self._last, self._last_compute = {}, {}
        self._window = {rank: [] for rank in local_ranks}
        self._compute = {rank: [] for rank in self._window}
        self._window_start = self._clock()

    def observe(self, beats: Mapping[int, Heartbeat | None]) -> list[StepObservation]:
        """Fold one tick's heartbeats in; returns the new observations (for the histogram)."""
        out: list[StepObservation] = []
        for rank, beat in beats.items():
            if beat is None:
                continue
            last = self._last.get(rank)
            # one counter (the optimizer's: step == seq) before, another (report_step's) now
            renumbered = last is not None and last[1] == last[2] and beat.step != beat.seq
            if last is not None and beat.step > last[1] and beat.timestamp_s > last[0] and not renumbered:
                steps = beat.step - last[1]
                obs = StepObservation(rank, (beat.timestamp_s - last[0]) / steps, steps)
                self._window.setdefault(rank, []).append((obs.duration_s, steps))
                out.append(obs)
            if last is None or beat.step != last[1]:
                self._last[rank] = (beat.timestamp_s, beat.step, beat.seq)
            self._observe_compute(rank, beat)
        return out

    def _observe_compute(self, rank: int, beat: Heartbeat) -> None:
        last = self._last_compute.get(rank)
        if last is not None and last[0] == beat.pid and beat.timed_steps > last[2]:
            steps = beat.timed_steps - last[2]
            self._compute.setdefault(rank, []).append((max(0, beat.compute_ns - last[1]) / 1e9 / steps, steps))
        if last is None or last[0] != beat.pid or beat.timed_steps != last[2]:
            self._last_compute[rank] = (beat.pid, beat.compute_ns, beat.timed_steps)

    def window_due(self, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        return now - self._window_start >= self.window_s

    def close_window(self, now: float | None = None) -> WindowMedians:
        """The step and compute time of each rank over the window that ends now; a rank that
        made no (timed) step in the window is left out (it may be waiting for the others; stalls are
        the hang detector's)."""
        now = self._clock() if now is None else now
        medians = WindowMedians(step={rank: weighted_median(obs) for rank, obs in self._window.items() if obs},
                                compute={rank: trimmed_mean(obs, COMPUTE_TRIM)
                                         for rank, obs in self._compute.items() if obs})
        self._window = {rank: [] for rank in self._window}
        self._compute = {rank: [] for rank in self._compute}
        self._window_start = now
        return medians
