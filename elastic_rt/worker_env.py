"""Names of the environment variables the agent hands to each worker, and their reader."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

# Set by the agent for every worker it starts (in addition to torch's RANK,
# WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ... set by torch.distributed.elastic).
ENV_HEARTBEAT_FILE = "ELASTIC_RT_HEARTBEAT_FILE"  # per-worker step heartbeat file
ENV_HEARTBEAT_DIR = "ELASTIC_RT_HEARTBEAT_DIR"  # agent side: <dir>/worker-<LOCAL_RANK>
ENV_RUN_ID = "ELASTIC_RT_RUN_ID"
ENV_NODE_ID = "ELASTIC_RT_NODE_ID"
ENV_ROUND = "ELASTIC_RT_ROUND"  # rendezvous round the worker was started in
ENV_PARENT_PID = "ELASTIC_RT_AGENT_PID"  # the agent's pid, for the death signal check
ENV_CHECKPOINT_URL = "ELASTIC_RT_CHECKPOINT_URL"
ENV_STACK_SIGNAL = "ELASTIC_RT_STACK_SIGNAL"  # faulthandler dumps stacks on this signal (0: off)
ENV_FLIGHT_RECORDER = "ELASTIC_RT_FLIGHT_RECORDER"  # 1: serve flight recorder dump requests
ENV_NO_PROGRESS_HOOK = "ELASTIC_RT_NO_PROGRESS_HOOK"  # 1: optimizer steps do not count as progress
ENV_NO_COMPUTE_TIMER = "ELASTIC_RT_NO_COMPUTE_TIMER"  # 1: backward() is not timed (stragglers off)

# torchrun's launch-time part of the worker contract (torch/distributed/run.py, launcher/api.py),
# decided once per launch by elastic_rt.launch_config.worker_env_defaults. The per-worker part (RANK,
# LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, ...)
# comes from torch's LocalElasticAgent, which elastic-rt's agent extends.
ENV_OMP_NUM_THREADS = "OMP_NUM_THREADS"  # "1" when several workers share a node and the user set none
ENV_SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # the signals the agent handles and forwards
DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's --signals-to-handle default
# torchrun's warning, word for word, logged once per launch when OMP_NUM_THREADS is defaulted
OMP_DEFAULT_WARNING = (
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your "
    "system being overloaded, please further tune the variable for optimal performance in your "
    "application as needed."
)
ENV_HOST_CACHE_DIR = "ELASTIC_RT_HOST_CACHE_DIR"  # the node's checkpoint copy in shared memory
ENV_HOST_CACHE_RESERVE = "ELASTIC_RT_HOST_CACHE_RESERVE_BYTES"  # shared memory the copy leaves free (host_cache.py)
# seconds a new checkpoint writer waits for another job's writer lease on its URL (the k8s recipe sets it)
ENV_CHECKPOINT_WRITER_WAIT_S = "ELASTIC_RT_CHECKPOINT_WRITER_WAIT_S"


@dataclass(frozen=True, kw_only=True)
class WorkerEnvironment:
    """What a worker process learns from its agent through the environment."""

    heartbeat_file: str | None = None
    run_id: str | None = None
    node_id: str | None = None
    round: int | None = None
    agent_pid: int | None = None
    checkpoint_url: str | None = None
    checkpoint_writer_wait_s: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "WorkerEnvironment":
        env = os.environ if env is None else env
        rnd = env.get(ENV_ROUND)
        pid = env.get(ENV_PARENT_PID)
        return cls(
            heartbeat_file=env.get(ENV_HEARTBEAT_FILE) or None,
            run_id=env.get(ENV_RUN_ID) or None,
            node_id=env.get(ENV_NODE_ID) or None,
            round=int(rnd) if rnd and rnd.isdigit() else None,
            agent_pid=int(pid) if pid and pid.isdigit() else None,
            checkpoint_url=env.get(ENV_CHECKPOINT_URL) or None,
            checkpoint_writer_wait_s=_seconds(env.get(ENV_CHECKPOINT_WRITER_WAIT_S)),
        )


def _seconds(text: str | None) -> float | None:
    try:
        value = float(text) if text else None
    except ValueError:
        return None
    return value if value is not None and value >= 0 else None
