#!/usr/bin/env python3
"""Warm restarts: recovery with warm workers on and off beside torchrun, and checkpoint restore from
host memory vs storage vs a raw read of the same bytes.

recovery   worker loss (1 node x 2 workers, local rank 1 SIGKILLed) and node loss (2 agents x 1
           worker on etcd, --nnodes 1:2, the node without rank 0 SIGKILLed): seconds from the kill
           to the first step completed after recovery (benchmarks/recovery.py's method and
           helpers). With warm workers on, the fault is injected once the refilled warm workers
           are ready (the agent logs it), so the figure is the warm path's. Trials alternate
           between scenarios (A/B/C, A/B/C, ...); the load average is recorded per trial.
restore    --size-gib of state over 2 ranks (each rank 1/2 in 8 tensors), one committed save on
           --dir; then, alternating per repetition: raw read (each rank reads its shard file),
           restore from storage (load_latest, host cache off), both with the file's pages dropped
           from the page cache (posix_fadvise DONTNEED: a disk read) and again from the page cache;
           restore from host memory (load_latest, copies in /dev/shm). Max over ranks, medians.

    python benchmarks/warm_restart.py [--part recovery|restore|all] [--trials 3] [--json PATH] [--allow-dirty]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

READY = "warm workers ready for local rank"


# ---- recovery ------------------------------------------------------------------------------------
def recovery_scenarios():
    from recovery_harness import Scenario

    return [
        Scenario("worker/ert-warm", "worker", "elastic-rt", "standalone", "local rank 1"),
        Scenario("worker/ert-cold", "worker", "elastic-rt", "standalone", "local rank 1"),
        Scenario("worker/torchrun", "worker", "torchrun", "standalone (c10d)", "local rank 1"),
        Scenario("node/ert-warm", "node", "elastic-rt", "etcd-v3", "non-rank0"),
        Scenario("node/ert-cold", "node", "elastic-rt", "etcd-v3", "non-rank0"),
        Scenario("node/torchrun", "node", "torchrun", "c10d", "non-host"),
    ]


def _with_warm(cmd: list[str], key: str) -> list[str]:
    at = cmd.index("launch") + 1
    return cmd[:at] + ["--warm-workers", "on" if key.endswith("-warm") else "off"] + cmd[at:]


def make_bench(args):
    from recovery_harness import Bench

    class WarmBench(Bench):
        """recovery.py's Bench with the warm-workers flag of the scenario on elastic-rt's command line."""

        def worker_cmd(self, sc, rdzv_id):
            cmd = super().worker_cmd(sc, rdzv_id)
            return cmd if sc.launcher == "torchrun" else _with_warm(cmd, sc.key)

        def node_cmd(self, sc, rdzv_id, node, port):
            cmd = super().node_cmd(sc, rdzv_id, node, port)
            return cmd if sc.launcher == "torchrun" else _with_warm(cmd, sc.key)

    return WarmBench(args)


def _wait_running(tr, names: list[str], *, warmup: int, world: str | None, ready: bool, deadline: float):
    """Until every node in `names` logged step >= warmup (at `world` if given; rank 0's node prints
    the steps) and, with warm workers, a refill after the first step is ready on every node.
    Returns (seconds from the trial start to the first step, the node printing steps)."""
    from recovery_harness import STEP_RE, TrialFailed

    first, stepping, refilled, printer = None, False, set(), None
    while not (stepping and (not ready or refilled >= set(names))):
        ev = tr.next(deadline)
        if ev.text is None:
            raise TrialFailed(f"{ev.src} exited (rc={tr.nodes[ev.src].proc.wait()}) before training")
        m = STEP_RE.search(ev.text)
        if m and (world is None or m[2] == world):
            first = first or ev.t
            printer = ev.src
            stepping = stepping or int(m[1]) >= warmup
        if READY in ev.text and first is not None:
            refilled.add(ev.src)
    return first, printer


def ert_trial(bench, sc, i: int):
    """elastic-rt worker or node loss; the same code for warm on and off."""
    from recovery_harness import Deadline, Trial, TrialFailed, TrialResult

    a, warm = bench.args, sc.key.endswith("-warm")
    with Trial(bench, sc.label(i)) as tr:
        t0 = time.monotonic()
        deadline = t0 + a.startup_timeout
        rdzv_id = f"{bench.run_tag}-{sc.label(i)}"
        names = ["node0"] if sc.fault == "worker" else ["nodeA", "nodeB"]
        for name in names:
            cmd = bench.worker_cmd(sc, rdzv_id) if sc.fault == "worker" else bench.node_cmd(sc, rdzv_id, name, 0)
            tr.start(name, cmd)
        try:
            first, printer = _wait_running(tr, names, warmup=a.warmup_steps, ready=warm, deadline=deadline,
                                           world=None if sc.fault == "worker" else "2")
        except Deadline:
            raise TrialFailed(f"not running (warm workers ready: {warm}) within {a.startup_timeout:g} s") from None
        load = os.getloadavg()[0]
        if sc.fault == "worker":
            victims = [w for w in tr.nodes["node0"].workers() if w.environ().get("LOCAL_RANK") == str(a.kill_local_rank)]
            if not victims:
                raise TrialFailed("no worker with the local rank to kill")
            t_kill = time.monotonic()
            victims[0].kill()
            res = TrialResult("timeout", victim=f"local rank {a.kill_local_rank} (pid {victims[0].pid})",
                              cold_start_s=first - t0)
            res.detail = f"load {load:.1f}"
            return bench._await_recovery(tr, res, t_kill, a.worker_timeout, survivor="node0", world=None)
        victim = "nodeB" if printer == "nodeA" else "nodeA"
        survivor = printer
        t_kill = tr.nodes[victim].kill()
        res = TrialResult("timeout", victim=victim, rank0_node=printer, cold_start_s=first - t0)
        res.detail = f"load {load:.1f}"
        return bench._await_recovery(tr, res, t_kill, a.node_timeout, survivor=survivor, world="1")


def run_recovery(args) -> dict:
    from recovery import summarize
    from recovery_harness import TrialFailed, TrialResult

    scenarios = [s for s in recovery_scenarios() if any(s.key.startswith(w) for w in args.scenarios.split(","))]
    bench = make_bench(args)
    try:
        for i in range(args.trials):  # alternating: A, B, C, A, B, C, ...
            for sc in scenarios:
                print(f"{sc.key} trial {i + 1}/{args.trials} (load {os.getloadavg()[0]:.1f}) ...", end=" ",
                      file=sys.stderr, flush=True)
                try:
                    if sc.launcher == "torchrun":
                        res = (bench.worker_trial if sc.fault == "worker" else bench.node_trial)(sc, i)
                        res.detail = (res.detail + " " if res.detail else "") + f"load {os.getloadavg()[0]:.1f}"
                    else:
                        res = ert_trial(bench, sc, i)
                except TrialFailed as exc:
                    res = TrialResult("error", detail=str(exc))
                sc.results.append(res)
                print(f"{res.outcome} {res.recovery_s if res.recovery_s is None else round(res.recovery_s, 2)} s",
                      file=sys.stderr, flush=True)
    finally:
        bench.close()
    summary = summarize(scenarios, args)
    rows = summary["rows"]
    by = {r["scenario"]: r["median_s"] for r in rows}
    for fault in ("worker", "node"):
        warm, cold, tr = by.get(f"{fault}/ert-warm"), by.get(f"{fault}/ert-cold"), by.get(f"{fault}/torchrun")
        summary.setdefault("warm_ratios", {})[fault] = {
            "warm/cold": warm / cold if warm and cold else None,
            "warm/torchrun": warm / tr if warm and tr else None,
        }
    return summary


def print_recovery(summary: dict) -> None:
    head = ["scenario", "ok/n", "median s", "min s", "max s", "detect s", "cold start s", "loads"]
    lines = []
    for r in summary["rows"]:
        loads = ",".join(x["detail"].split("load ")[-1] for x in r["results"] if "load " in x["detail"])
        fmt = (lambda v: "-" if v is None else f"{v:.2f}")
        lines.append([r["scenario"], f"{r['recovered']}/{r['trials']}", fmt(r["median_s"]), fmt(r["min_s"]),
                      fmt(r["max_s"]), fmt(r["median_detect_s"]), fmt(r["median_cold_start_s"]), loads])
    _table(head, lines)
    for fault, ratios in summary.get("warm_ratios", {}).items():
        text = ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in ratios.items())
        print(f"  {fault} loss: {text}")


# ---- restore -------------------------------------------------------------------------------------
TENSORS = 8


def _drop_page_cache(directory: str) -> None:
    for dirpath, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _read_file(path: str) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            n += len(chunk)
    return n


def restore_worker(rank: int, world_size: int, root: str, cache: str, size_bytes: int, reps: int) -> dict:
    import glob

    import torch
    import torch.distributed as dist

    from elastic_rt.checkpoint import CheckpointManager
    from elastic_rt.worker_env import ENV_HOST_CACHE_DIR

    torch.set_num_threads(1)
    rows = size_bytes // world_size // TENSORS // 4 // 4096
    gen = torch.Generator().manual_seed(rank)
    saved = {f"r{rank}.t{i}": torch.randn(rows, 4096, generator=gen) for i in range(TENSORS)}
    url = f"file://{root}/ckpt"
    os.environ.pop(ENV_HOST_CACHE_DIR, None)
    storage = CheckpointManager(url, collective_timeout_s=600.0)
    os.environ[ENV_HOST_CACHE_DIR] = cache
    memory = CheckpointManager(url, collective_timeout_s=600.0)
    memory.save(1, {"model": saved})
    memory.wait()
    memory._host_cache.wait()  # the copy into /dev/shm, normally in the background
    shard = glob.glob(f"{root}/ckpt/step_00000001/__{rank}_0.distcp")[0]
    target = {"model": {k: torch.empty_like(v) for k, v in saved.items()}}

    def timed(fn, drop: bool) -> float:
        dist.barrier()
        if drop and rank == 0:
            _drop_page_cache(f"{root}/ckpt")
        dist.barrier()
        t = time.perf_counter()
        fn()
        took = time.perf_counter() - t
        dist.barrier()
        return took

    def check() -> None:
        if not all(torch.equal(target["model"][k], v) for k, v in saved.items()):
            raise RuntimeError("restored state differs from the saved one")
        for v in target["model"].values():
            v.zero_()

    methods = {
        "raw read (disk)": (lambda: _read_file(shard), True, False),
        "storage restore (disk)": (lambda: storage.load_latest(target), True, True),
        "raw read (page cache)": (lambda: _read_file(shard), False, False),
        "storage restore (page cache)": (lambda: storage.load_latest(target), False, True),
        "host memory restore": (lambda: memory.load_latest(target), False, True),
    }
    out: dict[str, list[float]] = {k: [] for k in methods}
    names = list(methods)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            fn, drop, restores = methods[name]
            if not drop and "page cache" in name:
                _read_file(shard)  # make sure it is cached
            out[name].append(timed(fn, drop))
            if restores:
                check()
    storage.close()
    memory.close()
    return {"times": out, "bytes": sum(v.numel() * 4 for v in saved.values())}


def run_restore(args) -> dict:
    from gloo_world import run_world

    root = tempfile.mkdtemp(prefix="elastic-rt-restore-", dir=args.dir)
    cache = tempfile.mkdtemp(prefix="elastic-rt-bench-", dir="/dev/shm")
    try:
        load = os.getloadavg()[0]
        results = run_world(restore_worker, 2, root, cache, int(args.size_gib * (1 << 30)), args.reps,
                            timeout_s=3600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    total = sum(r["bytes"] for r in results)
    table = {}
    for name in results[0]["times"]:
        per_rep = [max(r["times"][name][i] for r in results) for i in range(args.reps)]
        med = statistics.median(per_rep)
        table[name] = {"median_s": med, "all_s": per_rep, "gib_per_s": total / (1 << 30) / med}
    raw_disk = table["raw read (disk)"]["median_s"]
    raw_cache = table["raw read (page cache)"]["median_s"]
    return {"bytes": total, "load_before": load, "load_after": os.getloadavg()[0], "table": table,
            "ratios": {"storage (disk) / raw read (disk)": table["storage restore (disk)"]["median_s"] / raw_disk,
                       "storage (page cache) / raw read (page cache)":
                           table["storage restore (page cache)"]["median_s"] / raw_cache,
                       "memory / storage (disk)": table["host memory restore"]["median_s"]
                       / table["storage restore (disk)"]["median_s"]}}


def print_restore(res: dict) -> None:
    print(f"restore of {res['bytes'] / (1 << 30):.2f} GiB over 2 ranks (load {res['load_before']:.1f} -> "
          f"{res['load_after']:.1f}):")
    _table(["method", "median s", "GiB/s", "all s"],
           [[k, f"{v['median_s']:.3f}", f"{v['gib_per_s']:.2f}", " ".join(f"{x:.3f}" for x in v["all_s"])]
            for k, v in res["table"].items()])
    for k, v in res["ratios"].items():
        print(f"  {k}: {v:.2f}")


def _table(head: list[str], lines: list[list[str]]) -> None:
    widths = [max(len(str(row[i])) for row in [head] + lines) for i in range(len(head))]
    for row in [head] + lines:
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def parse_args(argv=None) -> argparse.Namespace:
    from recovery import parse_args as recovery_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", default="all", choices=("recovery", "restore", "all"))
    p.add_argument("--scenarios", default="worker,node", help="recovery scenario prefixes (worker, node)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="storage directory for the restore part (default $TMPDIR)")
    p.add_argument("--json", default=None)
    p.add_argument("-v", "--verbose", action="store_true")
    args, rest = p.parse_known_args(argv)
    # recovery.py's settings (timeouts, step sleep, warm-up steps) with its defaults
    base = recovery_args(["--trials", str(args.trials)] + rest + (["-v"] if args.verbose else []))
    for k, v in vars(base).items():
        if not hasattr(args, k):
            setattr(args, k, v)
    return args


def main(argv=None) -> int:
    from provenance import provenance

    args = parse_args(argv)
    out: dict = {"provenance": provenance(args.allow_dirty),  # refuses uncommitted changes unless allowed
                 "loadavg_start": os.getloadavg(), "cpus": os.cpu_count(), "id": uuid.uuid4().hex[:8]}
    if args.part in ("recovery", "all"):
        out["recovery"] = run_recovery(args)
    if args.part in ("restore", "all"):
        out["restore"] = run_restore(args)
    out["loadavg_end"] = os.getloadavg()
    print(f"\nwarm restart benchmark, {os.cpu_count()} CPU(s), load {out['loadavg_start'][0]:.1f} -> "
          f"{out['loadavg_end'][0]:.1f}")
    if "recovery" in out:
        print_recovery(out["recovery"])
    if "restore" in out:
        print_restore(out["restore"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
