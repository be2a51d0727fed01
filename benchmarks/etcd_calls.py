#!/usr/bin/env python3
"""CPU per etcd call: elastic-rt's client (connection.py) against gRPC Python (etcd-sdk-python's client).

One thread, one etcd member on loopback, a tight loop of one kind of call at a time, the two clients
interleaved repeat by repeat: a read (Range of one key), a put, a lease keep-alive and a one-range Txn
(elastic-rt's read_ranges; gRPC Python: a Txn with one Range). Per call: the process's CPU time (every
thread of it: the caller, the connection's reader thread, gRPC's event engine), its wall time, and the
context switches of the whole process. The median of the repeats is the figure; the load average is
recorded at the start and the end (the machine is shared).

    python benchmarks/etcd_calls.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("read", "put", "keep-alive", "txn")


def _switches() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except OSError:
            pass  # a thread that ended meanwhile
    return total


def _ours(host: str, port: int) -> dict:
    from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig

    c = EtcdClient(EtcdConfig(endpoints=((host, port),)))
    version = c.status_latency_s()[0]
    lease = c.grant_lease(60)
    return {"read": lambda: c.get("/bench/k"), "put": lambda: c.put("/bench/k", b"v" * 100),
            "keep-alive": lambda: c.refresh_lease(lease, timeout_s=1.0, attempts=1),
            "txn": lambda: c.read_ranges([("/bench/", b"/bench0")]), "close": c.close, "version": version}


def _grpc_python(host: str, port: int) -> dict:
    import pyetcd

    c = pyetcd.client(host=host, port=port)
    lease = c.lease(60)
    return {"read": lambda: c.get("/bench/k"), "put": lambda: c.put("/bench/k", b"v" * 100),
            "keep-alive": lambda: next(iter(c.refresh_lease(lease.id))),
            "txn": lambda: c.transaction(compare=[], success=[c.transactions.get("/bench/", range_end="/bench0")],
                                         failure=[]),
            "close": c.close}


def _per_call(fn, calls: int) -> tuple[float, float, float]:
    s0, c0, w0 = _switches(), time.process_time(), time.monotonic()
    for _ in range(calls):
        fn()
    return ((time.process_time() - c0) / calls * 1e6, (time.monotonic() - w0) / calls * 1e6,
            (_switches() - s0) / calls)


def measure(host: str, port: int, calls: int, repeats: int) -> tuple[dict, str]:
    clients = {"elastic-rt": _ours(host, port), "grpc-python": _grpc_python(host, port)}
    version = clients["elastic-rt"]["version"]
    clients["elastic-rt"]["put"]()
    runs = {name: {k: [] for k in KINDS} for name in clients}
    try:
        for kind in KINDS:
            for ops in clients.values():
                _per_call(ops[kind], max(50, calls // 10))  # warm up
            for _ in range(repeats):
                for name, ops in clients.items():
                    runs[name][kind].append(_per_call(ops[kind], calls))
    finally:
        for ops in clients.values():
            ops["close"]()
    return {name: {kind: {"cpu_us": statistics.median(r[0] for r in rs), "wall_us": statistics.median(r[1] for r in rs),
                          "switches": statistics.median(r[2] for r in rs), "runs": rs}
                   for kind, rs in kinds.items()} for name, kinds in runs.items()}, version


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per repeat (default 2000)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--etcd-binary", default=None, help="etcd to start (default: the tests' own)")
    p.add_argument("--out", default=None, help="write etcd-calls-DATE.json/.txt into this directory")
    p.add_argument("--allow-dirty", action="store_true", help="run on uncommitted changes (recorded)")
    args = p.parse_args()
    sys.path.insert(0, REPO)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import provenance
    from results_file import write_results

    sys.path.insert(0, REPO)  # etcd_testbed/ (the repository's test etcd servers) beside benchmarks/
    from etcd_testbed.server import EtcdCluster

    git = provenance(args.allow_dirty) if args.out else None
    load_start = os.getloadavg()
    with EtcdCluster(1, binary=args.etcd_binary) as cluster:
        m = cluster.members[0]
        rows, version = measure(m.host, m.client_port, args.calls, args.repeats)
    lines = [f"etcd calls, one thread, one member of etcd {version} on loopback; {args.calls} calls x {args.repeats} "
             f"repeats, the clients interleaved; load average {load_start[0]:.2f} at the start, "
             f"{os.getloadavg()[0]:.2f} at the end (shared machine); medians; code "
             f"{git['commit'][:7] if git else 'not recorded'}", "",
             "| call | elastic-rt CPU us | gRPC Python CPU us | CPU ratio | elastic-rt wall us | gRPC Python wall us "
             "| elastic-rt switches/call | gRPC Python switches/call |", "|---|---|---|---|---|---|---|---|"]
    ours, theirs = rows["elastic-rt"], rows["grpc-python"]
    for kind in KINDS:
        a, b = ours[kind], theirs[kind]
        lines.append(f"| {kind} | {a['cpu_us']:.0f} | {b['cpu_us']:.0f} | {b['cpu_us'] / a['cpu_us']:.2f}x | "
                     f"{a['wall_us']:.0f} | {b['wall_us']:.0f} | {a['switches']:.1f} | {b['switches']:.1f} |")
    text = "\n".join(lines) + "\n"
    if not args.out:
        print(text)
        return 0
    stamp = datetime.date.today().isoformat()
    payload = {"benchmark": "etcd-calls", "date": stamp, "provenance": git, "etcd": version,
               "calls": args.calls, "repeats": args.repeats,
               "machine": {"cpus": os.cpu_count(), "loadavg_at_start": list(load_start),
                           "loadavg_at_end": list(os.getloadavg())}, "clients": rows}
    write_results(args.out, "etcd-calls", stamp, payload, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
