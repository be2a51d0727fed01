"""The typed vocabulary of the agent's decisions: why a worker group stops, what the agent does about it, why a
worker failed, what a straggler is judged by, and the collective backends' error words. A leaf module (it imports nothing from elastic_rt), so every package may use it.

Each value is a `str` whose text is the label value exported in metrics and written to the goodput journal
(`elastic_rt_restarts_total{reason}`, `elastic_rt_worker_failures_total{cause}`): dashboards and alert rules
match on these words, so a value is never renamed. Code compares members, never their text.
"""

from __future__ import annotations

import re
from enum import Enum


class _Word(str, Enum):
    """A str enum whose str() and format() are its value on every Python (3.10's and 3.12's differ)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def words(self) -> str:
        """The value as words for a log line: "peer lost"."""
        return self.value.replace("_", " ")


class _Described(_Word):
    """A _Word whose members carry `meaning`: what it means to an operator, the text docs/metrics.md shows."""

    meaning: str

    def __new__(cls, value: str, meaning: str) -> _Described:
        member = str.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member


class Response(_Described):
    """What the agent does with its worker group for a RestartReason."""

    RESTART = "restart", "stop the workers, take part in the next round, start them again"
    LEAVE = "leave", "stop the workers and leave the job: the other nodes re-form without this node"
    STOP = "stop", "stop the workers, leave and exit with the verdict's code: restarting cannot help"


class RestartReason(_Word):
    """Why this node's worker group stops, as the membership monitor, a restart policy or the agent decides it.

    Members carry how the agent handles them (the whole table, so a new reason is one line here):
      response  RESTART or LEAVE
      counted   a restart counts against --max-restarts (a node's own fault, not a peer's)
      broken    the group is broken (a worker or a peer is gone): the survivors are stuck in, or about to
                fail, a collective and have nothing consistent to save, so they are killed without grace
      summary   what was detected, for the log line of a LEAVE or of a counted restart with none left
      hint      what the operator can change, in that line's parentheses
      meaning   what happened, for an operator (docs/metrics.md's table of restart reasons)
    """

    response: Response
    counted: bool
    broken: bool
    summary: str
    hint: str
    meaning: str

    def __new__(cls, value: str, response: Response, handling: dict) -> RestartReason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.response = response
        member.counted = handling.get("counted", False)
        member.broken = handling.get("broken", False)
        member.summary = handling.get("summary", value.replace("_", " "))
        member.hint = handling.get("hint", "")
        member.meaning = handling["meaning"]
        return member

    #: a local worker failed (the agent, from its worker group's state)
    WORKER_FAILURE = "worker_failure", Response.RESTART, dict(counted=True, broken=True,
                                                              summary="worker group failed",
                                                              meaning="a local worker exited non-zero")
    #: a member of this round is gone (the membership monitor; handler.py's docstring has the rules)
    PEER_LOST = "peer_lost", Response.RESTART, dict(broken=True,
                                                    meaning="another node of the round lost its etcd lease")
    #: another node opened a new round (the membership monitor)
    ROUND_ADVANCED = "round_advanced", Response.RESTART, dict(
        meaning="another node started a new rendezvous round, e.g. after its own worker failed")
    #: nodes wait to join and the round has room for them (the membership monitor)
    SCALE_UP = "scale_up", Response.RESTART, dict(meaning="a node joined")
    #: the local workers made no step progress for the hang timeout (HealthPolicy)
    HANG = "hang", Response.RESTART, dict(
        counted=True, summary="workers hung", meaning="no step progress for the hang timeout",
        hint="with the auto hang timeout, long pauses between steps may need --hang-timeout")
    #: the collective probe of the current round failed, with --probe-failure-action leave (HealthPolicy)
    PROBE_FAILURE = "probe_failure", Response.LEAVE, dict(summary="collective probe failed",
                                                         hint="--probe-failure-action leave",
                                                         meaning="the collective probe failed")
    #: a local worker is a straggler, with --straggler-action leave (StragglerPolicy)
    STRAGGLER = "straggler", Response.LEAVE, dict(summary="a local worker is a straggler",
                                                 hint="--straggler-action leave",
                                                 meaning="a local worker is a straggler")
    #: failures repeat without progress (the crash-loop judge, agent/crash_loop.py): exit 3, do not requeue
    CRASH_LOOP = "crash_loop", Response.STOP, dict(summary="failures repeat without progress",
                                                  hint="--crash-loop-repeats, --crash-loop-no-step",
                                                  meaning="failures repeat without progress: the agent exits 3, "
                                                          "and the Slurm recipe does not requeue")


class DetectionAction(_Word):
    """What a detector does when it fires (--probe-failure-action, --straggler-action)."""

    REPORT = "report"  # metrics, a log line, a journal event; the job goes on
    LEAVE = "leave"  # and this node leaves the job (RestartReason with Response.LEAVE)


DETECTION_ACTIONS = tuple(a.value for a in DetectionAction)  # the flags' choices


class Signal(_Word):
    """What a rank's speed is judged by (goodput/stragglers.py); `elastic-rt status` names the one that flagged it."""

    STEP_TIME = "step_time"  # median time per step (Δtime/Δstep of its heartbeats)
    COMPUTE = "compute"  # median time per step spent outside backward(): the rank's own work

    @property
    def describe(self) -> str:
        return "steps in" if self is Signal.STEP_TIME else "computes (outside backward() and collectives) for"


class FailureCause(_Described):
    """Why one worker failed, in the order an operator reads them (elastic_rt_worker_failures_total{cause})."""

    EXCEPTION = "exception", "the script raised (its error file says what)"
    OOM = "oom", "host or accelerator memory: a MemoryError, CUDA OOM, or the kernel's OOM killer"
    KILLED = "killed", "a terminating signal from outside the agent (kill, a scheduler)"
    SIGNAL = "signal", "a fault signal (SIGSEGV, SIGABRT, ...)"
    COLLECTIVE_TIMEOUT = "collective_timeout", "a collective backend timed out"
    COLLECTIVE_ERROR = "collective_error", "a collective backend aborted or failed otherwise"
    HANG = "hang", "no step progress (the hang restart names the rank that stopped first)"
    EXIT = "exit", "a non-zero exit code without an exception"

    @property
    def collective(self) -> bool:
        return self in (FailureCause.COLLECTIVE_TIMEOUT, FailureCause.COLLECTIVE_ERROR)


# Collective backends' own words (torch 2.x c10d, gloo, NCCL) -> (backend, kind) for
# elastic_rt_collective_errors_total{backend,kind}; the first match wins.
COLLECTIVE_PATTERNS: tuple[tuple[re.Pattern, str, str], ...] = tuple(
    (re.compile(rx, re.IGNORECASE), backend, kind) for rx, backend, kind in (
        (r"Watchdog caught collective operation timeout", "nccl", "timeout"),
        (r"NCCL communicator was aborted|NCCL.*(?:comm|communicator).*abort|ncclCommAbort", "nccl", "abort"),
        (r"ncclRemoteError|ncclSystemError|ncclInternalError|ncclUnhandledCudaError|NCCL error", "nccl", "error"),
        (r"gloo.*Timed out waiting|Timed out waiting \d+ms for (?:recv|send)", "gloo", "timeout"),
        (r"gloo.*(?:Connection closed by peer|Connection reset by peer|Broken pipe|Read error|Write error)",
         "gloo", "peer_closed"),
        (r"DistBackendError|Socket Timeout|wait timeout after|timed out after \d+ ?ms", "c10d", "timeout"),
    )
)
# Every (backend, kind) label pair, in the patterns' order.
COLLECTIVE_ERROR_KINDS: tuple[tuple[str, str], ...] = tuple(
    dict.fromkeys((backend, kind) for _, backend, kind in COLLECTIVE_PATTERNS))
