"""torchrun's flags under elastic-rt: the ones kept for compatibility, PET_* defaults, torchrun's value rules."""

from __future__ import annotations

import argparse
from importlib import metadata
from typing import Mapping

from elastic_rt.errors import ConfigError

# Flags torchrun takes from PET_<DEST> when the command line does not give them (torch's `env` action)...
ENV_DESTS = frozenset({
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts",
    "monitor_interval", "start_method", "event_log_handler", "role", "log_dir", "redirects", "tee",
    "local_ranks_filter", "duplicate_stdout_filters", "duplicate_stderr_filters", "node_rank", "master_addr",
    "master_port", "local_addr", "signals_to_handle", "shutdown_timeout",
})
# ...and its switches, on when PET_<DEST> is a non-zero integer (torch's `check_env` action: PET_STANDALONE=1).
SWITCH_DESTS = frozenset({"standalone", "module", "no_python", "run_path", "virtual_local_rank"})

START_METHODS = ("spawn", "fork", "forkserver")
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")  # torch.numa.binding.AffinityMode
LOGS_SPECS_GROUP = "torchrun.logs_specs"
ENV_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_GRACE_PERIOD_S = 30.0
STATIC_RDZV_TIMEOUT_S = 900  # what torchrun's LaunchConfig gives the static handler

# Flags whose parser default is None so that the launch can tell "not given" from the default; the value
# they stand for is shown in the flags table (tests/support/cli_docs.py).
SHOWN_DEFAULTS = {
    "nnodes": "1:1",
    "rdzv_backend": "etcd-v3",
    "grace_period": DEFAULT_GRACE_PERIOD_S,
    "start_method": "spawn",
    "node_rank": 0,
    "master_addr": DEFAULT_MASTER_ADDR,
}


def comma_separated_list(value: str) -> list[str]:
    """torchrun's filter lists: 'a,b' -> ['a', 'b']; ',,' stands for a comma inside an item."""
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


def add_torchrun_arguments(p: argparse.ArgumentParser) -> None:
    """The torchrun flags that only compatibility needs (the others are elastic-rt's own as well)."""
    p.add_argument("--role", default="default", help="name of this node's workers: ROLE_NAME in their environment "
                   "and the prefix of their console lines under --tee (torchrun's --role)")
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", default="",
                   help="show only these local ranks' output on the console, e.g. 0 or 0,1 (their log files are "
                        "complete); as torchrun")
    p.add_argument("--duplicate-stdout-filters", "--duplicate_stdout_filters", type=comma_separated_list,
                   default=[], help="also copy the console's stdout lines (from --tee) that contain any of these "
                   "strings (comma-separated; ,, for a comma) to filtered_stdout.log in the attempt's log "
                   "directory; as torchrun")
    p.add_argument("--duplicate-stderr-filters", "--duplicate_stderr_filters", type=comma_separated_list,
                   default=[], help="the same for stderr, into filtered_stderr.log")
    p.add_argument("--logs-specs", "--logs_specs", default=None,
                   help=f"name of a LogsSpecs class registered in the {LOGS_SPECS_GROUP} entry point group: "
                        "where worker logs go (default: torch's DefaultLogsSpecs); as torchrun")
    p.add_argument("--event-log-handler", "--event_log_handler", default="null",
                   help="torch's elastic event handler that receives the agent's and workers' events: null, "
                        "console (JSON lines on stderr) or dynamic_rendezvous; as torchrun")
    p.add_argument("--start-method", "--start_method", default=None, choices=START_METHODS,
                   help="accepted for torchrun's command lines; workers are always new processes started by the "
                        "agent (warm ones ahead of time), which is what torchrun does for a script too: its start "
                        "method applies only to functions started in-process (docs/torchrun.md)")
    p.add_argument("--run-path", "--run_path", action="store_true",
                   help="run SCRIPT with runpy.run_path (ignoring -m and --no-python), as torchrun; every "
                        "elastic-rt worker runs its script that way, in an interpreter of its own")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None,
                   help="rank of this node, with --rdzv-backend static only (default 0)")
    p.add_argument("--master-addr", "--master_addr", default=None,
                   help=f"address of node rank 0 with --rdzv-backend static (default {DEFAULT_MASTER_ADDR}); "
                        "--node-rank, --master-addr or --master-port without --rdzv-backend and --rdzv-endpoint "
                        "select static, torchrun's default backend")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help=f"port of node rank 0's store with --rdzv-backend static (default {DEFAULT_MASTER_PORT})")
    p.add_argument("--numa-binding", "--numa_binding", default=None, choices=NUMA_MODES,
                   help="bind each worker to the CPUs near the GPU of its local rank with torch's binding "
                        "(torch/numa/binding.py: node, socket, exclusive, core-complex), warm workers included; "
                        "needs CUDA and numactl")
    p.add_argument("--shutdown-timeout", "--shutdown_timeout", type=float, default=None,
                   help=f"torchrun's name for --grace-period (give one); when neither is given, "
                        f"${ENV_SHUTDOWN_TIMEOUT}, else {DEFAULT_GRACE_PERIOD_S:g}")
    p.add_argument("--virtual-local-rank", "--virtual_local_rank", action="store_true",
                   help="each worker sees only its own GPU: LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES set to the "
                        "device of its local rank; as torchrun")


def _flag(action: argparse.Action) -> str:
    return next((o for o in action.option_strings if o.startswith("--") and "_" not in o), action.option_strings[0])


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Make PET_<DEST> the default of each flag that torchrun reads from it, converted and checked as the
    flag's own value would be (torchrun's `env` and `check_env` actions)."""
    for action in parser._actions:
        name = f"PET_{action.dest.upper()}"
        if name not in environ or not action.option_strings:
            continue
        text = environ[name]
        if action.dest in SWITCH_DESTS:
            try:
                action.default = bool(int(text))
            except ValueError:
                raise ConfigError(f"{name}={text!r}: expected 0 or 1 (it stands for {_flag(action)})") from None
        elif action.dest in ENV_DESTS:
            try:
                value = action.type(text) if callable(action.type) else text
            except (TypeError, ValueError):
                raise ConfigError(f"{name}={text!r}: not a valid value for {_flag(action)}") from None
            if action.choices is not None and value not in action.choices:
                raise ConfigError(f"{name}={text!r}: {_flag(action)} takes one of {', '.join(action.choices)}")
            action.default = value


def parse_local_ranks_filter(text: str) -> tuple[int, ...]:
    """'0,2' -> (0, 2); '' -> () (every rank shows)."""
    if not (text or "").strip():
        return ()
    try:
        ranks = sorted({int(r) for r in text.split(",")})
    except ValueError:
        raise ConfigError(f"--local-ranks-filter {text!r}: expected local ranks separated by commas, "
                          "e.g. 0 or 0,1,2") from None
    if ranks[0] < 0:
        raise ConfigError(f"--local-ranks-filter {text!r}: local ranks are >= 0")
    return tuple(ranks)


def logs_specs_class(name: str | None) -> type:
    """The LogsSpecs class `name` registers in the torchrun.logs_specs group (torch's DefaultLogsSpecs for None)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsSpecs

    if name is None:
        return DefaultLogsSpecs
    found = metadata.entry_points(group=LOGS_SPECS_GROUP).select(name=name)
    if not found:
        known = sorted(ep.name for ep in metadata.entry_points(group=LOGS_SPECS_GROUP))
        raise ConfigError(f"--logs-specs {name!r}: no entry point of that name in the {LOGS_SPECS_GROUP} group "
                          f"(installed: {', '.join(known) or 'none'})")
    entry = next(iter(found))
    try:
        cls = entry.load()
    except Exception as exc:  # the user's package failed to import: say which and why
        raise ConfigError(f"--logs-specs {name!r}: loading {entry.value} failed: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, LogsSpecs)):
        raise ConfigError(f"--logs-specs {name!r}: {entry.value} is not a subclass of torch's LogsSpecs")
    return cls


def check_event_log_handler(name: str) -> str:
    """The name of one of torch's registered event handlers (torch.distributed.elastic.events.handlers)."""
    from torch.distributed.elastic.events import handlers

    try:
        handlers.get_logging_handler(name)
    except KeyError:
        known = ", ".join(sorted(getattr(handlers, "_log_handlers", {}))) or "null, console"
        raise ConfigError(f"--event-log-handler {name!r}: not one of torch's event handlers ({known})") from None
    return name


def check_virtual_local_rank(nproc_per_node: int, environ: Mapping[str, str]) -> None:
    """Each local rank needs a device of its own in CUDA_VISIBLE_DEVICES, when that is set."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and nproc_per_node > len(visible.split(",")):
        raise ConfigError(f"--virtual-local-rank with {nproc_per_node} workers per node: "
                          f"CUDA_VISIBLE_DEVICES={visible!r} names fewer devices; each local rank needs one")


def virtual_local_rank_env(local_rank: int, environ: Mapping[str, str]) -> dict[str, str]:
    """What torch's agent sets for a worker under --virtual-local-rank, apart from LOCAL_RANK=0: its one
    device, the local_rank-th of CUDA_VISIBLE_DEVICES when that is set, else the device of that index."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    device = visible.split(",")[local_rank].strip() if visible is not None else str(local_rank)
    return {"CUDA_VISIBLE_DEVICES": device}


def grace_period_s(grace: float | None, shutdown_timeout: float | None, environ: Mapping[str, str]) -> float:
    """--grace-period, or torchrun's --shutdown-timeout (the same setting), else $TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
    else 30 s."""
    if grace is not None and shutdown_timeout is not None and grace != shutdown_timeout:
        raise ConfigError(f"--grace-period {grace:g} and --shutdown-timeout {shutdown_timeout:g} are the same "
                          "setting (seconds workers get after SIGTERM before SIGKILL); give one")
    value = grace if grace is not None else shutdown_timeout
    if value is None and ENV_SHUTDOWN_TIMEOUT in environ:
        text = environ[ENV_SHUTDOWN_TIMEOUT]
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{ENV_SHUTDOWN_TIMEOUT}={text!r}: expected a number of seconds") from None
    value = DEFAULT_GRACE_PERIOD_S if value is None else value
    if value < 0:
        raise ConfigError(f"--grace-period {value:g}: must be >= 0")
    return value
