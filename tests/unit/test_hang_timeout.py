"""The default (auto) hang timeout and the naming of the rank that stopped first; clocks injected."""

from __future__ import annotations

import pytest

from elastic_rt.diagnostics.hang import AUTO_FLOOR_S, HangDetector, HangTimeout, RankStall, first_stopped
from elastic_rt.agent.policy import HealthPolicy
from elastic_rt.errors import ConfigError
from elastic_rt.worker_reports.heartbeat import Heartbeat
from tests.support.clock import FakeClock


def beat(seq: int, ts: float, *, pid: int = 100, step: int | None = None) -> Heartbeat:
    return Heartbeat(pid=pid, seq=seq, step=seq if step is None else step, timestamp_s=ts, age_s=0.0)


def test_auto_is_the_floor_until_steps_say_otherwise():
    t = HangTimeout()
    assert t.auto and t.current_s() == AUTO_FLOOR_S == 300.0
    for _ in range(50):
        t.observe_interval(1.0, 1)  # 1-second steps: 20 x 1 s and 2 x 1 s are below the floor
    assert t.median_step_s() == 1.0
    assert t.current_s() == 300.0


def test_auto_scales_with_slow_steps_and_long_pauses():
    t = HangTimeout()
    for _ in range(20):
        t.observe_interval(30.0, 1)  # 30-second steps
    assert t.current_s() == 600.0  # 20 x median
    t.observe_interval(400.0, 1)  # one evaluation pause of 400 s between two steps
    assert t.current_s() == 800.0  # 2 x longest pause
    assert "800 s" in t.describe() and "longest pause 400 s" in t.describe()


def test_several_steps_between_two_looks_count_per_step():
    t = HangTimeout()
    t.observe_interval(2.0, 20)  # 20 steps of 0.1 s seen in one poll
    assert t.median_step_s() == pytest.approx(0.1)
    t.observe_interval(-1.0, 1)  # a clock going backwards (another pid) is ignored
    t.observe_interval(1.0, 0)
    assert len(t._step_times) == 1


def test_floor_doubles_after_each_hang_restart_so_a_long_pause_cannot_crash_loop():
    t = HangTimeout()
    t.on_hang_restart()
    assert t.current_s() == 600.0
    t.on_hang_restart()
    assert t.current_s() == 1200.0
    fixed = HangTimeout(fixed_s=5)
    fixed.on_hang_restart()
    assert not fixed.auto and fixed.current_s() == 5.0 and fixed.describe() == "hang timeout 5 s"


@pytest.mark.parametrize("bad", [0, -1])
def test_fixed_timeout_must_be_positive(bad):
    with pytest.raises(ConfigError):
        HangTimeout(fixed_s=bad)


def test_detector_learns_from_the_workers_clock_not_from_the_first_step():
    clock = FakeClock(1000.0)
    det = HangDetector(timeout=HangTimeout(), clock=clock)
    det.start([0])
    clock.now += 900  # compilation before the first step: never judged, never learned
    det.observe(0, beat(1, ts=900.0))
    for seq in range(2, 12):
        clock.now += 40
        det.observe(0, beat(seq, ts=900.0 + 40 * (seq - 1)))
    assert det.timeout.median_step_s() == 40.0
    assert det.hang_timeout_s == 800.0  # 20 x 40 s
    clock.now += 799
    assert not det.check().hung
    clock.now += 1
    verdict = det.check()
    assert verdict.hung and verdict.timeout_s == 800.0
    assert verdict.stalls == (RankStall(local_rank=0, pid=100, last_step=11, last_progress_s=1300.0,
                                        stalled_s=800.0),)
    det.start([0])  # a restart forgets the workers, not what was learned
    assert det.hang_timeout_s == 800.0


def test_auto_policy_fires_only_after_a_first_step_and_backs_off():
    clock = FakeClock(1000.0)
    beats = {0: None}
    policy = HealthPolicy(heartbeats=lambda: beats, hang_timeout_s=None, clock=clock)
    policy.on_workers_started([0])
    clock.now += 10_000  # no step ever: not judged
    assert policy.check() is None
    beats[0] = beat(1, ts=1.0)
    assert policy.check() is None
    clock.now += 300
    assert policy.check() == "hang"
    assert policy.last_hang.stuck == (0,) and "auto hang timeout 300 s" in policy.last_hang.reason
    policy.on_hang_restart()  # the agent restarted for it
    policy.on_workers_started([0])
    beats[0] = beat(1, ts=2.0, pid=101)
    assert policy.check() is None
    clock.now += 300
    assert policy.check() is None  # the floor is now 600 s
    clock.now += 300
    assert policy.check() == "hang"


def test_zero_turns_hang_detection_off():
    policy = HealthPolicy(heartbeats=lambda: {0: beat(1, ts=0.0)}, hang_timeout_s=0)
    assert policy.describe_hang_timeout() == "hang detection off"
    assert policy.check() is None


def stall(rank: int, last: float | None) -> RankStall:
    return RankStall(local_rank=rank, pid=100 + rank, last_step=5, last_progress_s=last, stalled_s=10.0)


def test_first_stopped_prefers_a_stopped_or_uninterruptible_process():
    stalls = [stall(0, 10.0), stall(1, 12.0), stall(2, 11.0)]
    assert first_stopped(stalls, {0: "sleeping", 1: "stopped", 2: "sleeping"}).local_rank == 1
    assert first_stopped(stalls, {0: "running", 1: "sleeping", 2: "disk-sleep"}).local_rank == 2
    # all merely waiting (a CUDA wait can spin: running is no evidence): the earliest last step
    assert first_stopped(stalls, {0: "running", 1: "sleeping", 2: "running"}).local_rank == 0
    assert first_stopped([], {}) is None
    assert first_stopped([stall(3, None), stall(1, 5.0)]).local_rank == 3  # never reported: first


def test_a_finished_worker_is_not_judged_while_it_exits(tmp_path):
    from elastic_rt.worker_reports.heartbeat import HeartbeatWriter, read_heartbeat

    path = str(tmp_path / "worker-0")
    writer = HeartbeatWriter(path)
    clock = FakeClock(1000.0)
    det = HangDetector(hang_timeout_s=5, clock=clock)
    det.start([0, 1])
    writer.tick()
    det.observe_all({0: read_heartbeat(path), 1: beat(1, ts=0.0, pid=7)})
    writer.finish()  # the script returned; the interpreter's teardown takes its time
    finished = read_heartbeat(path)
    assert finished.finished and finished.seq == 2 and finished.step == 1
    det.observe_all({0: finished, 1: beat(1, ts=0.0, pid=7)})
    clock.now += 60
    assert det.check().stuck == (1,)  # rank 1 is still judged
    writer.close()


def test_the_rank_seen_stopping_a_tick_later_is_still_a_candidate_for_first_stopped():
    # a lock-step group: rank 1 is SIGSTOPped after step 5, rank 0 blocks in step 6's all-reduce; the agent
    # happened to see rank 0's step 5 one look before rank 1's. When rank 0 passes the timeout, rank 1 is
    # 0.3 s short of it: it is not stuck yet, but it must be among those who may have stopped first.
    clock = FakeClock(1000.0)
    det = HangDetector(hang_timeout_s=5, clock=clock)
    det.start([0, 1, 2])
    det.observe_all({0: beat(5, ts=50.0, pid=10), 1: beat(4, ts=49.9, pid=11), 2: beat(1, ts=46.0, pid=12)})
    clock.now += 0.3
    det.observe_all({0: beat(5, ts=50.0, pid=10), 1: beat(5, ts=50.01, pid=11), 2: beat(1, ts=46.0, pid=12)})
    clock.now += 2.7
    det.observe(2, beat(2, ts=52.7, pid=12))  # rank 2 (not in lock-step with them) still progresses
    clock.now += 2.0
    verdict = det.check()
    assert verdict.hung and verdict.stuck == (0,) and "local rank(s) [0] made no step progress for 5.0 s" in verdict.reason
    assert [s.local_rank for s in verdict.stalls] == [0, 1]  # rank 2 progressed 2 s ago: below half the timeout
    first = first_stopped(verdict.stalls, {0: "sleeping", 1: "stopped", 2: "running"})
    assert first.local_rank == 1 and first.last_step == 5
    assert first_stopped(verdict.stalls, {0: "sleeping", 1: "sleeping"}).local_rank == 0  # its last step was earlier
