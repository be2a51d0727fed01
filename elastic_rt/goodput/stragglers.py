"""Relative speed across nodes, without a collective in the training loop: every agent publishes its
ranks' median step times to the round's store once per window; the agent of group rank 0 compares
them with the job median and publishes one small verdict (the stragglers) that every agent reads.

Per window and node: one write and one read (rank 0: one read per node). A rank is a straggler when
its median step time is at least `threshold` x the job's (lower) median for `windows` windows in a row.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

log = logging.getLogger(__name__)

STRAGGLER_ACTIONS = ("report", "leave")
_NODE_KEY = "elastic-rt/speed/node/{}"
_VERDICT_KEY = "elastic-rt/speed/verdict"
_MAX_AGE = 3  # aggregations after which a node that published nothing new no longer counts


@dataclass(frozen=True, kw_only=True)
class StragglerSettings:
    """--straggler-threshold (0 = off), --straggler-windows, --straggler-window, --straggler-action."""

    threshold: float = 1.5
    windows: int = 3
    window_s: float = 10.0
    action: str = "report"

    @property
    def enabled(self) -> bool:
        return self.threshold > 0


@dataclass(frozen=True, kw_only=True)
class Straggler:
    node: str
    local_rank: int
    step_time_s: float
    median_s: float
    ratio: float
    windows: int


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """Rank 0's judgement after one aggregation."""

    seq: int
    median_s: float
    fastest_s: float
    ranks: int
    stragglers: tuple[Straggler, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Verdict":
        data = json.loads(text)
        return cls(seq=int(data["seq"]), median_s=float(data["median_s"]), fastest_s=float(data["fastest_s"]),
                   ranks=int(data["ranks"]), stragglers=tuple(Straggler(**s) for s in data["stragglers"]))


class StragglerBoard:
    """Rank 0's bookkeeping: the latest medians of every node, and each rank's run of slow windows."""

    def __init__(self, *, threshold: float, windows: int) -> None:
        self._threshold = threshold
        self._windows = windows
        self._seq = 0
        self._seen: dict[str, tuple[int, int]] = {}  # node -> (its seq, our seq when it changed)
        self._streak: dict[tuple[str, int], int] = {}

    def update(self, entries: Mapping[str, tuple[int, Mapping[int, float]]]) -> Verdict | None:
        """entries: node -> (its window number, {local_rank: median step time}). None: too few ranks."""
        self._seq += 1
        fresh = set()
        for node, (node_seq, _) in entries.items():
            if node not in self._seen or self._seen[node][0] != node_seq:
                self._seen[node] = (node_seq, self._seq)
                fresh.add(node)
        live = {node: ranks for node, (_, ranks) in entries.items()
                if self._seq - self._seen[node][1] < _MAX_AGE and ranks}
        values = [v for ranks in live.values() for v in ranks.values() if v > 0]
        if len(values) < 2:
            return None
        median = statistics.median_low(values)
        for node in fresh & set(live):
            for rank, value in live[node].items():
                key = (node, rank)
                slow = value > 0 and value >= self._threshold * median
                self._streak[key] = self._streak.get(key, 0) + 1 if slow else 0
        stragglers = tuple(
            Straggler(node=node, local_rank=rank, step_time_s=live[node][rank], median_s=median,
                      ratio=live[node][rank] / median, windows=n)
            for (node, rank), n in sorted(self._streak.items())
            if n >= self._windows and node in live and rank in live[node]
        )
        return Verdict(seq=self._seq, median_s=median, fastest_s=min(values), ranks=len(values),
                       stragglers=stragglers)


class SpeedExchange:
    """Round listener: per round, a thread that publishes this node's medians every window and reads
    the verdict (rank 0 also aggregates); it ends when the round does. A store error skips a window."""

    def __init__(self, *, node: str, settings: StragglerSettings,
                 latest: Callable[[], tuple[int, dict[int, float]] | None],
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
        while not self._stop.wait(self._settings.window_s):
            if rnd != self.round:
                return
            sample = self._latest()
            if sample is None or sample[0] == published:
                continue  # no new window here (workers starting, or not stepping): no requests
            published = sample[0]
            try:
                store.set(_NODE_KEY.format(rank), json.dumps(
                    {"node": self._node, "seq": sample[0], "ranks": {str(k): v for k, v in sample[1].items()}}))
                if board is not None:
                    verdict = board.update(self._read_nodes(store, world, present))
                    if verdict is not None:
                        store.set(_VERDICT_KEY, verdict.to_json())
                elif store.check([_VERDICT_KEY]):
                    verdict = Verdict.from_json(store.get(_VERDICT_KEY))
                else:
                    verdict = None
            except Exception as exc:  # noqa: BLE001 - etcd away for a while, or the round ended under us
                if rnd == self.round and not failed:
                    log.info("[%s round %d] step-time exchange: %s; retrying every window", self._node, rnd, exc)
                failed = True
                continue
            if verdict is not None and verdict.seq != seen_verdict and rnd == self.round:
                seen_verdict = verdict.seq
                self._on_verdict(rnd, verdict)

    @staticmethod
    def _read_nodes(store, world: int, present: set[int]) -> dict[str, tuple[int, dict[int, float]]]:
        entries: dict[str, tuple[int, dict[int, float]]] = {}
        for r in range(world):
            key = _NODE_KEY.format(r)
            if r not in present:
                if not store.check([key]):
                    continue  # not published yet: a get would wait for it
                present.add(r)
            data = json.loads(store.get(key))
            entries[str(data["node"])] = (int(data["seq"]), {int(k): float(v) for k, v in data["ranks"].items()})
        return entries
