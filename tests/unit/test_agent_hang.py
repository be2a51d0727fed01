"""HangDetector: pure rules over heartbeat observations, with an injected clock."""

from __future__ import annotations

import pytest

from elastic_rt.errors import ConfigError
from elastic_rt.diagnostics.hang import HangDetector
from elastic_rt.worker_reports.heartbeat import Heartbeat
from tests.support.clock import FakeClock


def beat(seq: int, *, step: int | None = None, pid: int = 100) -> Heartbeat:
    return Heartbeat(pid=pid, seq=seq, step=seq if step is None else step, timestamp_s=0.0, age_s=0.0)


def make(timeout_s: float = 10.0, **kw) -> tuple[HangDetector, FakeClock]:
    clock = FakeClock(1000.0)
    det = HangDetector(hang_timeout_s=timeout_s, clock=clock, **kw)
    det.start([0, 1])
    return det, clock


def test_never_fires_for_a_script_that_never_reports():
    det, clock = make()
    for _ in range(10):
        clock.advance(100)
        det.observe_all({0: None, 1: None})
        assert not det.check().hung
    assert det.armed() == ()


def test_progressing_workers_are_not_hung():
    det, clock = make()
    for seq in range(1, 30):
        clock.advance(5)
        det.observe_all({0: beat(seq), 1: beat(seq, pid=101)})
        assert not det.check().hung


def test_one_stuck_worker_is_a_hang_even_if_the_other_progresses():
    det, clock = make(timeout_s=10)
    det.observe_all({0: beat(1), 1: beat(1, pid=101)})
    for seq in range(2, 5):
        clock.advance(3)
        det.observe_all({0: beat(seq), 1: beat(1, pid=101)})  # rank 1 stuck at seq 1
    assert not det.check().hung  # 9 s < 10 s
    clock.advance(1.5)
    verdict = det.check()
    assert verdict.hung and verdict.stuck == (1,)
    assert verdict.stalled_s == pytest.approx(10.5)
    assert "local rank(s) [1]" in verdict.reason and "10 s" in verdict.reason


def test_same_step_reported_again_counts_as_progress():
    det, clock = make(timeout_s=10)
    for seq in range(1, 6):
        det.observe(0, beat(seq, step=7))
        clock.advance(6)
        assert not det.check().hung


def test_silent_worker_not_judged_by_default():
    det, clock = make(timeout_s=10)
    for seq in range(1, 10):
        det.observe_all({0: beat(seq), 1: None})  # rank 1 never reports (rank-0-only logging)
        clock.advance(5)
    assert not det.check().hung


def test_silent_worker_judged_from_first_report_when_asked():
    det, clock = make(timeout_s=10, judge_silent_workers=True)
    clock.advance(60)  # long start-up before anyone reports: not counted
    det.observe_all({0: beat(1), 1: None})
    clock.advance(9)
    det.observe_all({0: beat(2), 1: None})
    assert not det.check().hung
    clock.advance(1)
    det.observe_all({0: beat(3), 1: None})
    verdict = det.check()
    assert verdict.hung and verdict.stuck == (1,)
    assert "never reported: [1]" in verdict.reason


def test_start_resets_and_remove_forgets():
    det, clock = make(timeout_s=10)
    det.observe_all({0: beat(1), 1: beat(1, pid=101)})
    clock.advance(20)
    assert det.check().stuck == (0, 1)
    det.remove(1)
    assert det.check().stuck == (0,)
    det.start([0, 1])
    assert not det.check().hung and det.armed() == ()
    # The same record seen after a restart arms the worker again (new pid in practice).
    det.observe(0, beat(1, pid=200))
    clock.advance(11)
    assert det.check().stuck == (0,)


def test_unknown_ranks_are_ignored():
    det, clock = make()
    det.observe(7, beat(1))
    clock.advance(100)
    assert not det.check().hung


def test_timeout_must_be_positive():
    with pytest.raises(ConfigError):
        HangDetector(hang_timeout_s=0)


def test_with_real_heartbeat_files(tmp_path):
    from elastic_rt.worker_reports.heartbeat import HeartbeatReader, HeartbeatWriter, prepare_heartbeat_file

    paths = {0: str(tmp_path / "0.hb"), 1: str(tmp_path / "1.hb")}
    for p in paths.values():
        prepare_heartbeat_file(p)
    clock = FakeClock(1000.0)
    det = HangDetector(hang_timeout_s=30, clock=clock)
    det.start(paths)
    reader = HeartbeatReader(paths)
    writers = {r: HeartbeatWriter(p) for r, p in paths.items()}
    try:
        for step in range(5):
            for w in writers.values():
                w.report(step)
            det.observe_all(reader.read())
            clock.advance(10)
        assert not det.check().hung
        for step in range(5, 9):  # rank 0 keeps going, rank 1 is stuck
            writers[0].report(step)
            det.observe_all(reader.read())
            clock.advance(10)
        verdict = det.check()
        assert verdict.hung and verdict.stuck == (1,)
    finally:
        for w in writers.values():
            w.close()
