"""Relative speed across nodes, without a collective in the training loop: every agent publishes its
ranks' median step and compute times to the round's store once per window; the agent of group rank 0
compares them with the job medians and publishes one small verdict (the stragglers) that every agent
reads.

Per window and node: one write and one read (rank 0: one read per node). A rank is a straggler when
one of its signals is at least `threshold` x the job's (lower) median of that signal for `windows`
windows in a row. Step time names the slow rank where ranks do not wait for each other every step
(local SGD); compute time (outside backward(), goodput/compute.py) where they do (DDP: every rank
steps at the slowest one's pace, but only the slow one computes for longer).
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping

from elastic_rt.decisions import DETECTION_ACTIONS, DetectionAction, Signal
from elastic_rt.errors import ConfigError, RoundOverError
from elastic_rt.sections import option, positive

log = logging.getLogger(__name__)

def _threshold(value: float) -> float:
    if value != 0 and value <= 1:
        raise ConfigError(f"--straggler-threshold {value:g}: must be > 1 (times the median), or 0 = off")
    return value


def _windows(value: int) -> int:
    if value < 1:
        raise ConfigError(f"--straggler-windows {value}: must be >= 1")
    return value

_NODE_KEY = "elastic-rt/speed/node/{}"
_VERDICT_KEY = "elastic-rt/speed/verdict"
_MAX_AGE = 3  # aggregations after which a node that published nothing new no longer counts


# One node's window: its number, and per signal {local_rank: median seconds}
NodeWindow = tuple[int, Mapping[Signal, Mapping[int, float]]]


@dataclass(frozen=True, kw_only=True)
class StragglerSettings:
    """Straggler detection's config section: --straggler-threshold (0 = off), --straggler-windows,
    --straggler-window, --straggler-action."""

    threshold: float = option(
        "--straggler-threshold", type=float, default=1.5, parse=_threshold,
        help="flag a worker whose median step time is this many times the job's median (default 1.5; 0 = off)")
    windows: int = option(
        "--straggler-windows", type=int, default=3, parse=_windows,
        help="windows in a row over the threshold before a worker is flagged (default 3)")
    window_s: float = option(
        "--straggler-window", type=float, default=10.0, parse=positive("--straggler-window"),
        help="seconds per step-timing window; also how often nodes exchange step times (default 10)")
    action: DetectionAction = option(
        "--straggler-action", default=DetectionAction.REPORT.value, choices=DETECTION_ACTIONS, parse=DetectionAction,
        help="report: log, count and export elastic_rt_straggler; leave: also stop this node's workers and leave "
             "the job so the others re-form without it (default report)")

    @property
    def enabled(self) -> bool:
        return self.threshold > 0


@dataclass(frozen=True, kw_only=True)
class Straggler:
    node: str
    local_rank: int
    signal: Signal
    value_s: float  # the rank's median of `signal` in the last window
    median_s: float  # the job's median of `signal`
    ratio: float
    windows: int


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """Rank 0's judgement after one aggregation."""

    seq: int
    medians: dict[Signal, float]  # the job's median of each signal some rank reported
    fastest_s: float  # the smallest median step time
    ranks: int  # ranks with a step time
    stragglers: tuple[Straggler, ...] = ()

    @property
    def median_s(self) -> float:
        """The job's median step time (0 when no rank reported one)."""
        return self.medians.get(Signal.STEP_TIME, 0.0)

    def to_json(self) -> str:
        data = asdict(self)
        data["medians"] = {s.value: v for s, v in self.medians.items()}
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Verdict":
        data = json.loads(text)
        stragglers = tuple(Straggler(**{**s, "signal": Signal(s["signal"])}) for s in data["stragglers"])
        return cls(seq=int(data["seq"]), medians={Signal(k): float(v) for k, v in data["medians"].items()},
                   fastest_s=float(data["fastest_s"]), ranks=int(data["ranks"]), stragglers=stragglers)


@dataclass
class _Seen:
    node_seq: int  # the node's own window number
    at: int  # our aggregation number when it changed
    streaks: dict[tuple[int, Signal], int] = field(default_factory=dict)


class StragglerBoard:
    """Rank 0's bookkeeping: the latest medians of every node, and each rank's run of slow windows
    per signal."""

    def __init__(self, *, threshold: float, windows: int) -> None:
        self._threshold = threshold
        self._windows = windows
        self._seq = 0
        self._seen: dict[str, _Seen] = {}

    def update(self, entries: Mapping[str, NodeWindow]) -> Verdict | None:
        """entries: node -> (its window number, {signal: {local_rank: median}}). None: too few ranks."""
        self._seq += 1
        fresh = set()
        for node, (node_seq, _) in entries.items():
            seen = self._seen.get(node)
            if seen is None or seen.node_seq != node_seq:
                self._seen[node] = _Seen(node_seq, self._seq, seen.streaks if seen else {})
                fresh.add(node)
        live = {node: signals for node, (_, signals) in entries.items() if self._seq - self._seen[node].at < _MAX_AGE}
        medians: dict[Signal, float] = {}
        for signal in Signal:
            values = [v for signals in live.values() for v in signals.get(signal, {}).values() if v > 0]
            if len(values) >= 2:
                medians[signal] = statistics.median_low(values)
        if not medians:
            return None
        for node in fresh & set(live):
            streaks = self._seen[node].streaks
            for signal, median in medians.items():
                for rank, value in live[node].get(signal, {}).items():
                    slow = value > 0 and value >= self._threshold * median
                    streaks[(rank, signal)] = streaks.get((rank, signal), 0) + 1 if slow else 0
        found: dict[tuple[str, int], Straggler] = {}
        for node, signals in sorted(live.items()):
            for (rank, signal), n in sorted(self._seen[node].streaks.items()):
                value = signals.get(signal, {}).get(rank)
                if n < self._windows or value is None or signal not in medians:
                    continue
                s = Straggler(node=node, local_rank=rank, signal=signal, value_s=value, median_s=medians[signal],
                              ratio=value / medians[signal], windows=n)
                if (node, rank) not in found or s.ratio > found[(node, rank)].ratio:
                    found[(node, rank)] = s
        steps = [v for signals in live.values() for v in signals.get(Signal.STEP_TIME, {}).values() if v > 0]
        return Verdict(seq=self._seq, medians=medians, fastest_s=min(steps, default=0.0), ranks=len(steps),
                       stragglers=tuple(found[k] for k in sorted(found)))


class SpeedExchange:
    """Round listener: per round, a thread that publishes this node's figures as soon as a window closes
    (window_closed is set) and reads the verdict (rank 0 also aggregates); it ends when the round does.
    A store error skips a window."""

    def __init__(self, *, node: str, settings: StragglerSettings,
                 latest: Callable[[], NodeWindow | None],
                 on_verdict: Callable[[int, Verdict], None], on_new_round: Callable[[int], None],
                 stop: threading.Event) -> None:
        self._node = node
        self._settings = settings
        self._latest = latest
        self._on_verdict = on_verdict
        self._on_new_round = on_new_round
        self._stop = stop
        self.round = -1
        self.nodes = 1  # nodes in the current round
        self.window_closed = threading.Event()  # set by the observer when this node closed a window

    def on_round(self, *, round: int, store, group_rank: int, group_world_size: int,
                 master_addr: str | None = None) -> None:
        self.round = round
        self.nodes = group_world_size
        self._on_new_round(round)
        if not self._settings.enabled:
            return
        threading.Thread(target=self._run, args=(round, store, group_rank, group_world_size),
                         name=f"elastic-rt-speed-{round}", daemon=True).start()

    def _run(self, rnd: int, store, rank: int, world: int) -> None:
        board = StragglerBoard(threshold=self._settings.threshold, windows=self._settings.windows) \
            if rank == 0 else None
        published, seen_verdict, failed = None, 0, False
        present: set[int] = set()
        while not self._stop.is_set():
            self.window_closed.wait(self._settings.window_s)  # at the latest a window's time
            self.window_closed.clear()
            if rnd != self.round or self._stop.is_set():
                return
            sample = self._latest()
            if sample is None or sample[0] == published:
                continue  # no new window here (workers starting, or not stepping): no requests
            published = sample[0]
            try:
                # The others read the verdict before they publish: between two reads a node then adds one window
                # to its streaks, so the first verdict naming its rank is the one that reached --straggler-windows.
                # Read after publishing, a verdict could already count the window just published (rank 0's
                # aggregation falling in between) and the one before it would never be seen.
                verdict = Verdict.from_json(store.get(_VERDICT_KEY)) \
                    if board is None and store.check([_VERDICT_KEY]) else None
                store.set(_NODE_KEY.format(rank), json.dumps(
                    {"node": self._node, "seq": sample[0],
                     "signals": {s.value: {str(k): v for k, v in ranks.items()} for s, ranks in sample[1].items()}}))
                if board is not None:
                    verdict = board.update(self._read_nodes(store, world, present))
                    if verdict is not None:
                        store.set(_VERDICT_KEY, verdict.to_json())
            except RoundOverError:  # the agent met again or left
                return
            except Exception as exc:  # noqa: BLE001 - etcd away for a while, or the round ended under us
                if rnd == self.round and not failed:
                    log.info("[%s round %d] step-time exchange: %s; retrying every window", self._node, rnd, exc)
                failed = True
                continue
            if verdict is not None and verdict.seq != seen_verdict and rnd == self.round:
                seen_verdict = verdict.seq
                self._on_verdict(rnd, verdict)

    @staticmethod
    def _read_nodes(store, world: int, present: set[int]) -> dict[str, NodeWindow]:
        entries: dict[str, NodeWindow] = {}
        for r in range(world):
            key = _NODE_KEY.format(r)
            if r not in present:
                if not store.check([key]):
                    continue  # not published yet: a get would wait for it
                present.add(r)
            data = json.loads(store.get(key))
            entries[str(data["node"])] = (int(data["seq"]), {
                Signal(s): {int(k): float(v) for k, v in ranks.items()} for s, ranks in data["signals"].items()})
        return entries
