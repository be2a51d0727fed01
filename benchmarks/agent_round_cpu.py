#!/usr/bin/env python3
"""The client CPU of one agent's rendezvous round, as an agent runs it: one handler in this process, a job of
one node (`--nnodes 1`), on a real etcd. Each run is a new run id: a first round (the handler's start-up
included: connection, lease, view, liveness), then a second round of the same handler (a restart) and a third (a
restart from round 2 on, where rank 0 also deletes the rounds before the previous one: a long job's restarts).
The CPU is getrusage's (every thread of this process, microseconds; etcd runs in child processes and is
not counted), with the share of the thread that called next_rendezvous() (the rest: the connection's reader, the
view's watch and the lease's threads), the process's context switches and the round's wall time (a wait
on etcd costs no CPU and shows there); the handler is created before the clock starts and left 0.3 s to settle around each round.

    python benchmarks/agent_round_cpu.py                          # this checkout, 25 runs, 3-member etcd
    python benchmarks/agent_round_cpu.py --src /tmp/other-clone   # another checkout's elastic_rt (a baseline)
    python benchmarks/agent_round_cpu.py --fingerprint            # as `elastic-rt launch` makes it: a job fingerprint

Another checkout is imported from --src before any installed elastic_rt, so run it with an interpreter that
has that checkout's dependencies (e.g. its own venv). Prints and writes the median, min and max per round.
benchmarks/rendezvous_scale.py measures the same per node at scale (many nodes per process).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def usage() -> tuple[float, float, int]:
    """(process CPU s, this thread's CPU s, context switches of the process so far)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, time.thread_time(), r.ru_nvcsw + r.ru_nivcsw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=25)
    p.add_argument("--etcd-members", type=int, default=3)
    p.add_argument("--etcd-binary", default=None)
    p.add_argument("--src", default=REPO, help="the git checkout whose elastic_rt is measured (default: this one)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results directory")
    p.add_argument("--allow-dirty", action="store_true", help="measure a tree with uncommitted changes")
    p.add_argument("--fingerprint", action="store_true",
                   help="give the handler a job fingerprint, as `elastic-rt launch` does (the run's claim is checked "
                        "in the first round; code before fingerprints ignores it)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.etcd_members < 1:
        p.error("--runs and --etcd-members must be >= 1")
    from provenance import machine_speed, provenance  # benchmarks/provenance.py: benchmarks/ is sys.path[0]
    from results_file import write_results

    src = os.path.abspath(args.src)
    git = provenance(args.allow_dirty, repo=src)
    sys.path.insert(0, src)  # its elastic_rt before any installed one
    sys.path.append(REPO)  # etcd_testbed, from this checkout
    logging.basicConfig(level=logging.WARNING)
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    import elastic_rt
    from elastic_rt.rendezvous.registration import register
    from etcd_testbed.server import EtcdCluster

    register()
    speed = machine_speed()  # before the runs, as the results file says
    fingerprint = {"fingerprint": json.dumps({"script": "train.py", "args_sha256": "0" * 16, "nnodes": "1",
                                              "launch_id": ""}, sort_keys=True)} if args.fingerprint else {}
    load_start = os.getloadavg()
    first: dict[str, list[float]] = {"cpu": [], "main": [], "switches": [], "wall": []}
    second: dict[str, list[float]] = {"cpu": [], "main": [], "switches": [], "wall": []}
    third: dict[str, list[float]] = {"cpu": [], "main": [], "switches": [], "wall": []}
    with EtcdCluster(args.etcd_members, binary=args.etcd_binary) as cluster:
        version = subprocess.run([cluster.binary, "--version"], capture_output=True, text=True).stdout.splitlines()
        for _ in range(args.runs):
            h = rendezvous_handler_registry.create_handler(RendezvousParameters(
                "etcd-v3", cluster.endpoints, f"agent-cpu-{uuid.uuid4().hex[:6]}", 1, 1, local_addr="127.0.0.1",
                node_id="n0", **fingerprint))
            for series in (first, second, third):
                time.sleep(0.3)
                before, started = usage(), time.perf_counter()
                h.next_rendezvous()
                after, ended = usage(), time.perf_counter()
                series["cpu"].append(1000 * (after[0] - before[0]))
                series["main"].append(1000 * (after[1] - before[1]))
                series["switches"].append(after[2] - before[2])
                series["wall"].append(1000 * (ended - started))
            time.sleep(0.3)
            h.shutdown()
    load_end = os.getloadavg()

    def summary(series: dict[str, list[float]]) -> dict:
        xs = series["cpu"]
        return {"median_ms": statistics.median(xs), "min_ms": min(xs), "max_ms": max(xs), "runs_ms": xs,
                "main_thread_median_ms": statistics.median(series["main"]),
                "context_switches_median": statistics.median(series["switches"]),
                "wall_median_ms": statistics.median(series["wall"]), "wall_runs_ms": series["wall"],
                "main_thread_runs_ms": series["main"], "context_switches_runs": series["switches"]}

    result = {"first_round": summary(first), "second_round": summary(second), "third_round": summary(third)}
    head = (f"agent round CPU {datetime.date.today().isoformat()}: elastic_rt of {src} at code {git['commit']}"
            f"{' (dirty)' if git['dirty'] else ''} ({os.path.dirname(elastic_rt.__file__)}); one handler in this "
            f"process, a 1-node job{' with a job fingerprint' if args.fingerprint else ''}, {args.runs} runs; "
            f"{os.cpu_count()} CPU(s), load average {load_start[0]:.1f} at "
            f"the start and {load_end[0]:.1f} at the end; etcd {version[0] if version else '?'} "
            f"({args.etcd_members} members on loopback, {cluster.binary})")
    lines = [head, "", "| round | median CPU ms | min | max | of which the calling thread (median) | context switches "
             "(median) | wall ms (median) |", "|---|---|---|---|---|---|---|"]
    for name, key in (("first (start-up included)", "first_round"), ("second (a restart)", "second_round"),
                      ("third (a restart from round 2 on)", "third_round")):
        r = result[key]
        lines.append(f"| {name} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['max_ms']:.2f} | "
                     f"{r['main_thread_median_ms']:.2f} | {r['context_switches_median']:g} | {r['wall_median_ms']:.1f} |")
    text = "\n".join(lines) + "\n"
    stamp = datetime.date.today().isoformat()
    write_results(args.out, "agent-round-cpu", stamp, {
        "benchmark": "agent_round_cpu", "date": stamp, "provenance": git, "src": src, "runs": args.runs,
        "fingerprint": args.fingerprint,
        "etcd": {"binary": cluster.binary, "version": version[:1], "members": args.etcd_members},
        "cpus": os.cpu_count(), **speed, "loadavg_start": list(load_start), "loadavg_end": list(load_end), **result}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
