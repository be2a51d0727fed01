"""Entry point of every worker: die with the agent (PR_SET_PDEATHSIG), then run the user's script
(a warm worker first imports ahead and waits for its environment: agent/warm_child.py)."""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

from elastic_rt.agent import teardown_guard, warm_child
from elastic_rt.worker_env import ENV_HEARTBEAT_DIR, ENV_HEARTBEAT_FILE, ENV_PARENT_PID

_PR_SET_PDEATHSIG = 1


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


def main(argv: list[str]) -> None:
    _die_with_parent()
    teardown_guard.install()
    warm, argv = warm_child.split_argv(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if warm is not None:  # a pre-started worker: import ahead, then wait for the agent's start message
        argv = warm_child.become_worker(warm, argv)
    hb_dir = os.environ.get(ENV_HEARTBEAT_DIR)
    if hb_dir:
        os.environ[ENV_HEARTBEAT_FILE] = os.path.join(hb_dir, f"worker-{os.environ.get('LOCAL_RANK', '0')}")
    if not argv:
        sys.exit("elastic-rt worker: no training script given")
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
