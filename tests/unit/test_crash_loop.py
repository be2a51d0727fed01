"""The crash-loop judge: which failures repeat, when the streaks end a job, and the verdict line."""

from __future__ import annotations

import json

from elastic_rt.agent.crash_loop import (
    CrashLoopJudge,
    CrashLoopSettings,
    FailureRecord,
    Rule,
    failure_record,
    hang_record,
)
from elastic_rt.diagnostics.failures import ClassifiedFailure
from elastic_rt.decisions import FailureCause
from elastic_rt.worker_reports.checkpoint import CheckpointReportReader, report_checkpoint
from elastic_rt.worker_reports.heartbeat import Heartbeat


def _rec(step: int | None, *, sig: str = "exception|ValueError|train.py:88 in step", committed: int | None = None,
         stepped: bool = True, rank: int = 3) -> FailureRecord:
    return FailureRecord(rank=rank, signature=sig, description="ValueError: bad batch at train.py:88 in step",
                         step=step, stepped=stepped, committed=committed)


def test_the_same_failure_at_the_same_step_ends_the_job_after_n_repeats():
    judge = CrashLoopJudge(CrashLoopSettings(repeats=3))
    assert [judge.on_failure(_rec(1200)) for _ in range(3)] == [None, None, None]
    verdict = judge.on_failure(_rec(1200))
    assert verdict.rule is Rule.REPEATS and verdict.failures == 4
    assert verdict.line(judge.settings) == (
        "rank 3 fails at step 1200 every time (ValueError: bad batch at train.py:88 in step); 4 times in a row, "
        "not restarting (--crash-loop-repeats 3; exit code 3: do not requeue)")


def test_failures_that_progress_keep_being_restarted():
    judge = CrashLoopJudge(CrashLoopSettings(repeats=1, no_step=2))
    # the same exception, but at a later step each time (no checkpoints): progress
    assert all(judge.on_failure(_rec(step)) is None for step in range(10, 200, 10))
    # with checkpoints: each attempt resumes from a later commit and fails further on
    judge = CrashLoopJudge(CrashLoopSettings(repeats=1))
    assert all(judge.on_failure(_rec(c + 50, committed=c)) is None for c in (1000, 1100, 1200))
    # different failures at the same step are not a loop
    judge = CrashLoopJudge(CrashLoopSettings(repeats=1))
    assert judge.on_failure(_rec(5, sig="a")) is None and judge.on_failure(_rec(5, sig="b")) is None


def test_no_commit_in_between_makes_a_moving_failure_a_loop():
    judge = CrashLoopJudge(CrashLoopSettings(repeats=2))
    assert judge.on_failure(_rec(1230, committed=1200)) is None
    assert judge.on_failure(_rec(1260, committed=1200)) is None
    verdict = judge.on_failure(_rec(1241, committed=1200))
    assert verdict.rule is Rule.REPEATS and "no checkpoint past step 1200" in verdict.line(judge.settings)


def test_failures_before_any_step_end_the_job_after_k():
    judge = CrashLoopJudge(CrashLoopSettings(repeats=0, no_step=3))
    assert judge.on_failure(_rec(None, sig="a", stepped=False)) is None
    assert judge.on_failure(_rec(None, sig="b", stepped=False)) is None
    verdict = judge.on_failure(_rec(None, sig="c", stepped=False))
    assert verdict.rule is Rule.NO_STEP and verdict.failures == 3
    assert verdict.line(judge.settings).startswith("rank 3 fail before any step, 3 times in a row")
    judge = CrashLoopJudge(CrashLoopSettings(repeats=0, no_step=2))
    judge.on_failure(_rec(None, stepped=False))
    assert judge.on_failure(_rec(4)) is None and judge.on_failure(_rec(None, stepped=False)) is None  # a step reset it


def test_off_and_a_failure_given_back():
    judge = CrashLoopJudge(CrashLoopSettings(repeats=0, no_step=0))
    assert all(judge.on_failure(_rec(5, stepped=False)) is None for _ in range(20))
    judge = CrashLoopJudge(CrashLoopSettings(repeats=1))
    judge.on_failure(_rec(5))
    judge.forget_last()  # that one was a lost peer's doing
    assert judge.on_failure(_rec(5)) is None


def _beat(step: int) -> Heartbeat:
    return Heartbeat(pid=1, seq=step, step=step, timestamp_s=0.0, age_s=0.0)


def test_failure_record_takes_the_root_cause_and_ignores_the_message_text():
    raised = ClassifiedFailure(cause=FailureCause.EXCEPTION, detail="ValueError: loss is nan (0.3 s)",
                               frame="train.py:88 in step")
    broken = ClassifiedFailure(cause=FailureCause.COLLECTIVE_ERROR, detail="RuntimeError: Connection closed by peer")
    rec = failure_record({0: (0, broken), 5: (1, raised)}, {0: _beat(40), 1: _beat(41)}, committed=None)
    assert (rec.rank, rec.step, rec.stepped) == (5, 41, True)
    assert rec.description == "ValueError: loss is nan (0.3 s) at train.py:88 in step"
    other_text = ClassifiedFailure(cause=FailureCause.EXCEPTION, detail="ValueError: loss is nan (0.4 s)",
                                   frame="train.py:88 in step")
    assert failure_record({5: (1, other_text)}, {1: _beat(41)}, None).signature == rec.signature
    segv = failure_record({2: (0, ClassifiedFailure(cause=FailureCause.SIGNAL, detail="SIGSEGV"))}, {0: None}, 7)
    assert (segv.signature, segv.step, segv.stepped, segv.committed) == ("signal|SIGSEGV", None, False, 7)
    hang = hang_record(1, "cause=hang: rank 1 stopped first", {0: _beat(9), 1: _beat(8)}, None)
    assert (hang.signature, hang.step) == ("hang", 9)


def test_the_committed_step_comes_from_the_workers_reports(tmp_path):
    judge = CrashLoopJudge(CrashLoopSettings(), checkpoints=CheckpointReportReader(str(tmp_path)))
    assert judge.committed_step() is None
    report_checkpoint(step=300, save_duration_s=1.0, blocked_s=0.1,
                      env={"ELASTIC_RT_HEARTBEAT_FILE": str(tmp_path / "worker-0")})
    assert judge.committed_step() == 300 and judge.committed_step() == 300  # read once, kept
    assert json.loads((tmp_path / "checkpoint.json").read_text())["step"] == 300
