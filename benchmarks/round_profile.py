#!/usr/bin/env python3
"""Where one rendezvous round's client CPU goes: N simulated nodes in this one process meet on a real etcd,
profiled per function across every thread (yappi, CPU clock), summed into the round's parts.

    pip install yappi
    python benchmarks/round_profile.py --nodes 32                 # a first round of 32 nodes, 3-member etcd
    python benchmarks/round_profile.py --nodes 32 --no-profile    # the process's CPU only (no profiler cost)
    python benchmarks/round_profile.py --nodes 128 --src /tmp/parent   # another checkout's elastic_rt (a baseline)
    python benchmarks/round_profile.py --nodes 128 --no-profile --counts   # and what the round is made of

Prints the process's CPU per node per round (os.times, every thread), its voluntary context switches by thread
kind, with --counts the round's writes, reads, frames, streams, threads and sockets, and, with the profiler, the CPU per node
per round of each part (thread start and stop, connections, watch, view, lease, etcd calls, decisions, logging,
the rest) by the innermost elastic_rt/ frame of each sample's call stack. The profiler slows the round; its
shares are what it is for, the unprofiled CPU is the figure. benchmarks/rendezvous_scale.py is the benchmark.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import resource
import socket
import sys
import threading
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (part, substrings of "module:function" of the innermost elastic_rt frame), first match wins
PARTS = (
    ("thread start/stop", ("threading.py:start", "threading.py:join", ":_bootstrap")),
    ("connection setup", ("connection.py:_connect", "connection.py:__init__", "etcd_endpoint.py:_open",
                          "etcd_endpoint.py:_authenticate", "liveness.py:__init__", "liveness.py:bind_listener",
                          "liveness.py:_connect")),
    ("reader thread, frames", ("connection.py:_read", "connection.py:_run", "frames.py:", "wire.py:decode")),
    ("watch", ("etcd_client.py:open_watch", "watch", "view.py:_run", "view.py:_apply")),
    ("view building", ("view.py:",)),
    ("lease", ("lease.py:", "run_lease.py:")),
    ("liveness", ("liveness.py:",)),
    ("etcd calls (encode, send, wait)", ("etcd_client.py:", "etcd_endpoint.py:", "connection.py:", "wire.py:")),
    ("decisions", ("decide.py:", "rounds.py:")),
    ("store", ("store.py:",)),
    ("handler", ("handler.py:", "monitor.py:", "signing.py:", "keys.py:", "claim.py:")),
)


def part_of(frame: str) -> str:
    for name, needles in PARTS:
        if any(n in frame for n in needles):
            return name
    return "other"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=32)
    p.add_argument("--etcd-members", type=int, default=3)
    p.add_argument("--etcd-binary", default=None)
    p.add_argument("--rounds", type=int, default=1, help="first round, then this many - 1 re-forms (one leaves)")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--counts", action="store_true", help="also count, per node per round, what the round's CPU is "
                                                          "made of: connection writes, reader wake-ups, frames read "
                                                          "by type, threads and sockets started (adds a little CPU)")
    p.add_argument("--switch-interval-ms", type=float, default=50.0)
    p.add_argument("--top", type=int, default=25, help="functions listed (by own CPU)")
    p.add_argument("--src", default=REPO, help="the git checkout whose elastic_rt is profiled (default: this one); "
                                               "its commit and whether it is clean are recorded")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results directory")
    p.add_argument("--allow-dirty", action="store_true", help="profile a tree with uncommitted changes")
    args = p.parse_args(argv)
    if args.nodes < 2 or args.rounds < 1 or args.rounds > args.nodes - 1 or args.etcd_members < 1:
        p.error("--nodes must be >= 2, --rounds between 1 and --nodes - 1, --etcd-members >= 1")
    sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    sys.path.insert(0, REPO)
    from provenance import provenance  # benchmarks/provenance.py: benchmarks/ is sys.path[0]
    from results_file import write_results

    src = os.path.abspath(args.src)
    git = provenance(args.allow_dirty, repo=src)
    sys.path.insert(0, src)  # its elastic_rt before any installed one
    import logging

    logging.basicConfig(level=logging.WARNING)
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    from elastic_rt.rendezvous.registration import register
    from etcd_testbed.server import EtcdCluster

    yappi = None
    if not args.no_profile:
        try:
            import yappi  # type: ignore[import-not-found]
        except ImportError:
            print("round_profile: yappi is not installed (pip install yappi), or run with --no-profile", file=sys.stderr)
            return 2
    register()
    import elastic_rt

    counts = Counts() if args.counts else None

    lines: list[str] = [f"round profile {datetime.date.today().isoformat()}: elastic_rt of {src} at code "
                        f"{git['commit']}{' (dirty)' if git['dirty'] else ''} ({os.path.dirname(elastic_rt.__file__)}); "
                        f"{os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.1f} at the start, "
                        f"{args.nodes} nodes in this one process, {args.etcd_members}-member etcd, GIL switch interval "
                        f"{args.switch_interval_ms:g} ms, {'no profiler' if yappi is None else 'yappi CPU clock'}"]
    print(lines[0])
    say = lambda line: (print(line), lines.append(line))  # noqa: E731
    with EtcdCluster(args.etcd_members, binary=args.etcd_binary) as cluster:
        run_id = f"profile-{uuid.uuid4().hex[:6]}"
        n = args.nodes
        conf = {"join_timeout": "120", "last_call_timeout": "120"}
        handlers = [rendezvous_handler_registry.create_handler(RendezvousParameters(
            "etcd-v3", cluster.endpoints, run_id, n - 1, n, local_addr="127.0.0.1", node_id=f"n{i:04d}", **conf))
            for i in range(n)]
        live = list(handlers)
        for r in range(args.rounds):
            if r:
                gone = live.pop()
                gone.leave()
                gone.close()
            results: list = []
            if yappi is not None:
                yappi.set_clock_type("cpu")
                yappi.clear_stats()
                yappi.start(builtins=True, profile_threads=True)
            before = thread_cpu_s({})
            switches = thread_switches({})
            if counts is not None:
                counts.reset()
            t0, wall0, ru0 = os.times(), time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
            threads = [threading.Thread(target=lambda h=h: results.append(h.next_rendezvous())) for h in live]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
            t1, wall, ru1 = os.times(), time.monotonic() - wall0, resource.getrusage(resource.RUSAGE_SELF)
            if yappi is not None:
                yappi.stop()
            cpu = (t1.user - t0.user) + (t1.system - t0.system)
            ok = sum(1 for x in results if x.world_size == len(live))
            say(f"round {r}: {ok} of {len(live)} met in {wall:.2f} s; process CPU {1000 * cpu / len(live):.2f} "
                  f"ms/node/round (user {1000 * (t1.user - t0.user) / len(live):.2f}, system "
                  f"{1000 * (t1.system - t0.system) / len(live):.2f}); context switches per node: "
                  f"{(ru1.ru_nvcsw - ru0.ru_nvcsw) / len(live):.0f} voluntary, "
                  f"{(ru1.ru_nivcsw - ru0.ru_nivcsw) / len(live):.0f} involuntary; load {os.getloadavg()[0]:.1f}")
            counted = counts.snapshot() if counts is not None else {}
            by_thread = thread_cpu_s(before)
            by_kind = thread_switches(switches)
            by_kind["the threads that called next_rendezvous() (exited)"] = \
                (ru1.ru_nvcsw - ru0.ru_nvcsw) - sum(by_kind.values())
            by_thread.pop(None, None)
            by_thread["the threads that called next_rendezvous() (exited)"] = cpu - sum(by_thread.values())
            say("  CPU by thread kind (us/node/round): " + ", ".join(
                f"{name} {1e6 * t / len(live):.0f}" for name, t in sorted(by_thread.items(), key=lambda kv: -kv[1])))
            say("  voluntary context switches by thread kind (per node/round): " + ", ".join(
                f"{name} {v / len(live):.1f}" for name, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
            if counted:
                say("  counts per node/round: " + ", ".join(f"{k} {v / len(live):.2f}" for k, v in sorted(counted.items())))
            if yappi is not None:
                report(yappi, len(live), args.top, say)
        for h in live:
            h.leave()
            h.close()
    stamp = datetime.date.today().isoformat()
    write_results(args.out, "round-profile", stamp, {
        "benchmark": "round-profile", "date": stamp, "provenance": git, "src": src,
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "lines": lines,
        "loadavg_at_end": list(os.getloadavg())}, "\n".join(lines) + "\n")
    return 0


def _kind(thread) -> str:
    """A thread's kind from its name (a threading.Thread's or a Daemon's: the agent's loops, rendezvous/daemon.py)."""
    return ("elastic-rt-etcd" if thread.name.startswith("elastic-rt-etcd") else
            "".join(c for c in thread.name if not c.isdigit()).split(" (")[0].rstrip("-"))


def _per_thread(before: dict, read) -> dict:
    """read(tid) of this process's live threads, summed by thread kind. With `before` empty: also each thread's
    figure, under the key None; with an earlier call's result: the change since then."""
    from elastic_rt.rendezvous.daemon import running

    names = {t.native_id: _kind(t) for t in (*threading.enumerate(), *running())}
    seen = before.get(None, {})
    now, out = {}, {}
    for tid in os.listdir("/proc/self/task"):
        try:
            value = read(tid)
        except (OSError, StopIteration):
            continue
        now[int(tid)] = value
        name = names.get(int(tid), "other")
        out[name] = out.get(name, 0) + value - seen.get(int(tid), 0)
    return {**out, None: now} if not before else out


def thread_switches(before: dict) -> dict:
    """Voluntary context switches (each a wait: a blocking call, a lock or the GIL) by thread kind, from
    /proc/self/task/*/status (see _per_thread)."""
    def read(tid: str) -> int:
        with open(f"/proc/self/task/{tid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))
    return _per_thread(before, read)


class Counts:
    """Counters wrapped around elastic_rt's connection and thread start (the harness's, not the product's): writes
    to etcd (each a sendall), reader wake-ups, frames read by type, requests and streams opened, threads and
    sockets started."""

    FRAMES = {0: "DATA", 1: "HEADERS", 3: "RST_STREAM", 4: "SETTINGS", 6: "PING", 7: "GOAWAY", 8: "WINDOW_UPDATE",
              9: "CONTINUATION"}

    def __init__(self) -> None:
        from elastic_rt.rendezvous import connection, daemon, frames

        self.c: collections.Counter = collections.Counter()
        c = self.c

        def counting(cls, name, key):
            orig = getattr(cls, name)

            def wrapper(*a, **k):
                c[key(*a, **k) if callable(key) else key] += 1
                return orig(*a, **k)
            setattr(cls, name, wrapper)

        counting(connection.Connection, "_write", "writes to etcd")
        counting(connection.Connection, "_receive", "reads from etcd")
        counting(connection.Connection, "open", lambda self, path, *a, **k: "opened " + path.rsplit("/", 1)[-1])
        counting(frames.StreamTable, "_frame", lambda self, ftype, *a: "frames read " + Counts.FRAMES.get(ftype, str(ftype)))
        counting(threading.Thread, "start", lambda self: "threads started " + _kind(self))
        counting(daemon.Daemon, "start", lambda self: "threads started " + _kind(self))
        counting(socket.socket, "__init__", "sockets")

    def reset(self) -> None:
        self.c.clear()

    def snapshot(self) -> dict:
        return dict(self.c)


def thread_cpu_s(before: dict) -> dict:
    """CPU seconds by thread kind (its name without digits), from /proc/self/task/*/schedstat (see _per_thread)."""
    def read(tid: str) -> float:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9  # ns on a CPU
    return _per_thread(before, read)


def report(yappi, nodes: int, top: int, say) -> None:
    """Own CPU of each function, summed into PARTS by its owner: the function itself when it is elastic_rt's
    (or threading's), else the owner of its heaviest caller (pstats' call graph, as converted from yappi's)."""
    import pstats

    st = yappi.convert2pstats(yappi.get_func_stats()).stats  # func -> (cc, nc, tt, ct, callers)

    def label(func) -> str:
        return f"{os.path.basename(func[0])}:{func[2]}"

    memo: dict = {}

    def owner(func, depth: int = 0) -> str:
        if func in memo:
            return memo[func]
        name = label(func)
        if "elastic_rt" in func[0] or name.startswith("threading.py:") or depth > 20 or func not in st:
            return name
        callers = st[func][4]
        if not callers:
            return name
        memo[func] = name  # a cycle ends here
        memo[func] = owner(max(callers, key=lambda c: callers[c][3]), depth + 1)
        return memo[func]

    total = sum(v[2] for v in st.values())
    parts: dict[str, float] = {}
    for func, v in st.items():
        part = part_of(owner(func))
        parts[part] = parts.get(part, 0.0) + v[2]
    say(f"  profiled CPU {1000 * total / nodes:.2f} ms/node/round; by part (us/node/round):")
    for name, t in sorted(parts.items(), key=lambda kv: -kv[1]):
        say(f"    {name:<34} {1e6 * t / nodes:8.0f}  {100 * t / total:5.1f} %")
    say("  inclusive CPU of the round's steps (us/node/round):")
    for func, v in sorted(st.items(), key=lambda kv: -kv[1][3]):
        if any(x in func[0] for x in ("handler.py", "rounds.py", "lease.py", "view.py", "claim.py", "liveness.py",
                                      "run_lease.py", "store.py", "decide.py", "monitor.py")) and v[3] / nodes > 40e-6:
            say(f"    {1e6 * v[3] / nodes:8.0f}  {label(func)} ({v[1]} calls)")
    say(f"  top {top} functions by own CPU (us/node/round), with their owner:")
    for func, v in sorted(st.items(), key=lambda kv: -kv[1][2])[:top]:
        say(f"    {1e6 * v[2] / nodes:8.0f}  {label(func)} ({v[1]} calls) <- {owner(func)}")


if __name__ == "__main__":
    sys.exit(main())
