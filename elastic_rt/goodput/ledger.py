"""Goodput accounting: one agent's wall time since the job started, split into categories that sum to it.

Phases follow the agent's events: startup (to the first step the job ever made), training, restart
(from a detected failure or membership change until new workers run: stop, rendezvous, start),
restore (new workers until their first step: process start, process group, checkpoint load), other
(after the workers finished, waiting for the other nodes). Training time is *uncommitted* until it
is settled: a checkpoint commit of step C makes the training up to C productive (and the time the
save blocked training, checkpoint); a failure makes what is still uncommitted lost (those steps are
re-done); a successful end makes it productive. Categories only grow, so they export as counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

CATEGORIES = ("productive", "startup", "restart", "checkpoint", "restore", "lost", "other")
PHASES = ("startup", "training", "restart", "restore", "other")
_MAX_SAMPLES = 100_000  # step samples kept per generation (pruned at each commit)


@dataclass(frozen=True, kw_only=True)
class LostProgress:
    """Training thrown away by a failure: what a restart re-does."""

    steps: int
    seconds: float
    committed_step: int | None  # the last commit known (None: no checkpoint was ever reported)
    last_step: int  # the last step the failed workers reported


@dataclass(kw_only=True)
class _Generation:
    """One set of workers, from its first reported step."""

    start: float
    base: int  # the step this generation started from (its first step is base + 1)
    last_step: int
    settled_until: float
    end: float | None = None  # when training stopped (failure detected, finished)
    commit_pos: int | None = None  # step of the last commit made inside this generation
    samples: list[tuple[float, int]] = field(default_factory=list)  # (time a step was reported, step)


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


class GoodputLedger:
    """Pure accounting with an injected monotonic clock; the observer feeds it the agent's events."""

    def __init__(self, *, started_at: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started_at = clock() if started_at is None else started_at
        self._totals = dict.fromkeys(CATEGORIES, 0.0)
        self.phase = "startup"
        self._since = self.started_at
        self._stepped = False
        self._gen: _Generation | None = None
        self.committed_step: int | None = None

    # ---- queries --------------------------------------------------------------
    def totals(self, now: float | None = None) -> dict[str, float]:
        """Settled seconds per category, the open phase counted up to now (uncommitted time excluded)."""
        now = self._clock() if now is None else now
        out = dict(self._totals)
        if self.phase != "training":
            out[self._category()] += max(0.0, now - self._since)
        return out

    def uncommitted(self, now: float | None = None) -> float:
        """Training time not yet settled: productive if the next commit or the end keeps it, else lost."""
        gen = self._gen
        if gen is None:
            return 0.0
        now = self._clock() if now is None else now
        return max(0.0, (gen.end if gen.end is not None else now) - gen.settled_until)

    def elapsed(self, now: float | None = None) -> float:
        now = self._clock() if now is None else now
        return max(0.0, now - self.started_at)

    def ratio(self, now: float | None = None) -> float:
        """(productive + uncommitted) / elapsed: the share of the wall time whose progress is still held."""
        now = self._clock() if now is None else now
        elapsed = self.elapsed(now)
        if elapsed <= 0:
            return 0.0
        return (self.totals(now)["productive"] + self.uncommitted(now)) / elapsed

    @property
    def phase_since(self) -> float:
        """When the current phase began (monotonic)."""
        return self._since

    # ---- events -----------------------------------------------------------------
    def steps(self, *, step: int, at: float, first_at: float | None = None, now: float | None = None) -> bool:
        """The workers' heartbeats: the highest `step` (reported at `at`), the earliest report at
        `first_at`. Returns True when this is the generation's first step (training starts)."""
        now = self._clock() if now is None else now
        if self.phase in ("startup", "restore"):
            start = _clamp(first_at if first_at is not None else at, self._since, now)
            # Where it resumed: the last commit when the steps count on from it; from scratch
            # without any commit; else (the heartbeats count differently) from just before this step.
            if self.committed_step is None:
                base = min(0, step - 1)
            elif self.committed_step < step:
                base = self.committed_step
            else:
                base = step - 1
            self._switch("training", start)
            self._stepped = True
            self._gen = _Generation(start=start, base=base, last_step=step, settled_until=start,
                                    samples=[(start, step)])
            return True
        gen = self._gen
        if self.phase == "training" and gen is not None and step > gen.last_step:
            gen.last_step = step
            gen.samples.append((_clamp(at, gen.samples[-1][0], now), step))
            if len(gen.samples) > _MAX_SAMPLES:
                del gen.samples[1: len(gen.samples) // 2]
        return False

    def checkpoint(self, *, step: int, save_duration_s: float, blocked_s: float, now: float | None = None) -> None:
        """A commit of `step`: training up to it is productive, the blocked time is checkpoint time."""
        now = self._clock() if now is None else now
        self.committed_step = step
        gen = self._gen
        if gen is None:
            return  # no training in flight: the save's blocked time lies in startup/restore/restart
        end = gen.end if gen.end is not None else now
        t_commit, pos = self._position(gen, step, now - save_duration_s)
        t_commit = _clamp(t_commit, gen.settled_until, end)
        self._totals["productive"] += t_commit - gen.settled_until
        blocked = _clamp(blocked_s, 0.0, end - t_commit)
        self._totals["checkpoint"] += blocked
        gen.settled_until = t_commit + blocked
        gen.commit_pos = pos if gen.commit_pos is None else max(gen.commit_pos, pos)
        keep = next((i for i, (t, _) in enumerate(gen.samples) if t > t_commit), len(gen.samples))
        del gen.samples[: max(0, keep - 1)]

    def restart(self, now: float | None = None) -> None:
        """A failure or membership change was detected: training stops, the restart starts."""
        now = self._clock() if now is None else now
        self._freeze(now)
        self._switch("restart", now)

    def workers_started(self, now: float | None = None) -> LostProgress | None:
        """New workers run: the stopped generation's uncommitted training is lost."""
        now = self._clock() if now is None else now
        self._freeze(now)
        lost = self._settle(kept=False)
        self._switch("restore" if self._stepped else "startup", now)
        return lost

    def finished(self, *, succeeded: bool, now: float | None = None) -> LostProgress | None:
        """The workers ended (succeeded: their progress is kept); what follows is other time."""
        now = self._clock() if now is None else now
        self._freeze(now)
        lost = self._settle(kept=succeeded)
        self._switch("other", now)
        return lost

    # ---- internals ------------------------------------------------------------------
    def _category(self) -> str:
        return {"startup": "startup", "restart": "restart", "restore": "restore", "other": "other"}[self.phase]

    def _switch(self, phase: str, at: float) -> None:
        if self.phase != "training":
            self._totals[self._category()] += max(0.0, at - self._since)
        self.phase = phase
        self._since = at

    def _freeze(self, now: float) -> None:
        if self.phase == "training" and self._gen is not None and self._gen.end is None:
            self._gen.end = now
            self._switch("other", now)  # the caller switches on at the same instant

    def _settle(self, *, kept: bool) -> LostProgress | None:
        gen, self._gen = self._gen, None
        if gen is None:
            return None
        end = gen.end if gen.end is not None else gen.settled_until
        rest = max(0.0, end - gen.settled_until)
        if kept:  # productive up to the last step; the workers' exit after it is other time
            last_t = _clamp(gen.samples[-1][0] if gen.samples else end, gen.settled_until, end)
            self._totals["productive"] += last_t - gen.settled_until
            self._totals["other"] += end - last_t
            return None
        self._totals["lost"] += rest
        since = gen.commit_pos if gen.commit_pos is not None else gen.base
        return LostProgress(steps=max(0, gen.last_step - since), seconds=rest,
                            committed_step=self.committed_step, last_step=gen.last_step)

    @staticmethod
    def _position(gen: _Generation, step: int, fallback_t: float) -> tuple[float, int]:
        """(when `step` was reached, the heartbeat step there) within the generation."""
        if step <= gen.base:
            return gen.start, gen.base
        if step <= gen.last_step:  # reached in this generation: interpolate between samples
            prev_t, prev_s = gen.start, gen.base
            for t, s in gen.samples:
                if s >= step:
                    if s == prev_s:
                        return t, step
                    return prev_t + (t - prev_t) * (step - prev_s) / (s - prev_s), step
                prev_t, prev_s = t, s
        # A step beyond the heartbeats (they count differently): place it by time, when the save began.
        pos = gen.base
        for t, s in gen.samples:
            if t <= fallback_t:
                pos = s
        return fallback_t, pos
