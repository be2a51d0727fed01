"""Command line: argparse -> config -> run. Errors the user caused print one line and exit non-zero."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Mapping, NoReturn

from elastic_rt import __version__, torchrun_compat
from elastic_rt.errors import ElasticRTError
from elastic_rt.launch_config import add_launch_arguments


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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


def end_process(code: int) -> NoReturn:
    """End an agent's process with `code` without finalizing the interpreter. torch's threads may still be
    inside a TCPStore call when the agent returns (the c10d rendezvous keep-alive timer is a daemon thread);
    finalizing destroys the store under them and the C++ runtime aborts ("terminate called without an active
    exception", exit -6 instead of the agent's code: seen on the crash-loop verdict's exit 3). Logs and the
    standard streams are flushed first; nothing else of the agent's runs at interpreter exit."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: the exit code still stands
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """The `elastic-rt` command. `launch` ends its process here (end_process); other commands return their
    exit code."""
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
    if args.command != "launch":
        return _reported(args.command, lambda: int(args.func(args)))
    started = []

    def run_agent() -> int:
        from elastic_rt.launch_config import launch_config_from_args

        config = launch_config_from_args(args)  # a bad flag is one line before torch is imported
        from elastic_rt.launch import launch

        started.append(True)
        return launch(config)

    code = _reported("launch", run_agent)
    if started:
        end_process(code)
    return code


def _reported(command: str, run: Callable[[], int]) -> int:
    """`run`'s exit code; an error the user caused, an interrupt or a stop signal is one line."""
    try:
        return run()
    except ElasticRTError as exc:
        print(f"elastic-rt {command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"elastic-rt {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a signal that arrived while shutting down: no traceback
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if isinstance(exc, SignalException):
            print(f"elastic-rt {command}: stopped by {exc.sigval.name}", file=sys.stderr)
            return 128 + int(exc.sigval)
        raise


if __name__ == "__main__":
    sys.exit(main())
