"""`elastic-rt status`: what a job is doing now, from its etcd keys and its agents' own endpoints; --watch, --json."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from elastic_rt.rendezvous.conf import parse_rdzv_conf
from elastic_rt.errors import ConfigError, EtcdUnavailableError, RunNotFoundError
from elastic_rt.rendezvous.etcd_client import EtcdClient
from elastic_rt.rendezvous.keys import validate_run_id
from elastic_rt.rendezvous.registration import etcd_config_from_conf
from elastic_rt.status.agents import DEFAULT_PARALLEL, read_agents
from elastic_rt.status.etcd_state import RunState, read_run_state
from elastic_rt.status.model import JobStatus, build
from elastic_rt.status.render import render_json, render_text

CLEAR_SCREEN = "\x1b[H\x1b[2J"


@dataclass(frozen=True, kw_only=True)
class StatusOptions:
    endpoint: str
    run_id: str
    conf: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 2.0  # per etcd request and per agent request
    parallel: int = DEFAULT_PARALLEL
    watch_s: float | None = None  # refresh every this many seconds; None: once
    as_json: bool = False


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `status` on the top-level parser's subparsers."""
    p = subparsers.add_parser(
        "status", help="what a job is doing now: round, nodes and their state, step rates, failures, goodput",
        description="Read the run's keys in etcd and each agent's /metrics, /livez and /readyz (the address "
                    "every agent advertises in etcd) and show the job on one screen.")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True,
                   help="etcd endpoints host:port[,host:port...], as given to `elastic-rt launch`")
    p.add_argument("--rdzv-id", "--rdzv_id", required=True, help="the job's id")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="k=v,...: the etcd TLS and auth keys of `elastic-rt launch` (ca_cert, cert, key, user, "
                        "password_file; or $ELASTIC_RT_ETCD_PASSWORD)")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="redraw every SECONDS (default 2) until interrupted")
    p.add_argument("--json", action="store_true", help="one JSON object (one per line with --watch)")
    p.add_argument("--timeout", type=float, default=2.0,
                   help="seconds each etcd and agent request may take (default 2)")
    p.set_defaults(func=run)
    return p


def options_from_args(args: argparse.Namespace) -> StatusOptions:
    validate_run_id(args.rdzv_id)
    if args.timeout <= 0:
        raise ConfigError(f"--timeout {args.timeout:g}: must be > 0 seconds")
    if args.watch is not None and args.watch <= 0:
        raise ConfigError(f"--watch {args.watch:g}: must be > 0 seconds")
    return StatusOptions(endpoint=args.rdzv_endpoint, run_id=args.rdzv_id,
                         conf=tuple(sorted(parse_rdzv_conf(args.rdzv_conf).items())), timeout_s=args.timeout,
                         watch_s=args.watch, as_json=bool(args.json))


def read_state(client: EtcdClient, opts: StatusOptions, *, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> RunState:
    """The run's keys. A call that fails at once (a connection being set up, a leader election) is tried again
    until --timeout has passed: 'not reachable' means no answer within it."""
    deadline = clock() + opts.timeout_s
    pause = 0.05
    while True:
        try:
            return read_run_state(client, opts.run_id)
        except EtcdUnavailableError:
            if clock() + pause >= deadline:
                raise
            sleep(pause)
            pause = min(2 * pause, 1.0)


def collect(client: EtcdClient, opts: StatusOptions, *, now: Callable[[], float] = time.time) -> JobStatus:
    """One snapshot: the run's keys, then every advertised agent, in parallel."""
    run = read_state(client, opts)
    addresses = {n: rec.metrics for n, rec in run.nodes.items() if rec.alive and rec.metrics}
    readings = read_agents(addresses, timeout_s=opts.timeout_s, parallel=opts.parallel)
    return build(run, readings, now=now())


def snapshot(opts: StatusOptions) -> JobStatus:
    """collect() with a client of its own."""
    client = _client(opts)
    try:
        return collect(client, opts)
    finally:
        client.close()


def _client(opts: StatusOptions) -> EtcdClient:
    return EtcdClient(etcd_config_from_conf(opts.endpoint, dict(opts.conf), timeout_s=opts.timeout_s))


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    return show(options_from_args(args), out=sys.stdout if out is None else out)


def show(opts: StatusOptions, *, out: TextIO, sleep: Callable[[float], None] = time.sleep,
         frames: int | None = None) -> int:
    """Print the job once, or every watch_s seconds (`frames` of them; None: until interrupted).

    Once: an unreachable etcd raises (one line, exit code 1). Watching: it is one line on the screen
    and the next refresh tries again."""
    if opts.watch_s is None:
        status = snapshot(opts)
        print(render_json(status) if opts.as_json else render_text(status), file=out)
        return 0
    client = _client(opts)
    try:
        return _watch(client, opts, out, sleep, frames)
    finally:
        client.close()


def _watch(client: EtcdClient, opts: StatusOptions, out: TextIO, sleep: Callable[[float], None],
           frames: int | None) -> int:
    redraw = not opts.as_json and out.isatty()
    shown = 0
    try:
        while frames is None or shown < frames:
            try:
                status = collect(client, opts)
                text = render_json(status) if opts.as_json else render_text(status)
            except (EtcdUnavailableError, RunNotFoundError) as exc:  # etcd may come back, the run may start
                text = (json.dumps({"version": 1, "run_id": opts.run_id, "error": str(exc)}) if opts.as_json
                        else f"elastic-rt status: {exc}; trying again in {opts.watch_s:g} s")
            if redraw:
                out.write(CLEAR_SCREEN)
            print(text, file=out, flush=True)
            if not (redraw or opts.as_json):
                print(file=out)
            shown += 1
            if frames is None or shown < frames:
                sleep(opts.watch_s or 0.0)
    except KeyboardInterrupt:
        pass  # the way out of --watch
    return 0

