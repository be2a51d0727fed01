"""`elastic-rt gc`: list the runs under /elastic-rt/ in etcd and remove the keys of those that ended or whose agents
are all gone; a live run, and what gc cannot judge, are never touched."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any, TextIO

from elastic_rt.rendezvous.conf import parse_rdzv_conf
from elastic_rt.errors import ConfigError, RunInUseError, RunNotFoundError
from elastic_rt.rendezvous.claim import remove_run_keys
from elastic_rt.rendezvous.etcd_client import EtcdClient, KeyValue, prefix_end
from elastic_rt.rendezvous.keys import ROOT, RunKeys, validate_run_id
from elastic_rt.rendezvous.registration import etcd_config_from_conf


class RunState(str, Enum):
    """What gc makes of a run's keys."""

    LIVE = "live"  # an agent's alive/ key exists: never touched
    FINISHED = "finished"  # `closed` and no agent: removed (a `closed` on a lease stays until its lease ends)
    ABANDONED = "abandoned"  # neither `closed` nor an agent: every agent stopped; removed
    NOT_JUDGED = "not judged"  # etcd-v3-torch's state (liveness inside torch's pickle), or not a run id: kept


@dataclass(frozen=True, kw_only=True)
class RunEntry:
    """One run as found: its state, its keys, what gc did (or would do) and why."""

    run_id: str
    state: RunState
    keys: int
    marker_on_lease: bool = False  # FINISHED: its `closed` is on a lease, and stays until the lease ends
    removed: int = 0
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class GcOptions:
    endpoint: str
    conf: tuple[tuple[str, str], ...] = ()
    run_ids: tuple[str, ...] = ()  # only these (each must exist); () : every run under /elastic-rt/
    dry_run: bool = False
    timeout_s: float = 5.0
    as_json: bool = False


def judge(run_id: str, kvs: list[KeyValue]) -> RunEntry:
    """A run's state from its keys (read keys only: values are not needed)."""
    try:
        keys = RunKeys(run_id)
    except ConfigError:
        return RunEntry(run_id=run_id, state=RunState.NOT_JUDGED, keys=len(kvs), note="not an elastic-rt run id")
    alive = sorted(kv.key[len(keys.alive_prefix):] for kv in kvs if kv.key.startswith(keys.alive_prefix))
    if alive:
        return RunEntry(run_id=run_id, state=RunState.LIVE, keys=len(kvs),
                        note="agents " + ", ".join(alive[:5]) + (", ..." if len(alive) > 5 else ""))
    if any(kv.key == keys.state for kv in kvs):
        return RunEntry(run_id=run_id, state=RunState.NOT_JUDGED, keys=len(kvs),
                        note="etcd-v3-torch: its liveness is inside torch's state")
    closed = next((kv for kv in kvs if kv.key == keys.closed), None)
    if closed is not None:
        return RunEntry(run_id=run_id, state=RunState.FINISHED, keys=len(kvs), marker_on_lease=closed.lease != 0,
                        note="its closed marker stays until its lease ends" if closed.lease else "")
    return RunEntry(run_id=run_id, state=RunState.ABANDONED, keys=len(kvs))


def survey(client: EtcdClient) -> list[RunEntry]:
    """Every run under /elastic-rt/, by run id."""
    kvs, _ = client.list_prefix(ROOT, keys_only=True)
    runs: dict[str, list[KeyValue]] = {}
    for kv in kvs:
        runs.setdefault(kv.key[len(ROOT):].split("/", 1)[0], []).append(kv)
    return [judge(run_id, found) for run_id, found in sorted(runs.items())]


def remove(client: EtcdClient, entry: RunEntry) -> int:
    """Delete a finished or abandoned run's keys, in one transaction that does nothing if an agent registered
    meanwhile. A `closed` marker on a lease is kept (it tells a late node the run is over, then goes by itself)."""
    keys = RunKeys(entry.run_id)
    if entry.marker_on_lease:
        return remove_run_keys(client, keys)
    return client.delete_ranges_if_empty([(keys.base, prefix_end(keys.base).decode())], empty=keys.alive_range)


def collect(client: EtcdClient, opts: GcOptions) -> list[RunEntry]:
    """Survey, then remove (unless dry_run) what ended. A named run that is live is refused (RunInUseError), one
    that has no key is RunNotFoundError: nothing is removed then."""
    entries = survey(client)
    if opts.run_ids:
        found = {e.run_id: e for e in entries}
        missing = [r for r in opts.run_ids if r not in found]
        if missing:
            raise RunNotFoundError(f"no key under {ROOT}{missing[0]}/ in etcd: a wrong --rdzv-id?")
        entries = [found[r] for r in opts.run_ids]
        live = [e for e in entries if e.state is RunState.LIVE]
        if live:
            raise RunInUseError(f"run {live[0].run_id} is live ({live[0].note}): gc never touches a live run; "
                                "stop its agents first")
    out = []
    for e in entries:
        if e.state in (RunState.FINISHED, RunState.ABANDONED) and not opts.dry_run and e.keys > e.marker_on_lease:
            removed = remove(client, e)
            e = replace(e, removed=removed, note=e.note if removed else "an agent registered meanwhile: kept")
        out.append(e)
    return out


def render(entries: list[RunEntry], *, dry_run: bool) -> str:
    if not entries:
        return f"no run under {ROOT}"
    verb = "would remove" if dry_run else "removed"
    rows = [("RUN", "STATE", "KEYS", "ACTION")]
    for e in entries:
        if e.state in (RunState.FINISHED, RunState.ABANDONED):
            action = f"{verb} {e.keys - e.marker_on_lease if dry_run else e.removed}"
        else:
            action = "kept"
        rows.append((e.run_id, e.state.value, str(e.keys), action + (f" ({e.note})" if e.note else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows)


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `gc` on the top-level parser's subparsers."""
    p = subparsers.add_parser(
        "gc", help="remove the etcd keys of runs that finished or whose agents are all gone",
        description="List the runs under /elastic-rt/ in etcd and remove the keys of those that finished or "
                    "whose agents are all gone. A live run (an agent's alive/ key) and an etcd-v3-torch run are "
                    "never touched.")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True,
                   help="etcd endpoints host:port[,host:port...], as given to `elastic-rt launch`")
    p.add_argument("--rdzv-id", "--rdzv_id", action="append", default=[],
                   help="only this run (repeatable); refused while the run is live")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="k=v,...: the etcd TLS and auth keys of `elastic-rt launch`")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds each etcd request may take (default 5)")
    p.set_defaults(func=run)
    return p


def options_from_args(args: argparse.Namespace) -> GcOptions:
    for run_id in args.rdzv_id:
        validate_run_id(run_id)
    if args.timeout <= 0:
        raise ConfigError(f"--timeout {args.timeout:g}: must be > 0 seconds")
    return GcOptions(endpoint=args.rdzv_endpoint, conf=tuple(sorted(parse_rdzv_conf(args.rdzv_conf).items())),
                     run_ids=tuple(args.rdzv_id), dry_run=bool(args.dry_run), timeout_s=args.timeout,
                     as_json=bool(args.json))


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    opts = options_from_args(args)
    out = sys.stdout if out is None else out
    client = EtcdClient(etcd_config_from_conf(opts.endpoint, dict(opts.conf), timeout_s=opts.timeout_s))
    try:
        entries = collect(client, opts)
    finally:
        client.close()
    if opts.as_json:
        for e in entries:
            print(json.dumps({**asdict(e), "state": e.state.value, "dry_run": opts.dry_run}), file=out)
    else:
        print(render(entries, dry_run=opts.dry_run), file=out)
    return 0
