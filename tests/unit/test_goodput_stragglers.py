"""Step timing from heartbeats, the straggler board, and the exchange through a real c10d store."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch.distributed as dist

from elastic_rt.goodput.steptime import StepTimer, weighted_median
from elastic_rt.goodput.stragglers import Signal, SpeedExchange, StragglerBoard, StragglerSettings, Verdict
from elastic_rt.worker_reports.heartbeat import Heartbeat
from tests.support.clock import FakeClock as Clock


def _beat(step: int, t: float, compute_ns: int = 0, timed: int = 0) -> Heartbeat:
    return Heartbeat(pid=1, seq=step, step=step, timestamp_s=t, age_s=0.0, compute_ns=compute_ns, timed_steps=timed)


def _steps(seq: int, ranks: dict[int, float]):
    """A node's window of step times only."""
    return seq, {Signal.STEP_TIME: ranks}


def test_weighted_median():
    assert weighted_median([(1.0, 1), (2.0, 1), (3.0, 1)]) == 2.0
    assert weighted_median([(0.001, 100), (5.0, 1)]) == 0.001  # one long step among many short
    assert weighted_median([(1.0, 1), (9.0, 3)]) == 9.0
    with pytest.raises(ValueError):
        weighted_median([])


def test_millisecond_steps_are_timed_from_ticks_that_see_many():
    clock = Clock(0.0)
    timer = StepTimer(window_s=1.0, clock=clock)
    timer.reset([0])
    obs = []
    for tick in range(1, 11):  # a tick every 100 ms, 100 steps of 1 ms in each
        clock.now = tick * 0.1
        obs += timer.observe({0: _beat(tick * 100, clock.now - 0.0005)})
    assert [o.steps for o in obs] == [100] * 9
    assert all(o.duration_s == pytest.approx(0.001) for o in obs)
    assert timer.window_due()
    assert timer.close_window().step == {0: pytest.approx(0.001)}
    assert not timer.window_due()


def test_slow_steps_are_timed_each_and_a_pause_does_not_move_the_median():
    clock = Clock(0.0)
    timer = StepTimer(window_s=10.0, clock=clock)
    timer.reset([0, 1])
    t, step = 0.0, 0
    for k in range(12):
        step += 1
        t += 20.0 if k == 5 else 0.5  # one checkpoint pause of 20 s
        clock.now = t
        timer.observe({0: _beat(step, t), 1: None})
        timer.observe({0: _beat(step, t), 1: None})  # the same report seen twice: no observation
    medians = timer.close_window()
    assert medians.step == {0: pytest.approx(0.5)}  # rank 1 never reported: left out
    assert medians.compute == {}  # the workers time no compute
    timer.reset([0])
    assert timer.observe({0: _beat(1, t + 1)}) == []  # new workers: the old reports are forgotten


def test_a_resumed_worker_switching_to_its_own_step_numbers_is_not_timed_as_thousands_of_steps():
    clock = Clock(0.0)
    timer = StepTimer(window_s=10.0, clock=clock)
    timer.reset([0])
    # a worker resumed at step 380: its first optimizer step shows as 1 (the optimizer count), then
    # report_step(381); afterwards each step is an optimizer tick (seq + 1) and a report_step (seq + 1)
    beats = [Heartbeat(pid=7, seq=1, step=1, timestamp_s=0.30, age_s=0.0),
             Heartbeat(pid=7, seq=2, step=381, timestamp_s=0.35, age_s=0.0)]
    beats += [Heartbeat(pid=7, seq=2 + 2 * k, step=381 + k, timestamp_s=0.35 + 0.3 * k, age_s=0.0)
              for k in range(1, 6)]
    obs = []
    for beat in beats:
        clock.now = beat.timestamp_s
        obs += timer.observe({0: beat})
    assert [o.steps for o in obs] == [1] * 5 and all(o.duration_s == pytest.approx(0.3) for o in obs)
    assert timer.close_window().step == {0: pytest.approx(0.3)}


def test_board_flags_a_rank_slow_for_n_windows_in_a_row_and_only_it():
    board = StragglerBoard(threshold=1.5, windows=3)
    fast, slow = {0: 0.10, 1: 0.11}, {0: 0.30, 1: 0.10}
    for seq in range(1, 3):
        v = board.update({"a": _steps(seq, fast), "b": _steps(seq, slow)})
        assert v is not None and v.stragglers == ()
    v = board.update({"a": _steps(3, fast), "b": _steps(3, slow)})
    assert [(s.node, s.local_rank, s.windows) for s in v.stragglers] == [("b", 0, 3)]
    assert v.median_s == pytest.approx(0.10) and v.fastest_s == pytest.approx(0.10)
    assert v.stragglers[0].ratio == pytest.approx(3.0)
    # an aggregation without a new window from b changes nothing
    assert board.update({"a": _steps(4, fast), "b": _steps(3, slow)}).stragglers == v.stragglers
    # b recovers: the streak resets
    v = board.update({"a": _steps(5, fast), "b": _steps(4, {0: 0.1, 1: 0.1})})
    assert v.stragglers == ()


def test_board_with_half_the_job_slow_uses_the_lower_median():
    board = StragglerBoard(threshold=1.5, windows=1)
    v = board.update({"a": _steps(1, {0: 0.1, 1: 0.1}), "b": _steps(1, {0: 0.3, 1: 0.3})})
    assert {(s.node, s.local_rank) for s in v.stragglers} == {("b", 0), ("b", 1)}
    assert StragglerBoard(threshold=1.5, windows=1).update({"a": _steps(1, {0: 0.1})}) is None


def test_board_forgets_a_node_that_stopped_publishing():
    board = StragglerBoard(threshold=1.5, windows=1)
    board.update({"a": _steps(1, {0: 0.1}), "b": _steps(1, {0: 0.1}), "c": _steps(1, {0: 1.0})})
    for k in range(2, 6):  # c publishes nothing new (dead, or restarting)
        v = board.update({"a": _steps(k, {0: 0.1}), "b": _steps(k, {0: 0.1}), "c": _steps(1, {0: 1.0})})
    assert v.stragglers == () and v.ranks == 2


def test_verdict_json_round_trip():
    board = StragglerBoard(threshold=1.5, windows=1)
    v = board.update({"a": _steps(1, {0: 0.1}), "b": _steps(1, {0: 0.5})})
    assert Verdict.from_json(v.to_json()) == v


def test_exchange_through_a_store_every_node_learns_the_verdict():
    store = dist.HashStore()
    stop = threading.Event()
    settings = StragglerSettings(threshold=1.5, windows=2, window_s=0.05)
    verdicts: dict[str, list[Verdict]] = {"a": [], "b": [], "c": []}
    medians = {"a": {0: 0.1}, "b": {0: 0.1}, "c": {0: 0.4}}
    seqs = {"a": 0, "b": 0, "c": 0}

    def latest(node):
        def get():
            seqs[node] += 1
            return seqs[node], {Signal.STEP_TIME: medians[node]}
        return get

    exchanges = [SpeedExchange(node=n, settings=settings, latest=latest(n),
                               on_verdict=lambda rnd, v, n=n: verdicts[n].append(v),
                               on_new_round=lambda rnd: None, stop=stop) for n in ("a", "b", "c")]
    try:
        for rank, ex in enumerate(exchanges):
            ex.on_round(round=7, store=store, group_rank=rank, group_world_size=3)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                any(v.stragglers for v in vs) for vs in verdicts.values()):
            time.sleep(0.02)
    finally:
        stop.set()
    for node, vs in verdicts.items():
        flagged = {(s.node, s.local_rank) for v in vs for s in v.stragglers}
        assert flagged == {("c", 0)}, (node, vs[-3:])


class RankZeroAggregates:
    """A c10d store between node b (group rank 1) and rank 0, whose board aggregates when this test says:
    before each of b's windows (rank 0's window closed after b's last exchange) and, in b's `gap_window`-th,
    the moment b's window is in the store (rank 0's window closing during b's exchange)."""

    def __init__(self, board: StragglerBoard, gap_window: int) -> None:
        self.store = dist.HashStore()
        self._board = board
        self._gap_window = gap_window
        self.b_windows = 0

    def aggregate(self) -> None:
        entries = {"a": (self.b_windows + 1, {Signal.COMPUTE: {0: 0.01}})}
        if self.store.check(["elastic-rt/speed/node/1"]):
            data = json.loads(self.store.get("elastic-rt/speed/node/1"))
            entries["b"] = (data["seq"], {Signal(k): {int(r): v for r, v in ranks.items()}
                                          for k, ranks in data["signals"].items()})
        verdict = self._board.update(entries)
        if verdict is not None:
            self.store.set("elastic-rt/speed/verdict", verdict.to_json())

    def set(self, key, value):
        self.store.set(key, value)
        if key == "elastic-rt/speed/node/1" and self.b_windows == self._gap_window:
            self.aggregate()

    def check(self, keys):
        return self.store.check(keys)

    def get(self, key):
        return self.store.get(key)


def test_a_node_is_flagged_by_the_verdict_that_reached_the_streak_however_the_windows_interleave():
    """Rank 0's aggregation lands between node b's publishing and its reading in b's 4th window, after
    landing between b's windows before: b still learns of its flag from the verdict that counted 3 windows
    (read after publishing, b saw only the next one, which counts 4)."""
    settings = StragglerSettings(threshold=1.5, windows=3, window_s=0.001)
    rank0 = RankZeroAggregates(StragglerBoard(threshold=settings.threshold, windows=settings.windows), gap_window=4)
    stop = threading.Event()
    flags: list = []

    def latest():
        if rank0.b_windows:
            rank0.aggregate()  # rank 0's window closed since b's last exchange
        rank0.b_windows += 1
        return rank0.b_windows, {Signal.COMPUTE: {0: 0.1}}

    def on_verdict(rnd, verdict):
        if verdict.stragglers:
            flags.append(verdict.stragglers[0])
            stop.set()

    b = SpeedExchange(node="b", settings=settings, latest=latest, on_verdict=on_verdict,
                      on_new_round=lambda rnd: None, stop=stop)
    b.on_round(round=1, store=rank0, group_rank=1, group_world_size=2)
    assert stop.wait(30) and flags
    assert (flags[0].node, flags[0].local_rank, flags[0].windows) == ("b", 0, 3)


def test_exchange_is_off_without_a_threshold():
    started = []
    before = set(threading.enumerate())  # another test's exchange may still be winding down
    ex = SpeedExchange(node="a", settings=StragglerSettings(threshold=0), latest=lambda: None,
                       on_verdict=lambda *a: None, on_new_round=started.append, stop=threading.Event())
    ex.on_round(round=3, store=None, group_rank=0, group_world_size=2)
    new = set(threading.enumerate()) - before
    assert started == [3] and not any(t.name.startswith("elastic-rt-speed") for t in new)


def test_board_names_the_slow_rank_of_a_lock_step_job_by_compute_time():
    board = StragglerBoard(threshold=1.5, windows=2)
    step = {0: 0.2, 1: 0.2}  # every rank steps at the slowest one's pace
    a = (None, {Signal.STEP_TIME: step, Signal.COMPUTE: {0: 0.02, 1: 0.021}})
    b = (None, {Signal.STEP_TIME: step, Signal.COMPUTE: {0: 0.02, 1: 0.09}})
    for seq in (1, 2):
        v = board.update({"a": (seq, a[1]), "b": (seq, b[1])})
    (s,) = v.stragglers
    assert (s.node, s.local_rank, s.signal, s.windows) == ("b", 1, Signal.COMPUTE, 2)
    assert s.ratio == pytest.approx(0.09 / 0.02) and v.medians[Signal.COMPUTE] == pytest.approx(0.02)
    assert v.median_s == pytest.approx(0.2) and v.ranks == 4
    assert Verdict.from_json(v.to_json()) == v


def test_board_reports_the_stronger_signal_once_per_rank():
    board = StragglerBoard(threshold=1.5, windows=1)
    v = board.update({"a": (1, {Signal.STEP_TIME: {0: 0.1}, Signal.COMPUTE: {0: 0.05}}),
                      "b": (1, {Signal.STEP_TIME: {0: 0.3}, Signal.COMPUTE: {0: 0.25}})})
    assert [(s.node, s.signal, s.ratio) for s in v.stragglers] == [("b", Signal.COMPUTE, pytest.approx(5.0))]
