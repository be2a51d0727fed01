"""Workers whose script returned but whose interpreter then died (torch 2.13 sometimes aborts in teardown:
"terminate called without an active exception") count as finished: the job is not run again for it."""

from __future__ import annotations

import logging
import signal
from typing import Any, Callable

from elastic_rt.diagnostics.failures import signal_name
from elastic_rt.torch_seams import process_failures, wrap_failure_capture

log = logging.getLogger(__name__)


def describe_exit(exitcode: int) -> str:
    return signal_name(-exitcode) if exitcode < 0 else f"exit code {exitcode}"


def forgive_teardown_exits(pcontext: Any, returned: Callable[[int, int], bool], prefix: Callable[[], str]) -> None:
    """Wrap torch's SubprocessContext so that a worker that exits abnormally after its script returned
    (`returned(local_rank, pid)`: its heartbeat says so) is not a failure. torch's own launcher fails
    the job then; an elastic agent would restart the group and run the finished job again."""

    def forgiving(capture: Callable[[set[int]], None]) -> Callable[[set[int]], None]:
        def capture_and_forgive(done_local_ranks: set[int]) -> None:
            capture(done_local_ranks)
            failures = process_failures(pcontext) or {}
            for local_rank in sorted(done_local_ranks & set(failures)):
                forgive(failures, local_rank)

        return capture_and_forgive

    def forgive(failures: dict[int, Any], local_rank: int) -> None:
        failure = failures[local_rank]
        if not returned(local_rank, failure.pid):
            return
        del failures[local_rank]
        exitcode = int(failure.exitcode)
        stopped = exitcode in (-signal.SIGTERM, -signal.SIGKILL)  # by the agent, as a peer failed
        log.log(logging.INFO if stopped else logging.WARNING,
                "%s worker local rank %d (pid %s) ended with %s after its script returned; counted as finished%s",
                prefix(), local_rank, failure.pid, describe_exit(exitcode),
                "" if stopped else " (a crash in interpreter teardown)")

    wrap_failure_capture(pcontext, forgiving)
