"""Entry point of every worker: die with the agent (PR_SET_PDEATHSIG), hook progress, stacks and errors, then run the script.

A warm worker first imports ahead and waits for its environment (worker/warm_child.py). Nothing
else here imports torch: the hooks into torch run when the script imports it (or at once, if a
warm worker imported it ahead: elastic_rt.worker.after_import).
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import sys
import time
import traceback

from elastic_rt.worker import teardown_guard, warm_child
from elastic_rt.worker.after_import import when_imported
from elastic_rt.worker_env import (
    ENV_FLIGHT_RECORDER,
    ENV_HEARTBEAT_DIR,
    ENV_HEARTBEAT_FILE,
    ENV_NO_COMPUTE_TIMER,
    ENV_NO_PROGRESS_HOOK,
    ENV_PARENT_PID,
    ENV_STACK_SIGNAL,
)

_PR_SET_PDEATHSIG = 1
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # set by torch's agent for every worker


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the agent that started it dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the agent's process-tree stop still applies
        return
    expected = os.environ.get(ENV_PARENT_PID, "")
    if expected.isdigit() and os.getppid() != int(expected):
        # The agent died between fork and prctl: the death signal will never come.
        os._exit(137)


def _hook_optimizer_steps() -> None:
    """Every optimizer.step() is progress for the hang detector (torch's global post hook, ~1 us)."""
    if os.environ.get(ENV_NO_PROGRESS_HOOK, "") not in ("", "0"):
        return
    from elastic_rt.worker_reports.heartbeat import install_optimizer_progress

    when_imported("torch.optim.optimizer", install_optimizer_progress)
    if os.environ.get(ENV_NO_COMPUTE_TIMER, "") in ("", "0"):  # lock-step stragglers (goodput/compute.py)
        from elastic_rt.goodput.compute import install_collectives_in_worker, install_in_worker

        when_imported("torch.autograd", install_in_worker)
        when_imported("torch.distributed", install_collectives_in_worker)


def _install_diagnostics(hb_dir: str, local_rank: int) -> None:
    sig = os.environ.get(ENV_STACK_SIGNAL, "0")
    if sig.isdigit() and int(sig) > 0:
        from elastic_rt.diagnostics.stacks import install_in_worker, raw_path

        install_in_worker(int(sig), raw_path(hb_dir, local_rank))
    if os.environ.get(ENV_FLIGHT_RECORDER) == "1":
        from elastic_rt.diagnostics import flight_recorder

        path = flight_recorder.fifo_path(hb_dir, local_rank)
        when_imported("torch.distributed", lambda _mod: flight_recorder.start_dump_listener(path))


def record_error(exc: BaseException, path: str | None) -> None:
    """Write `exc` to the torchelastic error file, in torch's format (ErrorHandler.record_exception),
    unless the script's own @record already did; atomically, since the agent may read it at once."""
    if not path or os.path.exists(path):
        return
    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}}}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass  # the failure is still classified from the exit code


def main(argv: list[str]) -> None:
    _die_with_parent()
    teardown_guard.install()
    warm, argv = warm_child.split_argv(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if warm is not None:  # a pre-started worker: import ahead, then wait for the agent's start message
        argv = warm_child.become_worker(warm, argv)
    _hook_optimizer_steps()
    hb_dir = os.environ.get(ENV_HEARTBEAT_DIR)
    if hb_dir:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        os.environ[ENV_HEARTBEAT_FILE] = os.path.join(hb_dir, f"worker-{local_rank}")  # for its forked children
        from elastic_rt.worker_reports.heartbeat import report_to

        report_to(os.environ[ENV_HEARTBEAT_FILE])
        _install_diagnostics(hb_dir, local_rank)
    if not argv:
        sys.exit("elastic-rt worker: no training script given")
    returned = False
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
        returned = True
    except SystemExit as exc:
        returned = exc.code is None or exc.code == 0
        raise
    except BaseException as exc:
        record_error(exc, os.environ.get(ENV_ERROR_FILE))
        raise
    finally:
        if hb_dir:  # exiting, not stuck: interpreter teardown of a torch process can take seconds
            from elastic_rt.worker_reports.heartbeat import report_finished

            # returned: the agent does not re-run the job if teardown then aborts (exit_aborts.py)
            report_finished(returned)


if __name__ == "__main__":
    main(sys.argv[1:])
