"""Compute timing in the worker (goodput/compute.py) and its window statistic: a fake clock drives the
timer through real torch.autograd.backward and real torch.distributed collectives (gloo, one rank)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from elastic_rt.goodput import compute
from elastic_rt.goodput.steptime import StepTimer, trimmed_mean
from elastic_rt.worker_reports.heartbeat import Heartbeat
from tests.support.clock import FakeClock as Clock

MS = 1_000_000


class FakeClock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def _timer(clock: FakeClock) -> compute.ComputeTimer:
    return compute.ComputeTimer(marks_for=lambda _opt: compute.HostMarks(clock))


def _step(timer: compute.ComputeTimer, clock: FakeClock, *, forward_ms: int, backward_ms: int | None,
          optimizer_ms: int = 1, collective_ms: int = 0) -> tuple[int, int]:
    clock.ns += forward_ms * MS
    if collective_ms:
        timer.wait_started()
        clock.ns += collective_ms * MS
        timer.wait_ended()
    if backward_ms is not None:
        timer.wait_started()
        clock.ns += backward_ms * MS
        timer.wait_ended(backward=True)
    clock.ns += optimizer_ms * MS
    return timer.step_ended(None)


def test_compute_is_the_time_between_steps_outside_backward_and_collectives():
    clock = FakeClock()
    t = _timer(clock)
    assert _step(t, clock, forward_ms=3, backward_ms=5) == (0, 0)  # the first step has no start mark
    assert _step(t, clock, forward_ms=3, backward_ms=50) == (4 * MS, 1)  # 3 forward + 1 optimizer
    assert _step(t, clock, forward_ms=2, backward_ms=5, collective_ms=40) == (7 * MS, 2)  # a loss all-reduce
    assert _step(t, clock, forward_ms=2, backward_ms=None) == (7 * MS, 2)  # no backward: not timed
    assert _step(t, clock, forward_ms=6, backward_ms=1) == (14 * MS, 3)


def test_nested_waits_belong_to_the_outer_one():
    clock = FakeClock()
    t = _timer(clock)
    t.step_ended(None)
    clock.ns += 2 * MS
    t.wait_started()
    clock.ns += 3 * MS
    t.wait_started()  # e.g. all_gather inside all_gather_object: ignored
    clock.ns += 4 * MS
    t.wait_ended()
    clock.ns += 5 * MS
    t.wait_ended(backward=True)
    assert t.step_ended(None) == (2 * MS, 1)


def test_a_step_ending_inside_a_wait_is_not_timed():
    clock = FakeClock()
    t = _timer(clock)
    t.step_ended(None)
    t.wait_started()
    clock.ns += 5 * MS
    assert t.step_ended(None) == (0, 0)  # an optimizer step inside backward() (optimizer in backward)
    t.wait_ended(backward=True)
    assert _step(t, clock, forward_ms=1, backward_ms=1) == (2 * MS, 1)


class DeviceMarks:
    """Like CUDA events: a mark is reached only once the test says the device got there."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.reached = -1
        self.count = 0

    def mark(self) -> tuple[int, int]:
        self.count += 1
        return self.count, self.clock.ns

    def elapsed_ns(self, a, b):
        return None if b[0] > self.reached else b[1] - a[1]


def test_device_marks_are_folded_in_once_the_device_reached_them_in_order():
    clock = FakeClock()
    marks = DeviceMarks(clock)
    t = compute.ComputeTimer(marks_for=lambda _opt: marks)
    t.step_ended(None)
    for forward_ms in (3, 5):
        _step(t, clock, forward_ms=forward_ms, backward_ms=10)
    assert (t.total_ns, t.timed_steps) == (0, 0)  # the device is behind
    marks.reached = 4  # the first step's end, not the second's
    assert _step(t, clock, forward_ms=7, backward_ms=10) == (4 * MS, 1)
    marks.reached = 10**9  # the device keeps up from now on
    assert _step(t, clock, forward_ms=1, backward_ms=10) == (4 * MS + 6 * MS + 8 * MS + 2 * MS, 4)


def test_marks_follow_the_optimizers_device():
    cpu = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert isinstance(compute.marks_for(cpu), compute.HostMarks)
    fake_cuda = types.SimpleNamespace(param_groups=[{"params": [types.SimpleNamespace(device=torch.device("cuda"))]}])
    if torch.cuda.is_available():
        assert isinstance(compute.marks_for(fake_cuda), compute.CudaMarks)


class _Slow(torch.autograd.Function):
    """Advances the fake clock in forward and backward, as a slow layer would."""

    clock: FakeClock

    @staticmethod
    def forward(ctx, x):
        _Slow.clock.ns += 3 * MS
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _Slow.clock.ns += 20 * MS
        return grad * 2


@pytest.fixture
def single_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_real_backward_and_collectives_are_wrapped_and_timed(single_rank_group):
    clock = FakeClock()
    _Slow.clock = clock
    modules = (torch.autograd, dist, dist.distributed_c10d)
    original_all_reduce = dist.all_reduce
    timer = compute.install(torch.autograd, _timer(clock))
    compute.install_collectives(dist, dist.distributed_c10d)
    compute.install_collectives(dist, dist.distributed_c10d)  # twice: wrapped once
    try:
        assert dist.all_reduce is dist.distributed_c10d.all_reduce and dist.all_reduce.__wrapped__ is original_all_reduce
        w = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([w], lr=0.01)
        for _ in range(3):
            loss = _Slow.apply(w).sum()
            t = torch.ones(1)
            clock.ns += 1 * MS
            dist.all_reduce(t)  # the collective's own time is 0 on the fake clock; it is still a wait
            loss.backward()
            opt.step()
            timer.step_ended(opt)
        assert (timer.total_ns, timer.timed_steps) == (2 * 4 * MS, 2)  # 3 ms forward + 1 ms, twice
    finally:
        compute.uninstall(*modules)
    assert dist.all_reduce is original_all_reduce and not hasattr(torch.autograd.backward, "__wrapped__")


def test_trimmed_mean_leaves_out_the_slowest_tenth():
    assert trimmed_mean([(1.0, 9), (100.0, 1)]) == pytest.approx(1.0)  # one save in ten steps
    assert trimmed_mean([(1.0, 6), (10.0, 4)]) == pytest.approx((6 + 30) / 9)  # stalls on 40 % of steps count
    assert trimmed_mean([(2.0, 1)]) == 2.0
    with pytest.raises(ValueError):
        trimmed_mean([])


def _beat(pid: int, step: int, t: float, compute_ms: float, timed: int) -> Heartbeat:
    return Heartbeat(pid=pid, seq=step, step=step, timestamp_s=t, age_s=0.0, compute_ns=int(compute_ms * MS),
                     timed_steps=timed)


def test_step_timer_takes_compute_per_timed_step_from_the_heartbeats():
    clock = Clock(0.0)
    timer = StepTimer(window_s=1.0, clock=clock)
    timer.reset([0, 1])
    for tick in range(1, 11):
        clock.now = tick * 0.1
        timer.observe({0: _beat(1, tick * 10, clock.now, tick * 10 * 2.0, tick * 10),  # 2 ms a step
                       1: _beat(2, tick * 10, clock.now, tick * 10 * 6.0, tick * 10)})  # 6 ms a step
    timer.observe({0: _beat(3, 1, 1.05, 500.0, 1), 1: None})  # a new worker process: no observation
    medians = timer.close_window()
    assert medians.compute == {0: pytest.approx(0.002), 1: pytest.approx(0.006)}
    assert medians.step == {0: pytest.approx(0.01), 1: pytest.approx(0.01)}  # lock-step: the same pace


def test_a_timing_error_turns_timing_off_and_never_reaches_the_script(caplog):
    class Broken:
        def mark(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def elapsed_ns(self, a, b):
            return 0

    calls = []
    module = types.SimpleNamespace(backward=lambda *a, **k: calls.append(a) or "done")
    compute.install(module, compute.ComputeTimer(marks_for=lambda _opt: Broken()))
    try:
        assert compute.step_ended(None) is None  # the first mark fails: timing off, one line
        assert compute.timer() is None and "compute timing is off" in caplog.text
        assert module.backward(1) == "done" and calls == [(1,)]  # the call itself goes on
    finally:
        compute.uninstall(module)


def test_no_marks_while_a_cuda_graph_is_captured():
    class Capturing:
        def mark(self):
            return None  # what CudaMarks gives while the stream is captured

        def elapsed_ns(self, a, b):
            return 0

    clock = FakeClock()
    marks = compute.HostMarks(clock)
    t = compute.ComputeTimer(marks_for=lambda _opt: marks)
    t.step_ended(None)
    t._marks = Capturing()  # the backward and the step end fall inside a capture
    assert _step(t, clock, forward_ms=1, backward_ms=1) == (0, 0)
    t._marks = marks
    _step(t, clock, forward_ms=1, backward_ms=1)  # no start mark survived the capture: untimed
    assert _step(t, clock, forward_ms=2, backward_ms=1) == (3 * MS, 1)
