#!/usr/bin/env python3
"""TCPStore at 1,000+ clients: connect time, a barrier round (add + wait), and what a low open-files limit does.

The worker store of an elastic-rt job is torch's TCPStore (libuv backend), hosted by the rank-0
worker: every worker process of the job holds one connection to it. This measures one server with
N clients spread over P processes on loopback:

  connect_s   all N clients constructed (TCPStore(..., is_master=False)) from the signal
  barrier_s   every client add("arrived", 1) then wait(["go"]); the server sets "go" at N: signal ->
              the last client's wait returned
  server_fds  open file descriptors of the server's process with N clients connected

and, with --server-nofile K, the server process's soft RLIMIT_NOFILE set to K first: how many of
the N clients connect and what the others see.

    python benchmarks/tcpstore_scale.py --clients 1024 --server-nofile 0,512
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def server_main(conn, nofile: int, n: int) -> None:
    """Host the store (libuv backend); count our fds; release the barrier when all N arrived."""
    if nofile:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False,
                          use_libuv=True)
    conn.send(("port", store.port, store.libuvBackend))
    while True:
        cmd, arg = conn.recv()
        if cmd == "fds":
            try:
                conn.send(("fds", len(os.listdir("/proc/self/fd")), None))
            except OSError as exc:  # EMFILE: the limit is reached (listing /proc/self/fd needs a descriptor)
                conn.send(("fds", f"{exc.strerror}", None))
        elif cmd == "barrier":  # arg: deadline
            while store.add("arrived", 0) < n and time.monotonic() < arg:
                time.sleep(0.005)
            store.set("go", "1")
            conn.send(("released", time.monotonic(), None))
        elif cmd == "stop":
            conn.send(("stopped", None, None))
            return


def client_main(conn, port: int, count: int, timeout_s: float) -> None:
    """`count` TCPStore clients in this process, connected in parallel threads, then the barrier."""
    from datetime import timedelta

    import torch.distributed as dist

    stores: list = [None] * count
    errors: list[str] = []
    conn.recv()  # "connect"

    def connect(i: int) -> None:
        try:
            stores[i] = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=timeout_s),
                                      use_libuv=True)
        except Exception as exc:  # noqa: BLE001  (reported)
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")

    _parallel(connect, count)
    conn.send(("connected", time.monotonic(), {"ok": sum(s is not None for s in stores), "errors": errors[:3],
                                               "n_errors": len(errors)}))
    conn.recv()  # "barrier"
    done: list[float] = []

    def arrive(i: int) -> None:
        if stores[i] is None:
            return
        try:
            stores[i].add("arrived", 1)
            stores[i].wait(["go"])
            done.append(time.monotonic())
        except Exception as exc:  # noqa: BLE001
            errors.append(f"barrier: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")

    _parallel(arrive, count)
    conn.send(("waited", max(done) if done else None, {"ok": len(done), "errors": errors[-3:]}))
    conn.recv()  # "stop"
    os._exit(0)  # skip destructors of 100s of stores (and torch's exit-time aborts)


def _parallel(fn, count: int) -> None:
    threads = [threading.Thread(target=fn, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _recv(conn, timeout_s: float):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    return conn.recv()


def run(n: int, procs: int, nofile: int, timeout_s: float) -> dict:
    ctx = mp.get_context("spawn")
    s_parent, s_child = ctx.Pipe()
    server = ctx.Process(target=server_main, args=(s_child, nofile, n), daemon=True)
    server.start()
    _, port, libuv = _recv(s_parent, 120)
    row = {"clients": n, "procs": procs, "server_nofile": nofile or resource.getrlimit(resource.RLIMIT_NOFILE)[0],
           "libuv": libuv, "loadavg_before": list(os.getloadavg())}
    clients, conns = [], []
    for i in range(procs):
        parent, child = ctx.Pipe()
        count = n * (i + 1) // procs - n * i // procs
        p = ctx.Process(target=client_main, args=(child, port, count, timeout_s), daemon=True)
        p.start()
        clients.append(p)
        conns.append(parent)
    try:
        t0 = time.monotonic()
        for c in conns:
            c.send("connect")
        answers = [_recv(c, timeout_s * 4 + 120) for c in conns]
        row["connected"] = sum(a[2]["ok"] for a in answers)
        row["connect_errors"] = sum(a[2]["n_errors"] for a in answers)
        row["connect_error_sample"] = next((a[2]["errors"][0] for a in answers if a[2]["errors"]), "")
        row["connect_s"] = max(a[1] for a in answers) - t0
        s_parent.send(("fds", None))
        row["server_fds"] = _recv(s_parent, 60)[1]
        t0 = time.monotonic()
        s_parent.send(("barrier", t0 + timeout_s))
        for c in conns:
            c.send("barrier")
        released = _recv(s_parent, timeout_s + 60)[1]
        answers = [_recv(c, timeout_s * 2 + 60) for c in conns]
        row["barrier_ok"] = sum(a[2]["ok"] for a in answers)
        ends = [a[1] for a in answers if a[1] is not None]
        row["barrier_s"] = (max(ends) - t0) if row["barrier_ok"] == n else None
        row["release_s"] = released - t0
        row["barrier_error_sample"] = next((a[2]["errors"][0] for a in answers if a[2]["errors"]), "")
    except (TimeoutError, EOFError, OSError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for c in conns:
            try:
                c.send("stop")
            except OSError:
                pass
        for p in clients + [server]:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)
        row["loadavg_after"] = list(os.getloadavg())
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tcpstore_scale.py", description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="256,1024,2048", help="comma-separated N")
    p.add_argument("--procs", type=int, default=4, help="client processes (default 4)")
    p.add_argument("--server-nofile", default="0", help="comma-separated soft RLIMIT_NOFILE for the server "
                   "(0: inherit); each is run for every N")
    p.add_argument("--timeout-s", type=float, default=30.0, help="client store timeout (default 30)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results directory")
    p.add_argument("--allow-dirty", action="store_true", help="run on a tree with uncommitted changes")
    a = p.parse_args(argv)
    from provenance import provenance  # benchmarks/provenance.py: benchmarks/ is sys.path[0]
    from results_file import write_results

    git = provenance(a.allow_dirty)
    rows = []
    for nofile in [int(x) for x in a.server_nofile.split(",")]:
        for n in [int(x) for x in a.clients.split(",")]:
            row = run(n, a.procs, nofile, a.timeout_s)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    import torch

    stamp = datetime.date.today().isoformat()
    lines = ["| clients | server soft nofile | connected | connect s | server fds | barrier s | note |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        note = r.get("error") or r.get("connect_error_sample") or r.get("barrier_error_sample") or ""
        lines.append(f"| {r['clients']} | {r['server_nofile']} | {r.get('connected', '-')} "
                     f"| {r.get('connect_s', 0):.2f} | {r.get('server_fds', '-')} "
                     f"| {'-' if r.get('barrier_s') is None else format(r['barrier_s'], '.2f')} | {note[:100]} |")
    text = (f"TCPStore scale {stamp}: code {git['commit']}{' (dirty)' if git['dirty'] else ''}; torch "
            f"{torch.__version__}, {os.cpu_count()} CPU(s), clients in {a.procs} processes on loopback\n\n"
            + "\n".join(lines) + "\n")
    payload = {"benchmark": "tcpstore-scale", "date": stamp, "provenance": git,
               "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                        "somaxconn": _read("/proc/sys/net/core/somaxconn")},
               "settings": {k: v for k, v in vars(a).items() if k != "out"}, "rows": rows}
    write_results(a.out, "tcpstore-scale", stamp, payload, text)
    return 0


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
