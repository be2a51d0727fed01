"""The goodput observer: feeds the agent's events and the workers' heartbeats and checkpoint reports to the
ledger, the step timer and the straggler exchange; records the results as metrics and journal lines.
Its StragglerPolicy makes a flagged node leave the job when --straggler-action is leave."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping

import psutil
from prometheus_client import CollectorRegistry

from elastic_rt.decisions import DetectionAction, RestartReason
from elastic_rt.goodput.events import EventLog, journal_path
from elastic_rt.interfaces import AgentObserver, RestartPolicy
from elastic_rt.goodput.ledger import GoodputLedger, LostProgress
from elastic_rt.goodput.steptime import StepTimer
from elastic_rt.goodput.stragglers import NodeWindow, Signal, SpeedExchange, StragglerBoard, StragglerSettings, Verdict
from elastic_rt.goodput.goodput_metrics import GoodputMetrics
from elastic_rt.worker_reports.checkpoint import CheckpointReportReader
from elastic_rt.worker_reports.heartbeat import Heartbeat
from elastic_rt.worker_reports.inbox import WorkerReports

log = logging.getLogger(__name__)


def process_start_monotonic(clock: Callable[[], float] = time.monotonic) -> float:
    """When this process started, on the monotonic clock: the job's start as this node sees it."""
    try:
        age = max(0.0, time.time() - psutil.Process().create_time())
    except (psutil.Error, OSError):
        age = 0.0
    return clock() - age


class GoodputObserver(AgentObserver):
    """An AgentObserver (plus the round listener `exchange.on_round`); decides nothing itself."""

    def __init__(self, *, run_id: str, node: str, reports: WorkerReports, log_dir: str,
                 settings: StragglerSettings = StragglerSettings(), registry: CollectorRegistry | None = None,
                 started_at: float | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, totals_interval_s: float = 30.0) -> None:
        self._node = node
        self._reports = reports
        self._clock = clock
        self._settings = settings
        self.ledger = GoodputLedger(started_at=started_at, clock=clock)
        self.events = EventLog(journal_path(log_dir, node), run_id=run_id, node=node, clock=clock,
                               wall_clock=wall_clock)
        self.metrics = GoodputMetrics(registry=registry, run_id=run_id, node=node) if registry is not None else None
        self._checkpoints = CheckpointReportReader(reports.directory)
        self.timer = StepTimer(window_s=settings.window_s, clock=clock)
        self._stop = threading.Event()
        self.exchange = SpeedExchange(node=node, settings=settings, latest=self._latest_window,
                                      on_verdict=self._on_verdict, on_new_round=self._on_new_round, stop=self._stop)
        self._local_board = StragglerBoard(threshold=settings.threshold, windows=settings.windows)
        self._lock = threading.Lock()
        self._window: NodeWindow | None = None
        self._window_seq = 0
        self._local_ranks: set[int] = set()
        self.flagged: dict[int, float] = {}  # local rank -> ratio, in the current round
        self._round = 0
        self._totals_interval_s = totals_interval_s
        self._next_totals = clock() + totals_interval_s
        self._closed = False
        log.info("[%s] goodput journal: %s", node, self.events.path)
        self.events.write("start", at=self.ledger.started_at, straggler_threshold=settings.threshold,
                          straggler_windows=settings.windows, straggler_window_s=settings.window_s)

    # ---- AgentObserver ------------------------------------------------------------------
    def on_rendezvous(self, *, round: int, world_size: int, nodes: int, duration_s: float) -> None:
        self._round = round
        self.events.write("rendezvous", round=round, world_size=world_size, nodes=nodes,
                          duration_s=round_s(duration_s), phase=self.ledger.phase)

    def on_restart(self, reason: RestartReason) -> None:
        self._sample(self._reports.heartbeats())  # the last steps the stopped workers made
        self.ledger.restart()
        self.events.write("restart", reason=reason, round=self._round, phase="restart",
                          committed_step=self.ledger.committed_step)
        self._export()

    def on_failures(self, causes: dict[int, str]) -> None:
        """Classified worker failures (or the hung rank) before the restart they cause."""
        for rank, cause in sorted(causes.items()):
            self.events.write("failure", rank=rank, cause=cause, round=self._round)

    def on_recovered(self, duration_s: float) -> None:
        self.events.write("recovered", duration_s=round_s(duration_s), round=self._round)

    def on_workers_started(self, pids: dict[int, int]) -> None:
        self._read_checkpoint()  # a save made while the old workers stopped (SIGTERM) keeps their steps
        lost = self.ledger.workers_started()
        self._record_lost(lost)
        self._local_ranks = set(pids)
        self.timer.reset(pids)
        with self._lock:
            self._window = None
        self.events.write("workers_started", workers=len(pids), round=self._round, phase=self.ledger.phase)
        self._export()

    def on_workers_finished(self, state: str) -> None:
        self._sample(self._reports.heartbeats())
        self._read_checkpoint()
        now = self._clock()
        other_before = self.ledger.totals(now)["other"]
        lost = self.ledger.finished(succeeded=state == "succeeded", now=now)
        self._record_lost(lost)
        self.events.write("finished", state=state, round=self._round, phase="other",
                          after_last_step_s=round_s(self.ledger.totals(now)["other"] - other_before))
        self._export()

    def on_tick(self) -> None:
        beats = self._reports.heartbeats()
        self._sample(beats)
        for obs in self.timer.observe(beats):
            if self.metrics is not None:
                self.metrics.step_histogram.observe(obs.local_rank, obs.duration_s, obs.steps)
        self._read_checkpoint()
        now = self._clock()
        if self.timer.window_due(now):
            medians = self.timer.close_window(now)
            if medians.step or medians.compute:
                self._window_seq += 1
                window = (self._window_seq, {Signal.STEP_TIME: medians.step, Signal.COMPUTE: medians.compute})
                with self._lock:
                    self._window = window
                self.exchange.window_closed.set()
                if self.metrics is not None:
                    self.metrics.on_step_times(medians.step)
                    self.metrics.on_compute_times(medians.compute)
                if self.exchange.round < 0 and self._settings.enabled:
                    # No rounds with a store (c10d, standalone): judge the local ranks among themselves.
                    verdict = self._local_board.update({self._node: window})
                    if verdict is not None:
                        self._on_verdict(self._round, verdict)
        if now >= self._next_totals:
            self._next_totals = now + self._totals_interval_s
            self._write_totals("totals")
        self._export()

    def close(self) -> None:
        """The agent is done (or stopped): settle what is left, write the exit line."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.exchange.window_closed.set()  # the exchange thread returns now, not a window later
        if self.ledger.phase != "other":
            self._read_checkpoint()
            self._record_lost(self.ledger.finished(succeeded=False))
        self._write_totals("exit")
        self._export()
        self.events.close()

    @property
    def action(self) -> DetectionAction:
        """What a flag does now: LEAVE only with --straggler-action leave and other nodes to re-form."""
        leave = DetectionAction(self._settings.action) is DetectionAction.LEAVE and self.exchange.nodes > 1
        return DetectionAction.LEAVE if leave else DetectionAction.REPORT

    # ---- straggler exchange callbacks -----------------------------------------------------
    def _latest_window(self) -> NodeWindow | None:
        with self._lock:
            return self._window

    def _on_new_round(self, rnd: int) -> None:
        with self._lock:
            self._round = rnd
            cleared, self.flagged = self.flagged, {}
        if cleared and self.metrics is not None:
            self.metrics.on_stragglers(set(), self._local_ranks)

    def _on_verdict(self, rnd: int, verdict: Verdict) -> None:
        mine = {s.local_rank: s for s in verdict.stragglers if s.node == self._node}
        with self._lock:
            if rnd != self._round:
                return
            window = self._window
            new = {r: s for r, s in mine.items() if r not in self.flagged}
            gone = set(self.flagged) - set(mine)
            self.flagged = {r: s.ratio for r, s in mine.items()}
        if self.metrics is not None:
            self.metrics.on_stragglers(set(mine), self._local_ranks)
            if window is not None:
                self.metrics.on_step_times(window[1][Signal.STEP_TIME], job_median_s=verdict.median_s)
                self.metrics.on_compute_times(window[1][Signal.COMPUTE],
                                              job_median_s=verdict.medians.get(Signal.COMPUTE))
        action = self.action
        for rank, s in sorted(new.items()):
            log.warning("[%s round %d] straggler: local rank %d %s %.4g s per step, %.2fx the job median %.4g s "
                        "(%d windows of %g s in a row; threshold %gx)%s", self._node, rnd, rank, s.signal.describe,
                        s.value_s, s.ratio, s.median_s, s.windows, self._settings.window_s,
                        self._settings.threshold,
                        "; leaving the job (--straggler-action leave)" if action is DetectionAction.LEAVE else "")
            self.events.write("straggler", round=rnd, local_rank=rank, signal=s.signal.value,
                              value_s=round_s(s.value_s), median_s=round_s(s.median_s), ratio=round(s.ratio, 3),
                              windows=s.windows, action=action)
        for rank in sorted(gone):
            log.info("[%s round %d] local rank %d is no longer a straggler", self._node, rnd, rank)
            self.events.write("straggler_cleared", round=rnd, local_rank=rank)

    # ---- internals --------------------------------------------------------------------
    def _sample(self, beats: Mapping[int, Heartbeat | None]) -> None:
        present = [b for b in beats.values() if b is not None]
        if not present:
            return
        top = max(present, key=lambda b: (b.step, b.timestamp_s))
        first_at = min(b.timestamp_s for b in present)
        if self.ledger.steps(step=top.step, at=top.timestamp_s, first_at=first_at):
            self.events.write("first_step", at=self.ledger.phase_since, step=top.step, round=self._round,
                              phase="training")

    def _read_checkpoint(self) -> None:
        report = self._checkpoints.read_new()
        if report is None:
            return
        self.ledger.checkpoint(step=report.step, save_duration_s=report.save_duration_s, blocked_s=report.blocked_s)
        self.events.write("checkpoint", step=report.step, save_duration_s=round_s(report.save_duration_s),
                          blocked_s=round_s(report.blocked_s), round=self._round)

    def _record_lost(self, lost: LostProgress | None) -> None:
        if lost is None:
            return
        self.events.write("lost", steps=lost.steps, seconds=round_s(lost.seconds), last_step=lost.last_step,
                          committed_step=lost.committed_step, round=self._round)
        if self.metrics is not None:
            self.metrics.on_lost_steps(lost.steps)
        if lost.steps or lost.seconds >= 1.0:
            log.info("[%s round %d] progress lost: %d step(s), %.1f s of training since the last commit (%s)",
                     self._node, self._round, lost.steps, lost.seconds,
                     f"step {lost.committed_step}" if lost.committed_step is not None else "none reported")

    def _write_totals(self, event: str) -> None:
        now = self._clock()
        totals = self.ledger.totals(now)
        self.events.write(event, elapsed_s=round_s(self.ledger.elapsed(now)),
                          uncommitted_s=round_s(self.ledger.uncommitted(now)),
                          ratio=round(self.ledger.ratio(now), 4), phase=self.ledger.phase,
                          totals={k: round_s(v) for k, v in totals.items()})

    def _export(self) -> None:
        if self.metrics is not None:
            now = self._clock()
            self.metrics.on_totals(self.ledger.totals(now), uncommitted_s=self.ledger.uncommitted(now),
                                   ratio=self.ledger.ratio(now))


def round_s(value: float) -> float:
    return round(float(value), 6)


class StragglerPolicy(RestartPolicy):
    """A RestartPolicy: STRAGGLER (leave the job) while this node has a flagged rank, with action LEAVE
    and at least one other node in the round (a job of one node has nobody to re-form without it)."""

    def __init__(self, observer: GoodputObserver) -> None:
        self._observer = observer

    def check(self) -> RestartReason | None:
        leave = self._observer.flagged and self._observer.action is DetectionAction.LEAVE
        return RestartReason.STRAGGLER if leave else None
