"""`elastic-rt chaos ACTION --run-id RUN`: operators' fault drills against a live run, one JSON line per fault."""

from __future__ import annotations

import argparse
import random
import signal
import threading
from typing import Any, Callable

from elastic_rt.chaos.cut import MODES, CutPlan, run_cut_etcd
from elastic_rt.chaos.injectors import Drill, printer
from elastic_rt.chaos.processes import RunProcesses, find_run
from elastic_rt.errors import ConfigError

ACTIONS = ("kill-worker", "kill-node", "pause-worker", "pause-node", "pause-etcd", "cut-etcd")


def _hostport(text: str) -> tuple[str, int]:
    from elastic_rt.rendezvous.registration import parse_endpoints

    try:
        (endpoint,) = parse_endpoints(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one host:port") from exc
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return endpoint


def _signal_name(text: str) -> int:
    name = text.upper() if text.upper().startswith("SIG") else "SIG" + text.upper()
    try:
        return int(signal.Signals[name])
    except KeyError as exc:
        raise argparse.ArgumentTypeError(f"unknown signal {text!r} (e.g. KILL, TERM, INT)") from exc


def _pids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PID[,PID...]") from exc


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `chaos` and its actions on the top-level parser's subparsers."""
    parser = subparsers.add_parser("chaos", help="fault drills against a live run (kill, pause, cut etcd)")
    actions = parser.add_subparsers(dest="chaos_action", metavar="{" + ",".join(ACTIONS) + "}")
    actions.required = True

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=help_text)
        p.add_argument("--run-id", required=True, help="the run (--rdzv-id) whose processes may be touched")
        p.add_argument("--seed", type=int, default=None, help="seed of the random choice of target")
        return p

    def worker_select(p: argparse.ArgumentParser) -> None:
        p.add_argument("--pid", type=int, default=None, help="this worker (refused unless it is one of the run)")
        p.add_argument("--rank", type=int, default=None, help="the worker of this global RANK")
        p.add_argument("--node", default=None, help="a worker of this node id")

    def node_select(p: argparse.ArgumentParser) -> None:
        p.add_argument("--node", default=None, help="this node id (default: one at random)")
        p.add_argument("--pid", type=int, default=None, help="the node whose agent has this pid")

    def duration(p: argparse.ArgumentParser) -> None:
        p.add_argument("--duration", type=float, default=10.0,
                       help="seconds before SIGCONT (default 10; Ctrl-C, SIGTERM or SIGHUP resumes at once; a detached "
                            "resumer sends SIGCONT at the deadline even if this command is killed)")

    p = action("kill-worker", "SIGKILL one worker of the run (random unless --pid/--rank/--node)")
    worker_select(p)
    p.add_argument("--signal", type=_signal_name, default=int(signal.SIGKILL), help="signal (default KILL)")
    p = action("kill-node", "SIGKILL one node of the run: its agent, workers and their children")
    node_select(p)
    p.add_argument("--signal", type=_signal_name, default=int(signal.SIGKILL), help="signal (default KILL)")
    p = action("pause-worker", "SIGSTOP one worker for --duration seconds, then SIGCONT (a hang)")
    worker_select(p)
    duration(p)
    p = action("pause-node", "SIGSTOP a whole node (agent and workers) for --duration seconds (a grey node)")
    node_select(p)
    duration(p)
    p = action("pause-etcd", "SIGSTOP the etcd member(s) serving the run for --duration seconds")
    p.add_argument("--etcd-pid", type=_pids, default=None,
                   help="PID[,PID...] of etcd members (default: every etcd on this host serving the run)")
    duration(p)
    p = action("cut-etcd", "forward one agent's etcd traffic through a proxy, cut it for a while, heal it")
    p.add_argument("--listen", type=_hostport, required=True,
                   help="host:port the proxy listens on; start the agent with --rdzv-endpoint naming it")
    p.add_argument("--etcd", type=_hostport, required=True, help="host:port of the etcd member to forward to")
    p.add_argument("--mode", choices=MODES, default="blackhole",
                   help="blackhole: packets vanish (default); reset: connections reset; delay: add --delay")
    p.add_argument("--delay", type=float, default=0.0, help="seconds added per chunk and direction (mode delay)")
    p.add_argument("--cut-after", type=float, default=0.0,
                   help="seconds of forwarding after an agent of the run uses the proxy (default 0)")
    p.add_argument("--wait-agent", type=float, default=120.0,
                   help="seconds to wait for an agent of the run to use the proxy (default 120)")
    duration(p)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace, *, find: Callable[[str], RunProcesses] = find_run,
        emit: Callable[[str], None] | None = None) -> int:
    """Inject the fault args.chaos_action names; RefusedError (exit 2) when a target is not the run's."""
    from elastic_rt.rendezvous.keys import validate_run_id

    validate_run_id(args.run_id)
    emit = emit or printer()
    stop = threading.Event()
    # a closed terminal (SIGHUP) ends a pause as Ctrl-C does; SIGKILL leaves it to the detached resumer
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        if getattr(args, "duration", 0.0) < 0:
            raise ConfigError(f"--duration {args.duration:g}: must be >= 0")
        if args.chaos_action == "cut-etcd":
            plan = CutPlan(listen=args.listen, target=args.etcd, mode=args.mode, delay_s=args.delay,
                           cut_after_s=args.cut_after, duration_s=args.duration, wait_agent_s=args.wait_agent)
            return run_cut_etcd(plan, args.run_id, emit=emit, stop=stop, find=find)
        drill = Drill(find(args.run_id), emit=emit, rng=random.Random(args.seed), stop=stop)
        action = args.chaos_action
        if action == "kill-worker":
            drill.kill_worker(sig=args.signal, pid=args.pid, rank=args.rank, node_id=args.node)
        elif action == "kill-node":
            drill.kill_node(sig=args.signal, node_id=args.node, pid=args.pid)
        elif action == "pause-worker":
            drill.pause_worker(duration_s=args.duration, pid=args.pid, rank=args.rank, node_id=args.node)
        elif action == "pause-node":
            drill.pause_node(duration_s=args.duration, node_id=args.node, pid=args.pid)
        else:
            drill.pause_etcd(duration_s=args.duration, pids=args.etcd_pid)
        return 130 if stop.is_set() else 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
