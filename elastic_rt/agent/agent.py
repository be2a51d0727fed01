"""The elastic agent: torch's LocalElasticAgent with peer-loss restarts, complete process-tree stops
and restart accounting by reason."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Callable, Sequence

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elastic_rt.agent import stop_signal
from elastic_rt.agent.console_tee import whole_line_tee
from elastic_rt.agent.crash_loop import CrashLoopError, CrashLoopJudge, failure_record, hang_record
from elastic_rt.diagnostics.failure_diagnostics import FailureDiagnostics
from elastic_rt.diagnostics.exit_aborts import forgive_teardown_exits
from elastic_rt.agent.process_tree import stop_tree
from elastic_rt.agent.round_store import RoundStore
from elastic_rt.agent.scale_up import SCALE_UP_WAIT_S, ScaleUpGate, join_when_warm
from elastic_rt.agent.warm import WarmPool
from elastic_rt.agent.warm_start import warm_start
from elastic_rt.checkpoint.fence import FencePublisher
from elastic_rt.decisions import Response, RestartReason
from elastic_rt.errors import RoundRejectedError
from elastic_rt.interfaces import AgentObserver, MembershipHandler, RestartPolicy
from elastic_rt.worker_reports.inbox import WorkerReports
from elastic_rt.worker_env import ENV_HEARTBEAT_DIR, ENV_NODE_ID, ENV_PARENT_PID, ENV_ROUND, ENV_RUN_ID

log = logging.getLogger(__name__)


RoundListener = Callable[..., None]  # called with round, store, group_rank, group_world_size, master_addr

# How long the agent, leaving, waits for its round listeners' store writes in flight (an etcd request each)
ROUND_STORE_DRAIN_S = 5.0


class ElasticRTAgent(LocalElasticAgent):
    """Restarts the group when a peer's lease expires, a new round starts, nodes wait to join,
    or a worker fails; only failures of this node's own workers count against max_restarts."""

    def __init__(
        self,
        spec,
        logs_specs,
        *,
        node_id: str,
        reports: WorkerReports,
        restart_grace_s: float = 1.0,
        shutdown_grace_s: float = 30.0,
        peer_loss_wait_s: float = 4.0,
        exit_barrier_timeout_s: float = 300.0,
        observer: AgentObserver | None = None,
        policy: RestartPolicy | None = None,
        round_listeners: Sequence[RoundListener] = (),
        log_line_prefix_template: str | None = None,
        diagnostics: FailureDiagnostics | None = None,
        warm_pool: WarmPool | None = None,
        crash_loop: CrashLoopJudge | None = None,
        scale_up_wait_s: float = SCALE_UP_WAIT_S,
    ) -> None:
        super().__init__(
            spec, logs_specs, start_method="spawn", exit_barrier_timeout=exit_barrier_timeout_s,
            log_line_prefix_template=log_line_prefix_template, shutdown_timeout=shutdown_grace_s,  # type: ignore[arg-type]  # torch adds it to time.monotonic(): a float keeps 0.5 s as 0.5, int() made it 0
        )
        self._node_id = node_id
        self._reports = reports
        self._restart_grace_s = restart_grace_s
        self._shutdown_grace_s = shutdown_grace_s
        self._peer_loss_wait_s = peer_loss_wait_s
        self.observer: AgentObserver = observer or AgentObserver()
        self.policy: RestartPolicy = policy or RestartPolicy()
        self._round_listeners = tuple(round_listeners)
        self.diagnostics = diagnostics or FailureDiagnostics(
            log_dir=os.path.dirname(reports.directory.rstrip(os.sep)), reports_dir=reports.directory)
        self.restarts: dict[RestartReason, int] = {}
        self._broken_group = False
        # the handler's extras (etcd-v3); None: torch's RendezvousHandler API only (c10d, --standalone)
        self._extras = spec.rdzv_handler if isinstance(spec.rdzv_handler, MembershipHandler) else None
        if self._extras is not None:
            self._extras.add_etcd_listener(self.observer.on_etcd)
        self.crash_loop = crash_loop
        self._warm_pool = warm_pool
        self._joined = False  # the first rendezvous of this agent is behind it
        self._scale_up_gate = ScaleUpGate(warm_pool, max_wait_s=scale_up_wait_s, log_prefix=self._prefix)
        self._fence: FencePublisher | None = None  # the round, for the workers' checkpoint commits
        self._round_store: RoundStore | None = None  # the round listeners' store: ends with the round
        if warm_pool is not None:
            warm_pool.log_prefix = self._prefix

    # ---- helpers -----------------------------------------------------------
    def _handler(self):
        return self._worker_group.spec.rdzv_handler

    def _membership(self):
        return self._extras.membership if self._extras is not None else None

    def _membership_change(self) -> RestartReason | None:
        if self._extras is not None:
            return self._extras.membership_change()
        return RestartReason.SCALE_UP if self._handler().num_nodes_waiting() > 0 else None

    @staticmethod
    def _sleep(seconds: float) -> None:
        stop_signal.raise_if_received()  # SIGTERM while waiting to join: the launcher's shutdown
        time.sleep(seconds)

    def _prefix(self) -> str:
        m = self._membership()
        return f"[{self._node_id} round {m.round if m else '-'}]"

    def _end_round_store(self, wait_s: float = 0.0) -> None:
        """The round is over for its listeners' threads: their store calls fail from now on."""
        rs, self._round_store = self._round_store, None
        if rs is not None and not rs.end(wait_s=wait_s):
            log.warning("%s a check of round %d was still writing to the store after %g s; leaving anyway",
                        self._prefix(), rs.round, wait_s)

    # ---- worker lifecycle --------------------------------------------------
    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """torch's run(); then the last round's checks write nothing more (the caller leaves the run next)."""
        try:
            return super().run(role)
        finally:
            self._end_round_store(ROUND_STORE_DRAIN_S)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if not self._joined and self._extras is not None:
            join_when_warm(self._warm_pool, running=self._extras.round_running,
                           max_wait_s=self._scale_up_gate.max_wait_s, sleep=self._sleep, log_prefix=self._prefix)
        self._joined = True
        while True:
            self._end_round_store()  # the old round's checks are moot; their stray writes stay in its own prefix
            t0 = time.monotonic()
            self.observer.on_rendezvous_started()
            super()._rendezvous(worker_group)
            m = self._membership()
            self.observer.on_rendezvous(
                round=m.round if m else 0,
                world_size=worker_group.workers[0].world_size if worker_group.workers else 0,
                nodes=worker_group.group_world_size,
                duration_s=time.monotonic() - t0,
            )
            if m is None:
                return
            self._round_store = RoundStore(worker_group.store, round=m.round)
            try:
                for listener in self._round_listeners:
                    listener(round=m.round, store=self._round_store, group_rank=worker_group.group_rank,
                             group_world_size=worker_group.group_world_size, master_addr=worker_group.master_addr)
                return
            except RoundRejectedError as exc:  # the pre-flight test excluded nodes: meet again without them
                log.warning("%s %s; meeting again once they left", self._prefix(), exc)
                self._wait_for_peer_loss()

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        m = self._membership()
        os.makedirs(self._reports.directory, exist_ok=True)
        self._reports.start(range(worker_group.spec.local_world_size))
        os.environ.update({
            ENV_PARENT_PID: str(os.getpid()),
            ENV_HEARTBEAT_DIR: self._reports.directory,
            ENV_RUN_ID: self._handler().get_run_id(),
            ENV_NODE_ID: self._node_id,
            ENV_ROUND: str(m.round if m else 0),
        })
        if self._fence is None and self._extras is not None:
            self._fence = FencePublisher(self._reports.directory, self._extras)
        if self._fence is not None:
            self._fence.start()  # the new round is in the file before a worker can read it
        with whole_line_tee(), warm_start(self._warm_pool, ready=self._workers_stepped):
            pids = super()._start_workers(worker_group)
        self.diagnostics.on_workers_started(
            [(w.local_rank, w.global_rank, pids[w.local_rank]) for w in worker_group.workers if w.local_rank in pids],
            getattr(self._pcontext, "stderrs", {}) or {})
        self.diagnostics.watch(self._pcontext)
        forgive_teardown_exits(self._pcontext, self._script_returned, self._prefix)
        self.observer.on_workers_started(dict(pids))
        self.policy.on_workers_started(pids.keys())
        return pids

    def _script_returned(self, local_rank: int, pid: int) -> bool:
        beat = self._reports.heartbeats().get(local_rank)
        return beat is not None and beat.returned and beat.pid == pid

    def _workers_stepped(self) -> bool:
        return all(hb is not None for hb in self._reports.heartbeats().values())

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """Stop every worker and its descendants: `death_sig`, the grace period, then SIGKILL."""
        if self._pcontext is not None:
            pids = list(self._pcontext.pids().values())
            killed = stop_tree(pids, sig=death_sig, grace_s=float(timeout),
                               before_kill=lambda alive: self.diagnostics.on_grace_expired(
                                   self._prefix(), alive, float(timeout)))
            if killed:
                log.info("%s SIGKILLed %d process(es) left after %gs grace", self._prefix(), len(killed), timeout)
        super()._shutdown(signal.SIGKILL, timeout=5)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        if self._broken_group:
            # A worker or a peer is gone: the others are stuck in, or about to fail, a collective
            # and have nothing consistent to save. Every second spent here is recovery time.
            self._shutdown(signal.SIGKILL, timeout=0)
        else:
            self._shutdown(signal.SIGTERM, timeout=self._restart_grace_s)

    def _restart(self, reason: RestartReason, detected_at: float) -> None:
        self.restarts[reason] = self.restarts.get(reason, 0) + 1
        self.observer.on_restart(reason)
        log.warning("%s restarting the worker group: %s", self._prefix(), reason.words)
        self._scale_up_gate.reset()
        before = self._membership()
        self._broken_group = reason.broken
        try:
            self._restart_workers(self._worker_group)
        finally:
            self._broken_group = False
        after = self._membership()
        if reason is RestartReason.WORKER_FAILURE and before and after and set(before.nodes) - set(after.nodes):
            # The failure was a symptom of a lost peer: give the restart back.
            self._remaining_restarts += 1
            self._forget_crash()
            log.info("%s peer(s) %s left; restart not counted", self._prefix(),
                     ",".join(sorted(set(before.nodes) - set(after.nodes))))
        self.observer.on_recovered(time.monotonic() - detected_at)

    def _etcd_answers(self) -> bool:
        """The rendezvous handler can reach etcd (one without that notion, e.g. --standalone's, always can)."""
        return self._extras is None or self._extras.etcd_reachable()

    def _exit_barrier(self) -> None:
        """torch's exit barrier keeps every agent until all finished, through the rendezvous store (etcd
        here); when it fails torch logs the failure with a traceback. With etcd not answering there is
        nothing to wait on: say so in one line and finish (the other nodes finish on their own)."""
        if not self._etcd_answers():
            log.warning("%s etcd does not answer: not waiting for the other nodes to finish", self._prefix())
            return
        super()._exit_barrier()

    def _await_etcd(self, what: str) -> None:
        """Membership decisions need etcd: while it does not answer, wait (saying so every 10 s) rather
        than guess; then let the view catch up with what the other nodes did meanwhile."""
        if self._extras is None or self._etcd_answers():
            return
        t0 = time.monotonic()
        limit_s = self._extras.settings.join_timeout_s
        said = None
        while not self._etcd_answers() and time.monotonic() - t0 < limit_s:
            if said is None or time.monotonic() - said >= 10.0:
                said = time.monotonic()
                log.warning("%s %s; waiting for etcd to answer before re-forming (%.0f s so far)",
                            self._prefix(), what, said - t0)
            time.sleep(0.2)
        if self._etcd_answers():
            self._extras.catch_up()
            log.info("%s etcd answers again after %.1f s; handling: %s", self._prefix(), time.monotonic() - t0, what)

    def _wait_for_peer_loss(self) -> RestartReason | None:
        """A worker failure with no restarts left: was it caused by a peer dying?"""
        deadline = time.monotonic() + self._peer_loss_wait_s
        while time.monotonic() < deadline:
            change = self._membership_change()
            if change:
                return change
            time.sleep(0.2)
        return None

    # ---- the monitor loop --------------------------------------------------
    def _invoke_run(self, role: str = "default") -> RunResult:
        spec = self._worker_group.spec
        log.info("%s starting %d worker(s): %s", self._prefix(), spec.local_world_size, spec.get_entrypoint_name())
        self._initialize_workers(self._worker_group)
        while True:
            time.sleep(spec.monitor_interval)
            stop_signal.raise_if_received()
            result = self._monitor_workers(self._worker_group)
            state = result.state
            self._worker_group.state = state
            now = time.monotonic()
            if state == WorkerState.SUCCEEDED:
                self.observer.on_workers_finished("succeeded")
                log.info("%s workers finished; waiting for the other nodes", self._prefix())
                self._exit_barrier()
                return result
            if state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                self._log_failures(result)
                self._await_etcd("worker(s) failed")
                change = self._membership_change()
                if change in (RestartReason.ROUND_ADVANCED, RestartReason.PEER_LOST):
                    self._restart(change, now)
                    continue
                self._judge_crash_loop(lambda beats, committed: failure_record(
                    self.diagnostics.last_classified, beats, committed))
                if self._remaining_restarts > 0:
                    self._remaining_restarts -= 1
                    self._restart(RestartReason.WORKER_FAILURE, now)
                else:
                    change = self._wait_for_peer_loss()
                    if change:
                        self._forget_crash()
                        self._restart(change, now)
                        continue
                    self._out_of_restarts(RestartReason.WORKER_FAILURE)
                    return result
            elif state == WorkerState.HEALTHY:
                self.observer.on_tick()
                change = self._membership_change()
                if change is RestartReason.SCALE_UP and self._scale_up_gate.hold():
                    change = None  # the group trains on while this node's warm workers import
                change = change or self.policy.check()
                if change is not None and change.response is Response.LEAVE:
                    log.error("%s %s: leaving the job so that the others re-form without this node (%s)",
                              self._prefix(), change.summary, change.hint)
                    self._stop_workers(self._worker_group)
                    self._worker_group.state = WorkerState.FAILED
                    return RunResult(state=WorkerState.FAILED)
                if change is RestartReason.HANG:
                    change = self._peer_restart_explains_hang() or change
                if change is RestartReason.HANG:
                    self.diagnostics.on_hang(self._prefix(), self.policy.hang_verdict())
                    self.observer.on_failures(dict(self.diagnostics.last_failures))
                    hung = dict(self.diagnostics.last_failures)
                    self._judge_crash_loop(lambda beats, committed: hang_record(
                        min(hung, default=-1), "; ".join(hung.values()) or "a hang", beats, committed))
                    self.policy.on_hang_restart()
                if change is not None and change.counted:
                    if self._remaining_restarts <= 0:
                        self._out_of_restarts(change)
                        return RunResult(state=WorkerState.FAILED)
                    self._remaining_restarts -= 1
                if change:
                    self._restart(change, now)
            else:
                raise RuntimeError(f"{self._prefix()} worker group in unexpected state {state.name}")

    def _judge_crash_loop(self, record_of) -> None:
        """Hand a failure the agent would restart for to the crash-loop judge (record_of(heartbeats, committed
        step) -> FailureRecord); on its verdict stop the workers, say it in one line, raise CrashLoopError."""
        if self.crash_loop is None:
            return
        verdict = self.crash_loop.on_failure(record_of(self._reports.heartbeats(), self.crash_loop.committed_step()))
        if verdict is None:
            return
        line = verdict.line(self.crash_loop.settings)
        log.error("%s %s", self._prefix(), line)
        self._stop_workers(self._worker_group)
        self._worker_group.state = WorkerState.FAILED
        raise CrashLoopError(line)

    def _forget_crash(self) -> None:
        if self.crash_loop is not None:
            self.crash_loop.forget_last()

    def _out_of_restarts(self, reason: RestartReason) -> None:
        """A counted restart is due and none are left: say why in one line, stop the workers, fail."""
        log.error("%s %s and no restarts are left (--max-restarts %d%s)", self._prefix(), reason.summary,
                  self._worker_group.spec.max_restarts, f"; {reason.hint}" if reason.hint else "")
        self._stop_workers(self._worker_group)
        self._worker_group.state = WorkerState.FAILED

    def _peer_restart_explains_hang(self) -> RestartReason | None:
        """Local workers that all merely wait (none stopped or in uninterruptible sleep) are most
        likely stuck in a collective with a peer that is the culprit: give that node's restart a
        moment to arrive, so that the hang counts against the node that caused it."""
        if self._worker_group.group_world_size <= 1 or self.diagnostics.local_suspects():
            return None
        change = self._wait_for_peer_loss()
        if change:
            log.info("%s local workers stalled while another node restarted: following it (%s), not counted "
                     "as a hang here", self._prefix(), change.words)
        return change

    def _log_failures(self, result: RunResult) -> None:
        """One line per failed worker: rank, pid, cause and the user-code frame that raised."""
        self.diagnostics.on_failures(self._prefix(), result.failures)
        self.observer.on_failures(dict(self.diagnostics.last_failures))
