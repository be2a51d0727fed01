"""The crash-loop verdict: restarts that make no progress end the job with one line and exit code 3
(do not requeue), instead of restarting until --max-restarts and being requeued to fail again.

The agent hands every failure it would restart for (a worker failure or a hang, counted against
--max-restarts) to the judge. A failure *repeats* the one before it when it is the same failure (the
same cause, exception type and user-code frame, or the same signal or exit code) and either happened
at the same step or came with no checkpoint committed since the one before. Two rules, each a flag:
- --crash-loop-repeats N: the first failure and N repeats in a row (N restarts that changed nothing);
- --crash-loop-no-step K: K failures in a row after which no worker of this node had made a step
  (import errors, a crash while loading a checkpoint, out of memory at model build).
A failure that does not repeat its predecessor resets the first rule; any step resets the second. Each
agent judges its own workers' failures.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping

from elastic_rt.diagnostics.failures import ClassifiedFailure
from elastic_rt.decisions import FailureCause
from elastic_rt.errors import ConfigError, ElasticRTError
from elastic_rt.worker_reports.checkpoint import CheckpointReportReader
from elastic_rt.worker_reports.heartbeat import Heartbeat
from elastic_rt.sections import option

EXIT_CRASH_LOOP = 3


class CrashLoopError(ElasticRTError):
    """This node's workers fail the same way without progress: restarting cannot help (exit 3)."""

    exit_code = EXIT_CRASH_LOOP


def _count(flag: str):
    def check(value: int) -> int:
        if value < 0:
            raise ConfigError(f"{flag} {value}: must be >= 0 (0 = off)")
        return value

    return check


class Rule(str, Enum):
    REPEATS = "repeats"  # the same failure, at the same step or with no commit in between
    NO_STEP = "no_step"  # no step at all between failures


@dataclass(frozen=True, kw_only=True)
class CrashLoopSettings:
    """The crash-loop judge's config section: --crash-loop-repeats (0 = off), --crash-loop-no-step (0 = off)."""

    repeats: int = option(
        "--crash-loop-repeats", type=int, default=3, parse=_count("--crash-loop-repeats"),
        help="end the job (exit 3: do not requeue) when a worker failure repeats this many times in a row: the "
             "same failure at the same step, or with no checkpoint committed in between (default 3; 0 = off; "
             "docs/failures.md)")
    no_step: int = option(
        "--crash-loop-no-step", type=int, default=5, parse=_count("--crash-loop-no-step"),
        help="end the job (exit 3) after this many failures in a row with no step made in between (default 5; "
             "0 = off)")


@dataclass(frozen=True, kw_only=True)
class FailureRecord:
    """One failure the agent would restart for: who failed, how, and where training was."""

    rank: int  # global rank of the root-cause worker (-1: none could be named)
    signature: str  # what makes two failures the same
    description: str  # for the verdict line: "ValueError: bad batch at train.py:88 in step"
    step: int | None  # that worker's last step (None: it made none)
    stepped: bool  # some local worker made a step since the workers started
    committed: int | None  # the last committed checkpoint step this node was told of


@dataclass(frozen=True, kw_only=True)
class CrashLoopVerdict:
    rule: Rule
    failures: int  # failures in the streak
    record: FailureRecord

    def line(self, settings: CrashLoopSettings) -> str:
        r = self.record
        who = f"rank {r.rank}" if r.rank >= 0 else "the workers"
        if self.rule is Rule.NO_STEP:
            return (f"{who} fail before any step, {self.failures} times in a row ({r.description}); not restarting "
                    f"(--crash-loop-no-step {settings.no_step}; exit code {EXIT_CRASH_LOOP}: do not requeue)")
        where = f"at step {r.step}" if r.step is not None else "before its first step"
        how = "every time" if r.committed is None else f"every time, no checkpoint past step {r.committed}"
        return (f"{who} fails {where} {how} ({r.description}); {self.failures} times in a row, not restarting "
                f"(--crash-loop-repeats {settings.repeats}; exit code {EXIT_CRASH_LOOP}: do not requeue)")


def failure_record(classified: Mapping[int, tuple[int, ClassifiedFailure]],
                   heartbeats: Mapping[int, Heartbeat | None], committed: int | None) -> FailureRecord:
    """classified: global rank -> (local rank, cause) of this node's own failed workers; the root cause is
    the first by cause (an exception before the collective errors it caused), then by rank."""
    stepped = any(b is not None for b in heartbeats.values())
    if not classified:
        return FailureRecord(rank=-1, signature="unknown", description="no failure classified", step=None,
                             stepped=stepped, committed=committed)
    order = list(FailureCause)
    rank, (local, cause) = min(classified.items(), key=lambda kv: (order.index(kv[1][1].cause), kv[0]))
    beat = heartbeats.get(local)
    where = f" at {cause.frame}" if cause.frame else ""
    if cause.frame:  # an exception in user code: its type and where it was raised (not its changing text)
        signature = f"{cause.cause}|{cause.detail.split(':', 1)[0]}|{cause.frame}"
    else:
        signature = f"{cause.cause}|{cause.detail}"
    return FailureRecord(rank=rank, signature=signature, description=f"{cause.detail}{where}",
                         step=beat.step if beat is not None else None, stepped=stepped, committed=committed)


def hang_record(rank: int, description: str, heartbeats: Mapping[int, Heartbeat | None],
                committed: int | None) -> FailureRecord:
    """A hang restart: the same when it stalls at the same step."""
    steps = [b.step for b in heartbeats.values() if b is not None]
    return FailureRecord(rank=rank, signature=f"{FailureCause.HANG}", description=description,
                         step=max(steps) if steps else None, stepped=bool(steps), committed=committed)


class CrashLoopJudge:
    """Keeps the streaks; on_failure() says when they reach their limit."""

    def __init__(self, settings: CrashLoopSettings, *, checkpoints: CheckpointReportReader | None = None) -> None:
        self.settings = settings
        self._checkpoints = checkpoints
        self._committed: int | None = None
        self._history: list[FailureRecord] = []

    def committed_step(self) -> int | None:
        """The last committed step the workers reported (report_checkpoint), read now."""
        if self._checkpoints is not None:
            report = self._checkpoints.read_new()
            if report is not None:
                self._committed = report.step
        return self._committed

    def on_failure(self, record: FailureRecord) -> CrashLoopVerdict | None:
        self._history.append(record)
        repeats = self._streak(_repeats)
        if self.settings.repeats and repeats > self.settings.repeats:
            return CrashLoopVerdict(rule=Rule.REPEATS, failures=repeats, record=record)
        no_step = self._streak(lambda prev, _cur: not prev.stepped, first=lambda r: not r.stepped)
        if self.settings.no_step and no_step >= self.settings.no_step:
            return CrashLoopVerdict(rule=Rule.NO_STEP, failures=no_step, record=record)
        return None

    def forget_last(self) -> None:
        """The last failure was a symptom of a lost peer (its restart was given back): not this job's loop."""
        if self._history:
            self._history.pop()

    def _streak(self, same, first=lambda _r: True) -> int:
        """How many failures at the end of the history form a chain (each `same` as the one before)."""
        hist = self._history
        if not hist or not first(hist[-1]):
            return 0
        n = 1
        while n < len(hist) and same(hist[-n - 1], hist[-n]):
            n += 1
        return n


def _repeats(prev: FailureRecord, cur: FailureRecord) -> bool:
    if prev.signature != cur.signature:
        return False
    no_commit = cur.committed is not None and cur.committed == prev.committed
    return cur.step == prev.step or no_commit

