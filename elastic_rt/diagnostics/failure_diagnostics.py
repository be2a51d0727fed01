"""What the agent records when workers fail or hang: one line per failure with its cause, the cause metrics,
hung ranks' stacks and the flight recorder's view, in the log dir."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from elastic_rt.diagnostics import flight_recorder as fr
from elastic_rt.diagnostics.failure_metrics import FailureMetrics
from elastic_rt.diagnostics.failures import ClassifiedFailure, classify, describe, read_error_file, signal_name, stderr_tail
from elastic_rt.diagnostics.hang import SUSPECT_STATES, HangVerdict, first_stopped
from elastic_rt.diagnostics.oom import OomEvidence
from elastic_rt.diagnostics.stacks import (DEFAULT_STACK_SIGNAL, UNANSWERABLE, StackCollector, WorkerRef, parse_signal,
                                     process_state, raw_path)
from elastic_rt.decisions import FailureCause
from elastic_rt.errors import ConfigError
from elastic_rt.sections import positive, option
from elastic_rt.worker_env import ENV_FLIGHT_RECORDER, ENV_STACK_SIGNAL

log = logging.getLogger(__name__)


def parse_hang_timeout(text: str) -> float | None:
    """'auto' -> None (the automatic rule); '0' -> 0.0 (off); '90' -> 90.0."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--hang-timeout {text!r}: expected auto, 0 (off) or a number of seconds") from None
    return positive("--hang-timeout", zero_ok=True)(value)


# Signals the stack dump may not use: faulthandler's own, uncatchable ones, and the agent's and torch's.
_RESERVED_SIGNALS = {signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS,
                     signal.SIGILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD}


def parse_stack_signal(text: str) -> int | None:
    """'SIGRTMIN+6', 'SIGUSR2', '40' -> a signal number; 'off' -> None."""
    try:
        num = parse_signal(str(text))
    except (AttributeError, ValueError):
        raise ConfigError(f"--stack-signal {text!r}: expected a signal name (SIGRTMIN+6, SIGUSR2), "
                          "a number or off") from None
    if num is None:
        return None
    if num in _RESERVED_SIGNALS or not 0 < num <= int(signal.SIGRTMAX):
        raise ConfigError(f"--stack-signal {text!r}: that signal is reserved or invalid; "
                          "use a real-time signal such as SIGRTMIN+6")
    return num


@dataclass(frozen=True, kw_only=True)
class DiagnosticsSettings:
    """Failure diagnostics' config section: hang detection, stack dumps, torch's flight recorder."""

    hang_timeout_s: float | None = option(
        "--hang-timeout", default="auto", parse=parse_hang_timeout,
        help="restart the group when a worker makes no optimizer step (or report_step) for this many seconds; auto "
             "(default): max(300 s, 20 x median step, 2 x longest pause), once a first step was seen; 0 = off "
             "(docs/failures.md)")  # None: auto
    stack_signal: int | None = option(
        "--stack-signal", default=DEFAULT_STACK_SIGNAL, parse=parse_stack_signal,
        help=f"signal on which workers dump their Python stacks for the agent (default {DEFAULT_STACK_SIGNAL}; "
             "off = no stack dumps)")  # None: off
    flight_recorder: str = option(
        "--flight-recorder", default="auto", choices=("auto", "on", "off"),
        help="torch's collective flight recorder in workers, dumped on hangs and timeouts: auto (default: on with "
             "CUDA), on, off")

    def recorder_on(self, *, cuda: bool) -> bool:
        return cuda if self.flight_recorder == "auto" else self.flight_recorder == "on"


class FailureDiagnostics:
    """Called by the agent as workers start, fail, hang and outlive SIGTERM. Decides nothing.

    log_dir: where stacks/ and flight_recorder/ go. reports_dir: the directory the workers
    share with the agent (heartbeats; their stack and dump channels live there too).
    metrics: an elastic_rt.diagnostics.failure_metrics.FailureMetrics, or None.
    """

    def __init__(self, *, log_dir: str, reports_dir: str, metrics: Any = None, oom: OomEvidence | None = None,
                 stack_signal: int | None = None, flight_recorder: bool = False,
                 stacks: StackCollector | None = None, wall_clock: Callable[[], float] = time.time) -> None:
        self.log_dir = log_dir
        self._reports_dir = reports_dir
        self._metrics = metrics
        self._oom = oom
        self.stack_signal = stack_signal
        self.flight_recorder = flight_recorder
        self.fr_dir = os.path.join(log_dir, "flight_recorder")
        self._stacks = stacks or StackCollector(root=os.path.join(log_dir, "stacks"), sig=stack_signal)
        self._wall_clock = wall_clock
        self._workers: dict[int, WorkerRef] = {}  # local rank -> worker
        self._stderrs: dict[int, str] = {}
        self._started_wall_s = 0.0
        self._dumped: set[int] = set()  # pids whose stacks were written in this attempt
        self.last_failures: dict[int, str] = {}  # global rank -> cause line, of the last failure or hang
        self.last_classified: dict[int, tuple[int, ClassifiedFailure]] = {}  # global rank -> (local rank, cause)
        self._stopped_by_agent: set[int] = set()  # local ranks torch terminated after a sibling failed

    def worker_env(self, environ: Mapping[str, str], *, torch_version: str = "") -> dict[str, str]:
        """Variables every worker inherits (set once by the launcher)."""
        env = {ENV_STACK_SIGNAL: str(self.stack_signal or 0)}
        if self.flight_recorder:
            try:
                os.makedirs(self.fr_dir, exist_ok=True)
            except OSError as exc:  # a full or read-only log dir: train without it, say so once
                log.warning("flight recorder off: cannot create %s (%s)", self.fr_dir, exc.strerror or exc)
                self.flight_recorder = False
                return env
            env.update(fr.worker_env(self.fr_dir, environ, fr_names=fr.uses_fr_names(torch_version)))
            env[ENV_FLIGHT_RECORDER] = "1"
        return env

    def local_suspects(self) -> list[int]:
        """Local ranks whose process state explains a hang by itself (stopped, disk-sleep, ...)."""
        return sorted(w.local_rank for w in self._workers.values() if process_state(w.pid) in SUSPECT_STATES)

    # ---- lifecycle -------------------------------------------------------------------------
    def on_workers_started(self, workers: Iterable[tuple[int, int, int]], stderrs: Mapping[int, str]) -> None:
        """workers: (local rank, global rank, pid); stderrs: local rank -> stderr log path ('' = console)."""
        self._workers = {local: WorkerRef(local_rank=local, global_rank=rank, pid=pid,
                                          raw_path=raw_path(self._reports_dir, local))
                         for local, rank, pid in workers}
        self._stderrs = dict(stderrs)
        self._started_wall_s = self._wall_clock()
        self._dumped = set()
        self._stopped_by_agent = set()
        if self._oom is not None:
            self._oom.cgroups.forget()
            for w in self._workers.values():
                self._oom.on_worker_started(w.pid)

    def watch(self, pcontext: Any) -> None:
        """Learn which workers torch's process context terminates itself: when one worker fails it
        SIGTERMs the others and reports them as failed too; those are not failures of their own."""
        close = getattr(pcontext, "close", None)
        if close is None or not hasattr(pcontext, "_running_local_ranks"):
            return

        def close_and_note(*args, **kwargs):
            self._stopped_by_agent |= set(pcontext._running_local_ranks)
            return close(*args, **kwargs)

        pcontext.close = close_and_note

    def on_failures(self, prefix: str, failures: Mapping[int, Any]) -> list[ClassifiedFailure]:
        """One line and one count per failed worker (torch ProcessFailure: local_rank, pid, exitcode, error_file)."""
        causes = []
        self.last_failures, self.last_classified = {}, {}
        nccl_dumps = fr.timeout_dumps(self.fr_dir, self._started_wall_s - 1.0) if self.flight_recorder else {}
        errors = {r: read_error_file(f.error_file) for r, f in failures.items()}
        # a worker the agent stopped had failed on its own if it had already recorded an exception: it raised,
        # and was still tearing down when a peer (broken by its death) was seen to fail first
        stopped = {r for r, f in failures.items()
                   if f.local_rank in self._stopped_by_agent and int(f.exitcode) < 0
                   and not (errors[r] is not None and errors[r].message)}
        own = [r for r in failures if r not in stopped]
        for rank, failure in sorted(failures.items()):
            exitcode = int(failure.exitcode)
            if rank in stopped and own:
                log.info("%s worker stopped: rank %d (local %d, pid %s) by the agent (%s) after rank(s) %s failed",
                         prefix, rank, failure.local_rank, failure.pid, signal_name(-exitcode), sorted(own))
                continue
            oom = None
            if self._oom is not None and exitcode in (-int(signal.SIGKILL), 128 + int(signal.SIGKILL)):
                oom = self._oom.for_pid(failure.pid)
            cause = classify(exitcode=exitcode, error=errors[rank], oom_evidence=oom,
                             stderr_tail=stderr_tail(self._stderrs.get(failure.local_rank)),
                             watchdog_dumped=rank in nccl_dumps)
            extra = ""
            if cause.cause.collective and nccl_dumps:
                dumps = {r: d for r, p in nccl_dumps.items() if (d := fr.load_dump(p)) is not None}
                extra = f"; flight recorder: {fr.summarise(dumps)} (dumps in {self.fr_dir})"
            log.warning("%s worker failed: rank %d (local %d, pid %s) %s%s", prefix, rank, failure.local_rank,
                        failure.pid, describe(cause), extra)
            if self._metrics is not None:
                self._metrics.on_failure(cause.cause, cause.collective)
            causes.append(cause)
            self.last_failures[rank] = describe(cause)
            self.last_classified[rank] = (failure.local_rank, cause)
        return causes

    def on_hang(self, prefix: str, verdict: HangVerdict | None) -> str:
        """Name the rank that stopped first, write every rank's stacks (and flight recorder dumps); returns the dir."""
        workers = list(self._workers.values())
        states = {w.local_rank: process_state(w.pid) for w in workers}
        stalls = verdict.stalls if verdict is not None else ()
        first = first_stopped(stalls, states)
        notes = {s.local_rank: f"last step {s.last_step}, no progress for {s.stalled_s:.1f} s" for s in stalls}
        out_dir = self._stacks.collect(workers, label="hang", notes=notes)
        self._dumped = {w.pid for w in workers}
        summary = ""
        if self.flight_recorder:
            answering = [w for w in workers if states[w.local_rank] not in UNANSWERABLE]
            summary = f"; flight recorder: {self._request_dumps(answering, workers, out_dir)}"
        if first is not None and first.local_rank in self._workers:
            w = self._workers[first.local_rank]
            state = states.get(w.local_rank, "unknown")
            who = (f"rank {w.global_rank} (local {w.local_rank}, pid {w.pid}, state {state}) stopped progressing "
                   f"first (last step {first.last_step})")
            if self._metrics is not None:
                self._metrics.on_hang(w.local_rank, state)
        else:
            who, state = "no rank could be named", "unknown"
        named = first is not None and first.local_rank in self._workers
        hung = {self._workers[first.local_rank].global_rank: f"cause={FailureCause.HANG}: {who}"} if named else {}
        self.last_failures = hung
        reason = verdict.reason if verdict is not None else "hang"
        log.error("%s workers hung: %s; %s; cause=%s; stacks of every local rank in %s%s", prefix, who, reason,
                  FailureCause.HANG, out_dir, summary)
        return out_dir

    def on_grace_expired(self, prefix: str, pids: Iterable[int], grace_s: float) -> str | None:
        """Workers outlived SIGTERM's grace: write their stacks before they get SIGKILL."""
        left = [w for w in self._workers.values() if w.pid in set(pids) and w.pid not in self._dumped]
        if not left:
            return None
        out_dir = self._stacks.collect(left, label="sigterm-grace-expired")
        self._dumped.update(w.pid for w in left)
        log.warning("%s rank(s) %s still running %gs after SIGTERM: stacks in %s; sending SIGKILL", prefix,
                    [w.global_rank for w in left], grace_s, out_dir)
        return out_dir

    def _request_dumps(self, asked: list[WorkerRef], workers: list[WorkerRef], out_dir: str) -> str:
        """Ask the workers that can answer for a flight recorder dump; summarise over every local rank."""
        targets = {w.global_rank: os.path.join(out_dir, f"flight_recorder-rank{w.global_rank}.json") for w in asked}
        fr.request_dumps({fr.fifo_path(self._reports_dir, w.local_rank): targets[w.global_rank] for w in asked})
        dumps = {rank: d for rank, path in targets.items() if (d := fr.load_dump(path)) is not None}
        return fr.summarise(dumps, expected_ranks=[w.global_rank for w in workers])

    def close(self) -> None:
        if self._oom is not None:
            self._oom.close()


def build_diagnostics(settings: DiagnosticsSettings, *, log_dir: str, reports_dir: str, registry: Any, run_id: str,
                      node: str) -> FailureDiagnostics:
    """This node's failure diagnostics from its settings, recording FailureMetrics in `registry`; exports the
    variables every worker inherits (stack signal, flight recorder) into this process's environment."""
    import torch

    diagnostics = FailureDiagnostics(log_dir=log_dir, reports_dir=reports_dir, oom=OomEvidence(),
                                     metrics=FailureMetrics(registry=registry, run_id=run_id, node=node),
                                     stack_signal=settings.stack_signal,
                                     flight_recorder=settings.recorder_on(cuda=torch.cuda.is_available()))
    os.environ.update(diagnostics.worker_env(os.environ, torch_version=torch.__version__))
    return diagnostics
