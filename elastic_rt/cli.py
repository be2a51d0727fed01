"""Command line: argparse -> config -> run. Errors the user caused print one line and exit non-zero."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Mapping

from elastic_rt import __version__, sections, torchrun_compat
from elastic_rt.agent.config import DEFAULT_METRICS_HOST, DEFAULT_METRICS_PORT
from elastic_rt.config import KNOWN_BACKENDS, SECTIONS
from elastic_rt.errors import ElasticRTError
from elastic_rt.worker_env import DEFAULT_SIGNALS_TO_HANDLE


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
            from elastic_rt.launch import launch
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
