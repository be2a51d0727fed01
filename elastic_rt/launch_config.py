"""`elastic-rt launch`'s flags: their grammar (add_launch_arguments) and their validation into an AgentConfig; the only
place that reads launch flags."""

from __future__ import annotations

import argparse
import os
import re
import signal
import uuid
from dataclasses import dataclass
from typing import Mapping

from elastic_rt import sections
from elastic_rt import torchrun_compat as torchrun
from elastic_rt.agent.config import DEFAULT_METRICS_HOST, DEFAULT_METRICS_PORT, AgentConfig
from elastic_rt.agent.crash_loop import CrashLoopSettings
from elastic_rt.diagnostics.failure_diagnostics import DiagnosticsSettings
from elastic_rt.agent.host_memory import HostMemorySettings
from elastic_rt.agent.warm import WarmSettings
from elastic_rt.collectors.schedule import CollectorSettings
from elastic_rt.doctor.preflight import PreflightSettings
from elastic_rt.errors import ConfigError
from elastic_rt.goodput.stragglers import StragglerSettings
from elastic_rt.rendezvous import conf as rdzv_conf
from elastic_rt.rendezvous.keys import validate_run_id
from elastic_rt.worker_env import DEFAULT_SIGNALS_TO_HANDLE, ENV_OMP_NUM_THREADS, ENV_SIGNALS_TO_HANDLE

KNOWN_BACKENDS = ("etcd-v3", "etcd-v3-torch", "c10d", "static")
# Each feature's config section, in the order their flags show in `launch --help` and README's table. A flag is
# added in its section's module; a new section is added here.
SECTIONS: tuple[type, ...] = (DiagnosticsSettings, CollectorSettings, StragglerSettings, PreflightSettings,
                              CrashLoopSettings, WarmSettings, HostMemorySettings)


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """Every `launch` flag: the launcher's own, then each config section's, then torchrun's, then the script."""
    p.add_argument("--nnodes", default=None, help="N or MIN:MAX nodes (default 1:1, one node)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                   help="workers per node: a number, or as torchrun: auto (one per accelerator, else per CPU), "
                        "cpu, gpu, xpu (default 1)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default=None,
                   help=f"rendezvous backend: {', '.join(KNOWN_BACKENDS)} (default etcd-v3; static when "
                        "--node-rank, --master-addr or --master-port is given without --rdzv-endpoint)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="etcd endpoints host:port[,host:port...], every member: each agent starts at the one its "
                        "node id picks (--rdzv-conf endpoint_order) and fails over to the next ones in the list")
    p.add_argument("--rdzv-id", "--rdzv_id", default="none", help="job id, the same on every node")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="k=v,... : timeouts, TLS files, user and password_file, secret_file, ... (the "
                        "--rdzv-conf table below; unknown keys of the etcd backends are refused)")
    p.add_argument("--standalone", action="store_true",
                   help="one node, no external service (an embedded store)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=3,
                   help="restarts after this node's own worker failures (default 3); "
                        "membership changes do not count")
    p.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1,
                   help="seconds between worker checks (default 0.1)")
    p.add_argument("--local-addr", "--local_addr", default=None,
                   help="address of this node that peers can reach (default: the host's FQDN)")
    p.add_argument("--node-id", default=None, help="unique name of this node (default: hostname-pid)")
    p.add_argument("--log-dir", "--log_dir", default=None, help="directory for per-worker logs")
    p.add_argument("--tee", "-t", default="0", help="tee worker stdout/stderr to the console: 0-3")
    p.add_argument("--redirects", "-r", default="0", help="redirect worker stdout/stderr to log files: 0-3")
    p.add_argument("--grace-period", type=float, default=None,
                   help="seconds workers get after SIGTERM (preemption, shutdown) before SIGKILL (default "
                        "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30; torchrun's --shutdown-timeout)")
    p.add_argument("--restart-grace", type=float, default=1.0,
                   help="seconds workers get after SIGTERM when the group restarts (default 1)")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help=f"port of Prometheus /metrics and the /livez, /readyz health endpoints "
                        f"(default {DEFAULT_METRICS_PORT}; 0 = off)")
    p.add_argument("--metrics-host", default=DEFAULT_METRICS_HOST,
                   help=f"address the metrics and health server binds (default {DEFAULT_METRICS_HOST}: every "
                        "IPv4 interface, which Prometheus and kubelet probes in Kubernetes need since they reach "
                        "the pod IP; 127.0.0.1 keeps it on the node; :: for IPv6 and IPv4)")
    p.add_argument("--checkpoint-url", default=None,
                   help="fsspec URL handed to workers as ELASTIC_RT_CHECKPOINT_URL (shared storage for "
                        "several nodes; e.g. file:///mnt/shared/job42, s3://bucket/job42)")
    p.add_argument("--signals-to-handle", "--signals_to_handle", default=DEFAULT_SIGNALS_TO_HANDLE,
                   help="signals the agent handles (stopping the workers) and hands to them as "
                        f"TORCHELASTIC_SIGNALS_TO_HANDLE, as torchrun does (default {DEFAULT_SIGNALS_TO_HANDLE})")
    p.add_argument("--sysfs-root", default="/sys",
                   help="where sysfs is mounted (RDMA ports are read under it; default /sys)")
    for section in SECTIONS:  # each feature's flags, declared by its config section
        sections.add_arguments(p, section)
    torchrun.add_torchrun_arguments(p)
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a Python module (python -m)")
    p.add_argument("--no-python", "--no_python", action="store_true", help="run SCRIPT as an executable")
    p.add_argument("script", nargs="?", default="", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the training script")


def parse_nnodes(text: str) -> tuple[int, int]:
    """'4' -> (4, 4); '2:4' -> (2, 4). MIN >= 1 and MIN <= MAX."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text or "")
    if not m:
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX, e.g. 2:4")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1:
        raise ConfigError(f"--nnodes {text!r}: the minimum number of nodes must be at least 1")
    if lo > hi:
        raise ConfigError(f"--nnodes {text!r}: MIN ({lo}) is larger than MAX ({hi})")
    return lo, hi


def parse_nproc(text: str) -> int:
    """A positive integer, or torchrun's words for a count: auto (accelerators, else CPUs), cpu, gpu, xpu."""
    if text.isdigit():
        if int(text) < 1:
            raise ConfigError(f"--nproc-per-node {text!r}: expected a positive integer, or auto, cpu, gpu, xpu")
        return int(text)
    if not re.fullmatch(r"[a-z][a-z0-9_]*", text):
        raise ConfigError(f"--nproc-per-node {text!r}: expected a positive integer, or auto, cpu, gpu, xpu")
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(text)
    except (ValueError, RuntimeError, AttributeError) as exc:
        raise ConfigError(f"--nproc-per-node {text}: {exc}") from None


def parse_signals(text: str) -> str:
    """'SIGTERM, SIGUSR1' -> 'SIGTERM,SIGUSR1'; every name must be a signal of this platform."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    bad = [n for n in names if not isinstance(getattr(signal, n, None), signal.Signals)]
    if bad or not names:
        raise ConfigError(f"--signals-to-handle {text!r}: {', '.join(bad) or 'empty'} is not a signal name "
                          f"(e.g. {DEFAULT_SIGNALS_TO_HANDLE})")
    return ",".join(names)


def worker_env_defaults(*, nproc_per_node: int, signals_to_handle: str,
                        environ: Mapping[str, str]) -> tuple[tuple[tuple[str, str], ...], bool]:
    """torchrun's launch-time decisions about the workers' environment (torch/distributed/run.py
    and launcher/api.py), made once: the variables to export into the agent's environment, which
    every worker inherits, and whether OMP_NUM_THREADS was defaulted (torchrun then warns once).

    OMP_NUM_THREADS=1 when several workers share the node and the user did not set it (a value
    the user set, even an empty one, is kept); TORCHELASTIC_SIGNALS_TO_HANDLE always.
    """
    env = {ENV_SIGNALS_TO_HANDLE: signals_to_handle}
    defaulted = ENV_OMP_NUM_THREADS not in environ and nproc_per_node > 1
    if defaulted:
        env[ENV_OMP_NUM_THREADS] = "1"
    return tuple(sorted(env.items())), defaulted


def _positive(name: str, value: float, *, zero_ok: bool = False) -> float:
    return sections.positive(name, zero_ok=zero_ok)(value)


@dataclass(frozen=True, kw_only=True)
class RendezvousChoice:
    """Which rendezvous the flags select, and the lines that explain flags it leaves unused."""

    min_nodes: int
    max_nodes: int
    backend: str
    endpoint: str
    run_id: str
    node_rank: int = 0
    notes: tuple[str, ...] = ()


def choose_rendezvous(args: argparse.Namespace) -> RendezvousChoice:
    """--standalone, etcd-v3 (the default), torch's backends, or torchrun's static rendezvous: chosen by
    --rdzv-backend, or without it by --node-rank/--master-addr/--master-port (torchrun's default)."""
    static_flags = [flag for flag, value in (("--node-rank", args.node_rank), ("--master-addr", args.master_addr),
                                             ("--master-port", args.master_port)) if value is not None]
    notes: list[str] = []
    if args.standalone:
        if args.nnodes not in (None, "1", "1:1"):
            raise ConfigError("--standalone runs one node; drop --nnodes or use --nnodes 1")
        if static_flags:
            notes.append(f"{', '.join(static_flags)}: not used with --standalone (one node, an embedded store), "
                         "as under torchrun")
        run_id = args.rdzv_id if args.rdzv_id not in (None, "none") else f"standalone-{uuid.uuid4().hex[:8]}"
        return RendezvousChoice(min_nodes=1, max_nodes=1, backend="c10d", endpoint="localhost:0", run_id=run_id,
                                notes=tuple(notes))
    min_nodes, max_nodes = parse_nnodes(args.nnodes or "1")
    endpoint = args.rdzv_endpoint or ""
    backend = args.rdzv_backend
    if backend is None:
        backend = "static" if static_flags and not endpoint else "etcd-v3"
        if backend == "static":
            notes.append(f"{', '.join(static_flags)} without --rdzv-backend: torchrun's static rendezvous (fixed "
                         "nodes and ranks: a lost node is not replaced; --rdzv-backend etcd-v3 re-forms without it)")
    if backend not in KNOWN_BACKENDS:
        raise ConfigError(f"--rdzv-backend {backend!r}: unknown; choose one of {', '.join(KNOWN_BACKENDS)}")
    node_rank = 0
    if backend == "static" and (endpoint or args.master_port is not None or max_nodes > 1):
        if min_nodes != max_nodes:
            raise ConfigError(f"--rdzv-backend static with --nnodes {args.nnodes}: static membership is fixed; "
                              "give one number of nodes, or use etcd-v3 for MIN:MAX")
        node_rank = args.node_rank or 0
        if not 0 <= node_rank < max_nodes:
            raise ConfigError(f"--node-rank {node_rank}: must be between 0 and {max_nodes - 1} (--nnodes {max_nodes})")
        endpoint = endpoint or (f"{args.master_addr or torchrun.DEFAULT_MASTER_ADDR}:"
                                f"{args.master_port or torchrun.DEFAULT_MASTER_PORT}")
        run_id = args.rdzv_id or "none"  # the same default on every node, as torchrun's
        return RendezvousChoice(min_nodes=min_nodes, max_nodes=max_nodes, backend=backend, endpoint=endpoint,
                                run_id=run_id, node_rank=node_rank, notes=tuple(notes))
    if static_flags and backend != "static":
        notes.append(f"{', '.join(static_flags)}: used by the static rendezvous only; not used with --rdzv-backend "
                     f"{backend}, where the rendezvous assigns the ranks")
    if not endpoint:
        if max_nodes > 1:
            raise ConfigError(
                "--rdzv-endpoint is required for several nodes (etcd host:port[,host:port]); for one node "
                "without etcd use --standalone; for torchrun's static rendezvous give --master-addr/--master-port"
            )
        # one node and no service given (torchrun's static default does the same): behave like --standalone
        backend, endpoint = "c10d", "localhost:0"
    run_id = args.rdzv_id or "none"
    if run_id == "none":
        if max_nodes > 1:
            raise ConfigError("--rdzv-id is required for several nodes: every node of a job must use the same id")
        run_id = f"single-{uuid.uuid4().hex[:8]}"
    return RendezvousChoice(min_nodes=min_nodes, max_nodes=max_nodes, backend=backend, endpoint=endpoint,
                            run_id=run_id, notes=tuple(notes))


def launch_config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Validate parsed `launch` arguments into an AgentConfig (raises ConfigError); `environ`
    (default os.environ) is the environment the workers would inherit."""
    environ = os.environ if environ is None else environ
    conf = rdzv_conf.parse_rdzv_conf(args.rdzv_conf)
    rdzv = choose_rendezvous(args)
    run_id = rdzv.run_id
    validate_run_id(run_id)
    conf = rdzv_conf.canonical(conf)
    rdzv_conf.check_keys(rdzv.backend, conf)
    if args.node_id:
        conf["node_id"] = args.node_id
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: must be >= 0")
    if not 0 <= args.metrics_port < 65536:
        raise ConfigError(f"--metrics-port {args.metrics_port}: must be 0 (off) or a TCP port")
    if args.tee not in ("0", "1", "2", "3") and not re.fullmatch(r"(\d+:[0-3],?)+", args.tee):
        raise ConfigError(f"--tee {args.tee!r}: expected 0-3 (none, stdout, stderr, both) or local_rank:N,...")
    features = tuple(sections.from_args(section, args) for section in SECTIONS)
    if not args.script:
        raise ConfigError("no training script given: elastic-rt launch [options] SCRIPT [ARGS...]")
    nproc_per_node = parse_nproc(str(args.nproc_per_node))
    worker_env, omp_defaulted = worker_env_defaults(
        nproc_per_node=nproc_per_node, signals_to_handle=parse_signals(args.signals_to_handle), environ=environ)
    if args.virtual_local_rank:
        torchrun.check_virtual_local_rank(nproc_per_node, environ)
    torchrun.logs_specs_class(args.logs_specs)  # fails here, in one line, when it cannot be loaded
    return AgentConfig(
        min_nodes=rdzv.min_nodes,
        max_nodes=rdzv.max_nodes,
        nproc_per_node=nproc_per_node,
        rdzv_backend=rdzv.backend,
        rdzv_endpoint=rdzv.endpoint,
        rdzv_id=run_id,
        node_rank=rdzv.node_rank,
        rdzv_conf=tuple(sorted(conf.items())),
        standalone=bool(args.standalone),
        max_restarts=args.max_restarts,
        monitor_interval_s=_positive("--monitor-interval", args.monitor_interval),
        local_addr=args.local_addr,
        node_id=args.node_id,
        log_dir=args.log_dir,
        tee=args.tee,
        redirects=args.redirects,
        grace_period_s=torchrun.grace_period_s(args.grace_period, args.shutdown_timeout, environ),
        restart_grace_s=_positive("--restart-grace", args.restart_grace, zero_ok=True),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        checkpoint_url=args.checkpoint_url,
        sysfs_root=args.sysfs_root,
        worker_env=worker_env,
        omp_threads_defaulted=omp_defaulted,
        run_as_module=bool(args.module) and not args.run_path,
        no_python=bool(args.no_python) and not args.run_path,
        script=args.script,
        script_args=tuple(args.script_args),
        role=args.role,
        event_log_handler=torchrun.check_event_log_handler(args.event_log_handler),
        logs_specs=args.logs_specs,
        local_ranks_filter=torchrun.parse_local_ranks_filter(args.local_ranks_filter),
        duplicate_stdout_filters=tuple(args.duplicate_stdout_filters),
        duplicate_stderr_filters=tuple(args.duplicate_stderr_filters),
        numa_binding=args.numa_binding,
        virtual_local_rank=bool(args.virtual_local_rank),
        notes=rdzv.notes + _torchrun_notes(args),
        sections=features,
    )


def _torchrun_notes(args: argparse.Namespace) -> tuple[str, ...]:
    """One line for each torchrun flag given whose meaning differs under elastic-rt (logged at start)."""
    notes = []
    if args.start_method is not None:
        notes.append(f"--start-method {args.start_method}: workers are new processes started by the agent (warm "
                     "ones ahead of time), as torchrun starts a script; a start method applies to in-process "
                     "functions only, so it changes nothing here")
    if args.run_path and (args.module or args.no_python):
        notes.append(f"--run-path: SCRIPT runs with runpy.run_path; {'-m' if args.module else '--no-python'} is "
                     "not used, as under torchrun")
    return tuple(notes)
