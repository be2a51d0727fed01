"""Command line: argparse -> config -> run. Errors the user caused print one line and exit non-zero."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Mapping

from elastic_rt import __version__, torchrun_compat
from elastic_rt.agent.config import DEFAULT_METRICS_HOST, DEFAULT_METRICS_PORT, DEFAULT_WARM_IMPORTS
from elastic_rt.agent.stacks import DEFAULT_STACK_SIGNAL
from elastic_rt.config import KNOWN_BACKENDS
from elastic_rt.decisions import DetectionAction
from elastic_rt.errors import ElasticRTError
from elastic_rt.worker_env import DEFAULT_SIGNALS_TO_HANDLE

DETECTION_ACTIONS = tuple(a.value for a in DetectionAction)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", default=None, help="N or MIN:MAX nodes (default 1:1, one node)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                   help="workers per node: a number, or as torchrun: auto (one per accelerator, else per CPU), "
                        "cpu, gpu, xpu (default 1)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default=None,
                   help=f"rendezvous backend: {', '.join(KNOWN_BACKENDS)} (default etcd-v3; static when "
                        "--node-rank, --master-addr or --master-port is given without --rdzv-endpoint)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="etcd endpoints host:port[,host:port...]; tried in order, failing over")
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
    p.add_argument("--hang-timeout", default="auto",
                   help="restart the group when a worker makes no optimizer step (or report_step) for this many "
                        "seconds; auto (default): max(300 s, 20 x median step, 2 x longest pause), once a first "
                        "step was seen; 0 = off (docs/failures.md)")
    p.add_argument("--stack-signal", default=DEFAULT_STACK_SIGNAL,
                   help=f"signal on which workers dump their Python stacks for the agent (default {DEFAULT_STACK_SIGNAL}; "
                        "off = no stack dumps)")
    p.add_argument("--flight-recorder", default="auto", choices=("auto", "on", "off"),
                   help="torch's collective flight recorder in workers, dumped on hangs and timeouts: "
                        "auto (default: on with CUDA), on, off")
    p.add_argument("--ntp-server", action="append", default=[], help="NTP server to measure offset against "
                   "(repeatable)")
    p.add_argument("--checkpoint-url", default=None,
                   help="fsspec URL handed to workers as ELASTIC_RT_CHECKPOINT_URL (shared storage for "
                        "several nodes; e.g. file:///mnt/shared/job42, s3://bucket/job42)")
    p.add_argument("--probe-bytes", type=int, default=4 << 20,
                   help="size of the all-reduce probe run across the nodes after every rendezvous "
                        "(default 4 MiB; 0 = off)")
    p.add_argument("--probe-timeout", type=float, default=30.0, help="seconds before the probe counts as failed")
    p.add_argument("--probe-backend", default="auto", help="auto (nccl with CUDA, else gloo), gloo or nccl")
    p.add_argument("--probe-interval", type=float, default=0.0,
                   help="also probe every this many seconds while the round lasts (default 0 = after rendezvous only)")
    p.add_argument("--probe-failure-action", default=DetectionAction.REPORT.value, choices=DETECTION_ACTIONS,
                   help="report: fail the /readyz check `probe` and count it; leave: also stop this node's "
                        "workers and leave the job so the others re-form without it (default report)")
    p.add_argument("--straggler-threshold", type=float, default=1.5,
                   help="flag a worker whose median step time is this many times the job's median (default 1.5; "
                        "0 = off)")
    p.add_argument("--straggler-windows", type=int, default=3,
                   help="windows in a row over the threshold before a worker is flagged (default 3)")
    p.add_argument("--straggler-window", type=float, default=10.0,
                   help="seconds per step-timing window; also how often nodes exchange step times (default 10)")
    p.add_argument("--straggler-action", default=DetectionAction.REPORT.value, choices=DETECTION_ACTIONS,
                   help="report: log, count and export elastic_rt_straggler; leave: also stop this node's workers "
                        "and leave the job so the others re-form without it (default report)")
    p.add_argument("--preflight", default="auto", choices=("auto", "off", "report", "exclude"),
                   help="before the first round: a matmul per local device, then a ring link test across the round; "
                        "report: name nodes beyond --preflight-threshold x the job median; exclude: they also leave "
                        "before training (exit 4); auto (default): report with CUDA, else off (docs/goodput.md)")
    p.add_argument("--preflight-threshold", type=float, default=1.5,
                   help="times the job median matmul or link time that names a node (default 1.5)")
    p.add_argument("--preflight-timeout", type=float, default=60.0,
                   help="seconds the pre-flight test may take in all; past them the job trains without it (default 60)")
    p.add_argument("--preflight-rounds", default="first", choices=("first", "all"),
                   help="test at the first round only (default), or at every re-formation too")
    p.add_argument("--crash-loop-repeats", type=int, default=3,
                   help="end the job (exit 3: do not requeue) when a worker failure repeats this many times in a row: "
                        "the same failure at the same step, or with no checkpoint committed in between "
                        "(default 3; 0 = off; docs/failures.md)")
    p.add_argument("--crash-loop-no-step", type=int, default=5,
                   help="end the job (exit 3) after this many failures in a row with no step made in between "
                        "(default 5; 0 = off)")
    p.add_argument("--signals-to-handle", "--signals_to_handle", default=DEFAULT_SIGNALS_TO_HANDLE,
                   help="signals the agent handles (stopping the workers) and hands to them as "
                        f"TORCHELASTIC_SIGNALS_TO_HANDLE, as torchrun does (default {DEFAULT_SIGNALS_TO_HANDLE})")
    p.add_argument("--sysfs-root", default="/sys",
                   help="where sysfs is mounted (RDMA ports are read under it; default /sys)")
    p.add_argument("--warm-workers", default="on", choices=("on", "off"),
                   help="keep a pre-started worker per local rank (torch imported, waiting for its rank) so "
                        "that a restart skips the interpreter start and imports (default on)")
    p.add_argument("--warm-imports", default=",".join(DEFAULT_WARM_IMPORTS),
                   help="modules a warm worker imports ahead (comma-separated; library modules only: they run "
                        "before the worker knows its rank)")
    p.add_argument("--host-cache", default="on", choices=("on", "off"),
                   help="keep the last checkpoint's files of this node's workers in shared memory "
                        "(/dev/shm/elastic-rt-RUN-NODE/, removed at exit) so that a restart here loads "
                        "from memory; storage stays the truth (default on)")
    p.add_argument("--memory-tier-replica-gib", type=float, default=None,
                   help="the most GiB of peers' snapshot replicas this node holds in shared memory "
                        "(CheckpointManager memory_every; docs/checkpoint.md 'Tiers'; default: a quarter of /dev/shm)")
    torchrun_compat.add_torchrun_arguments(p)
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a Python module (python -m)")
    p.add_argument("--no-python", "--no_python", action="store_true", help="run SCRIPT as an executable")
    p.add_argument("script", nargs="?", default="", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the training script")


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; `launch` flags that torchrun reads from PET_* variables default to them
    (`environ`, default os.environ). Raises ConfigError for a PET_* value the flag would refuse."""
    parser = _Parser(prog="elastic-rt", description="Elastic, fault-tolerant launcher for PyTorch training.")
    parser.add_argument("--version", action="version", version=f"elastic-rt {__version__}")
    parser.add_argument("--log-level", default="INFO", help="agent log level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    launch = sub.add_parser("launch", help="run a training script on this node")
    add_launch_arguments(launch)
    torchrun_compat.apply_env_defaults(launch, os.environ if environ is None else environ)
    from elastic_rt.chaos import cli as chaos_cli
    from elastic_rt.checkpoint import cli as ckpt_cli
    from elastic_rt.doctor import command as doctor
    from elastic_rt.rendezvous import gc as gc_cmd
    from elastic_rt.report import command as report_cmd
    from elastic_rt.status import command as status_cmd

    ckpt_cli.add_subparser(sub)
    doctor.add_subparser(sub)
    chaos_cli.add_subparser(sub)
    report_cmd.add_subparser(sub)
    status_cmd.add_subparser(sub)
    gc_cmd.add_subparser(sub)
    return parser


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s elastic-rt: %(message)s",
        stream=sys.stderr,
    )
    # torch's agent logs multi-line banners at INFO; keep ours readable.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ElasticRTError as exc:
        print(f"elastic-rt: error: {exc}", file=sys.stderr)
        return exc.exit_code
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    setup_logging(args.log_level)
    try:
        if args.command == "launch":
            from elastic_rt.agent.launcher import launch
            from elastic_rt.config import launch_config_from_args

            return launch(launch_config_from_args(args))
        return int(args.func(args))
    except ElasticRTError as exc:
        print(f"elastic-rt {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"elastic-rt {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a signal that arrived while shutting down: no traceback
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if isinstance(exc, SignalException):
            print(f"elastic-rt {args.command}: stopped by {exc.sigval.name}", file=sys.stderr)
            return 128 + int(exc.sigval)
        raise


if __name__ == "__main__":
    sys.exit(main())
