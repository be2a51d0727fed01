"""Per-rank compute timing inside each worker: of the time between two optimizer steps, the part
spent outside backward() and outside torch.distributed's collectives (data, forward, loss, optimizer):
where a lock-step rank waits for nobody.

In DDP every rank waits for the slowest one inside backward() (the gradient all-reduce), or in the
first collective the script calls itself (a loss all-reduce, a barrier), so all ranks step at the
same pace; the time outside those is each rank's own, and the slow rank's is the longest. The worker
entry point installs this when the script imports torch: it wraps torch.autograd.backward
(Tensor.backward calls it) and torch.distributed's collectives (`waits`), and ends a step in the
optimizer step post hook (worker_reports/heartbeat.py). Marks are CUDA events on the current stream when
the optimizer's parameters live on a GPU (kernels run asynchronously: host clocks would time their
launches, and whichever call synchronises would absorb the wait), else the host's monotonic clock.

A step is timed when at least one backward() ran in it and no wait was still open at its end; the
first step after a start has no start mark and is not timed. A wait inside another (a collective in
reentrant activation checkpointing, all_gather inside all_gather_object) belongs to the outer one.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from typing import Any, Callable, Protocol

log = logging.getLogger(__name__)

MAX_WAITS_PER_STEP = 256  # more backward() and collective calls in one step: the step is not timed
MAX_PENDING_STEPS = 16  # CUDA steps whose end event has not completed; older ones are dropped


class Marks(Protocol):
    """Where a timer takes its marks: mark() now, elapsed_ns(a, b) or None while b is not reached."""

    def mark(self) -> Any: ...

    def elapsed_ns(self, a: Any, b: Any) -> int | None: ...


class HostMarks:
    """The host's monotonic clock: CPU training runs its ops synchronously."""

    def __init__(self, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.mark = clock_ns

    @staticmethod
    def elapsed_ns(a: int, b: int) -> int:
        return b - a


class CudaMarks:
    """Timing CUDA events recorded on the current stream; an interval is known once its end completed.
    No mark (None) while the stream is being captured into a CUDA graph: a timing event cannot be."""

    def __init__(self, cuda: Any) -> None:
        self._cuda = cuda
        self._event = functools.partial(cuda.Event, enable_timing=True)

    def mark(self) -> Any:
        if self._cuda.is_current_stream_capturing():
            return None
        event = self._event()
        event.record()
        return event

    @staticmethod
    def elapsed_ns(a: Any, b: Any) -> int | None:
        if not b.query():
            return None
        return int(a.elapsed_time(b) * 1e6)


def marks_for(optimizer: Any) -> Marks:
    """CudaMarks when the optimizer's first parameter is on a CUDA device, else HostMarks."""
    for group in getattr(optimizer, "param_groups", ()):
        for param in group.get("params", ()):
            if getattr(getattr(param, "device", None), "type", None) == "cuda":
                import torch

                return CudaMarks(torch.cuda)
            return HostMarks()
    return HostMarks()


class ComputeTimer:
    """Totals of compute time over the timed steps so far (what the heartbeat carries)."""

    def __init__(self, marks_for: Callable[[Any], Marks] = marks_for) -> None:
        self._marks_for = marks_for
        self._marks: Marks | None = None
        self._start: Any = None  # end mark of the previous optimizer step
        self._spans: list[tuple[Any, Any]] = []  # (start, end) marks of this step's waits
        self._open: Any = None  # start mark of the wait running now
        self._depth = 0  # waits running now (any thread): only the outermost is timed
        self._backward = False  # a backward() ran in this step
        self._spoiled = False  # this step cannot be timed (too many waits)
        self._pending: deque[tuple[Any, list[tuple[Any, Any]], Any]] = deque()
        self.total_ns = 0
        self.timed_steps = 0

    def wait_started(self) -> None:
        """backward() or a collective begins (where this rank may wait for the others)."""
        self._depth += 1
        if self._depth > 1 or self._marks is None or self._start is None:
            return
        self._open = self._marks.mark()
        if self._open is None:
            self._spoiled = True

    def wait_ended(self, backward: bool = False) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth or self._open is None or self._marks is None:
            return
        end = self._marks.mark()
        if len(self._spans) < MAX_WAITS_PER_STEP and end is not None:
            self._spans.append((self._open, end))
        else:
            self._spoiled = True
        self._backward = self._backward or backward
        self._open = None

    def step_ended(self, optimizer: Any) -> tuple[int, int]:
        """An optimizer step finished: close the step, fold in what is known; returns the totals."""
        if self._marks is None:
            self._marks = self._marks_for(optimizer)
        end = self._marks.mark()
        if self._start is not None and end is not None and self._backward and self._open is None \
                and not self._spoiled:
            self._pending.append((self._start, self._spans, end))
            if len(self._pending) > MAX_PENDING_STEPS:
                self._pending.popleft()
        self._start, self._spans, self._open, self._backward, self._spoiled = end, [], None, False, False
        self._resolve()
        return self.total_ns, self.timed_steps

    def _resolve(self) -> None:
        marks = self._marks
        while self._pending:
            start, spans, end = self._pending[0]
            step = marks.elapsed_ns(start, end)
            if step is None:
                return  # the device has not reached this step's end yet (nor any later one)
            self._pending.popleft()
            inside = 0
            for a, b in spans:
                inside += marks.elapsed_ns(a, b) or 0
            self.total_ns += max(0, step - inside)
            self.timed_steps += 1


# torch.distributed's blocking collectives, wrapped where a script (or DDP, DCP) looks them up
WAITS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
         "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
         "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv",
         "_broadcast_coalesced")
_MARK = "__elastic_rt_timed__"

_timer: ComputeTimer | None = None


def timer() -> ComputeTimer | None:
    return _timer


def _timed(original: Callable[..., Any], backward: bool) -> Callable[..., Any]:
    if getattr(original, _MARK, False):
        return original

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = _timer
        if t is None:
            return original(*args, **kwargs)
        _guarded(t.wait_started)
        try:
            return original(*args, **kwargs)
        finally:
            _guarded(t.wait_ended, backward)

    setattr(timed, _MARK, True)
    return timed


def _guarded(fn: Callable[..., Any], *args: Any) -> Any:
    """Timing must never break training: the first error turns the timer off, with one line."""
    global _timer
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error while recording an event
        if _timer is not None:
            log.warning("elastic-rt: compute timing is off in this worker (%s: %s); lock-step stragglers are "
                        "not named from it", type(exc).__name__, exc)
        _timer = None
        return None


def step_ended(optimizer: Any) -> tuple[int, int] | None:
    """The progress hook's call at each counted optimizer step: the totals, or None when timing is off."""
    t = _timer
    return None if t is None else _guarded(t.step_ended, optimizer)


def install(autograd_module: Any, timer_: ComputeTimer | None = None) -> ComputeTimer:
    """Time each `autograd_module.backward` (torch.autograd) call with the process-wide timer (created
    here unless given); returns it. Installing twice wraps once."""
    global _timer
    _timer = timer_ or _timer or ComputeTimer()
    autograd_module.backward = _timed(autograd_module.backward, backward=True)
    return _timer


def install_collectives(*modules: Any) -> None:
    """Time the collectives of WAITS in each module (torch.distributed and its distributed_c10d, which
    it re-exports: the same function is wrapped once and set in both)."""
    wrapped: dict[int, Callable[..., Any]] = {}
    for module in modules:
        for name in WAITS:
            fn = getattr(module, name, None)
            if callable(fn):
                setattr(module, name, wrapped.setdefault(id(fn), _timed(fn, backward=False)))


def uninstall(*modules: Any) -> None:
    """Undo install() and install_collectives() (tests, benchmarks)."""
    global _timer
    for module in modules:
        for name in ("backward", *WAITS):
            fn = getattr(module, name, None)
            if getattr(fn, _MARK, False):
                setattr(module, name, fn.__wrapped__)
    _timer = None


def install_in_worker(autograd_module: Any) -> None:
    """The worker entry point's action on `import torch.autograd`: time backward() calls, and end
    each step in the progress hook (which writes the totals into the heartbeat)."""
    from elastic_rt.worker_reports.heartbeat import set_step_timer

    install(autograd_module)
    set_step_timer(step_ended)


def install_collectives_in_worker(distributed_module: Any) -> None:
    """The worker entry point's action on `import torch.distributed`."""
    if getattr(distributed_module, "is_available", lambda: False)():
        install_collectives(distributed_module, distributed_module.distributed_c10d)
