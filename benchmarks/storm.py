#!/usr/bin/env python3
"""Goodput under a storm of failures: kept / fault-free steps in the same time, torchrun beside elastic-rt (+ memory tier).

K nodes (`--nodes`, one launcher process each: elastic-rt on one etcd started here, torchrun with
`--rdzv-backend c10d`; `--nnodes K-1:K`; `--standalone` at K=1) of 2 workers of the example job
(launch/train_example.py, `--step-sleep` per step, `--hidden` sets its state), for `--duration` s
counted from the first step all K nodes trained together. The storm (`--storm`):

  worker  local rank 1 of the last node SIGKILLed every `--kill-every` s (default 30)
  node    a whole node (its launcher and every process under it) SIGKILLed every `--kill-every` s
          (default 60) and started again at once, as a Kubernetes or Slurm replacement would: the job
          shrinks to K-1 nodes, then grows back. Victims rotate over n1..n{K-1} (n0 hosts torchrun's
          c10d store, whose loss ends a torchrun job; elastic-rt's runs lose the same nodes)

Configurations, one run each, in this order:

  fault-free         elastic-rt, no kill: the steps the job makes in `--duration` s
  torchrun           torchrun --max-restarts 1000, checkpoints every --persist-every steps
  elastic-rt persist elastic-rt launch, checkpoints every --persist-every steps
  elastic-rt memory  the same, with --memory-every M --async-save (a snapshot in the node's memory tier
                     every M steps on the background thread, coalesced while one is in flight, replicated
                     to the next node of the ring)

Per run (storm_job.account): the steps kept at the end (a restart rolls the counter back to what it
restored), goodput = that / fault-free's, lost steps per failure (summed over the restarts a failure
caused: a node loss causes two, shrink and grow), restores by tier (the job's `restored_from`; the
first memory restore after a node loss read the lost node's shards from a replica), the seconds the
job did not train, and the most bytes one node's memory tier held. elastic-rt's crash-loop judge is
off (`--crash-loop-repeats 0 --crash-loop-no-step 0`): the kills come from outside.

    python benchmarks/storm.py [--nodes 3] [--storm node] [--duration 300] [--hidden 64] [--step-sleep 0]

Results: benchmarks/results/storm-DATE[-K].json and .txt, with the commit and the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import date

from checkpoint_restart import REPO
from provenance import provenance
from results_file import write_results
from storm_job import NPROC, StormJob, account, learning_rate

STATE_BYTES_PER_HIDDEN = 144  # the example's parameters and SGD momentum, float32: 2 x (16h + h + h + 1) x 4
CONFIGS = ("torchrun", "elastic-rt persist", "elastic-rt memory")


def run(name: str, args: argparse.Namespace, scratch: str, etcd_endpoint: str | None, secret_file: str, *,
        kill: bool) -> dict:
    job = StormJob(name, args, scratch, etcd_endpoint=etcd_endpoint, secret_file=secret_file)
    kills: list[tuple[float, str]] = []
    missed = 0
    try:
        try:
            t0 = job.wait_trained_together(args.startup_timeout)
        except TimeoutError as exc:
            print(exc, flush=True)
            return {**_result(name, job, account([], [], 0.0, 0.0), missed), "error": str(exc).splitlines()[0]}
        end = t0 + args.duration
        next_kill, victim = t0 + args.kill_every, 0
        while time.monotonic() < end:
            if kill and time.monotonic() >= next_kill:
                if args.storm == "node":
                    node = 1 + victim % (args.nodes - 1)
                    victim += 1
                    kills.append((job.replace_node(node), "node"))
                else:
                    try:
                        job.kill_worker(args.nodes - 1)
                        kills.append((time.monotonic(), "worker"))
                    except Exception as exc:  # between restarts: no worker 1 yet; the next try kills it
                        missed += 1
                        print(f"{name}: no kill at {time.monotonic() - t0:.1f} s ({exc})", flush=True)
                next_kill += args.kill_every
            time.sleep(0.05)
        job.sample_tiers()
        lines = job.lines()
    finally:
        job.close()
    got = account(lines, kills, t0, end)
    print(f"{name}: {got['steps_reached']} steps, {got['kills']} kills, lost {got['lost_per_failure']}, "
          f"restores {got['restores_by_tier']}", flush=True)
    return _result(name, job, got, missed)


def _result(name: str, job: StormJob, got: dict, missed: int) -> dict:
    """One run's entry in the results: what account() read from its lines, and the job's own figures."""
    return {"name": name, **got, "missed_kills": missed, "tier_max_bytes": job.tier_max,
            "logs": [n.log_path for n in job.launched]}


def _row(r: dict) -> str:
    lost = r["lost_per_failure"]
    tiers = ", ".join(f"{k} {v}" for k, v in sorted(r["restores_by_tier"].items())) or "-"
    tier_gib = (f"{r['tier_max_bytes']['own'] / 2**30:.3f} / {r['tier_max_bytes']['replicas'] / 2**30:.3f}"
                if r["tier_max_bytes"]["own"] else "-")
    return (f"| {r['name']} | {r['steps_reached']} | {r['kills']} | {r['kills_without_restart']} | "
            f"{r['goodput']:.3f} | "
            f"{statistics.median(lost) if lost else '-'} | {max(lost) if lost else '-'} | {lost} | {tiers} | "
            f"{r['no_training_s']} | {tier_gib} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1, help="launcher processes, one node each (2 workers per node)")
    p.add_argument("--storm", choices=("worker", "node"), default="worker")
    p.add_argument("--duration", type=float, default=90.0)
    p.add_argument("--kill-every", type=float, default=None, help="seconds between kills (30 worker, 60 node)")
    p.add_argument("--persist-every", type=int, default=50)
    p.add_argument("--memory-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=64, help="the example model's hidden width: its state is "
                   "144 x hidden bytes per rank (parameters and SGD momentum, float32); 7456540 for 1 GiB")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--configs", default=",".join(CONFIGS), help="which of the runs under the storm, after fault-free")
    p.add_argument("--keep-logs", action="store_true", help="keep the launchers' logs (the folder is printed)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args()
    if args.nodes < 1 or (args.storm == "node" and args.nodes < 2):
        raise SystemExit(f"storm.py: --nodes {args.nodes}: a node storm needs at least 2 nodes, any storm 1")
    args.kill_every = args.kill_every or (60.0 if args.storm == "node" else 30.0)
    prov = provenance(args.allow_dirty)
    load_before = list(os.getloadavg())
    scratch = tempfile.mkdtemp(prefix="elastic-rt-storm-")
    os.makedirs(os.path.join(scratch, "tmp"))
    os.environ["TMPDIR"] = os.path.join(scratch, "tmp")  # the launchers' own (a SIGKILLed agent leaves its folders)
    secret_file = os.path.join(scratch, "secret")
    with open(secret_file, "w") as f:
        f.write(os.urandom(16).hex())
    etcd = None
    runs: list[dict] = []
    try:
        if args.nodes > 1:
            sys.path.insert(0, REPO)
            from etcd_testbed.server import EtcdCluster

            etcd = EtcdCluster(1).start()
        endpoint = etcd.endpoints if etcd else None
        runs.append(run("fault-free", args, scratch, endpoint, secret_file, kill=False))
        for name in [c for c in CONFIGS if c in args.configs.split(",")]:
            runs.append(run(name, args, scratch, endpoint, secret_file, kill=True))
    finally:
        if etcd is not None:
            etcd.stop()
        if args.keep_logs:
            print(f"logs kept in {scratch}", flush=True)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    base = runs[0]["steps_reached"]
    for r in runs:
        r["goodput"] = r["steps_reached"] / base if base else 0.0
        # where the fault-free run's steps went: time not training (at the fault-free pace), steps re-done,
        # and the rest (slower steps: snapshots, the load, fewer nodes while shrunk)
        idle = r["no_training_s"] * base / args.duration
        redone = sum(r["lost_per_failure"])
        r["shortfall"] = {"idle_steps": round(idle, 1), "redone_steps": redone,
                          "slower_steps": round(base - r["steps_reached"] - idle - redone, 1)}
    load_after = list(os.getloadavg())
    state = STATE_BYTES_PER_HIDDEN * args.hidden
    text = "\n".join([
        f"{args.storm} storm: {args.nodes} node(s) x {NPROC} workers, example job (--step-sleep {args.step_sleep}, "
        f"--hidden {args.hidden}: {state / 2**30:.3g} GiB of model state per rank, parameters and momentum, "
        f"replicated by DDP, --lr {learning_rate(args.hidden):g}), "
        + ("local rank 1 of the last node SIGKILLed" if args.storm == "worker" else
           "a node (n1..n{K-1} in turn) SIGKILLed and started again".replace("{K-1}", str(args.nodes - 1)))
        + f" every {args.kill_every:g} s for {args.duration:g} s; persist every {args.persist_every} steps, memory "
        f"tier every {args.memory_every}; commit {prov['commit'][:10]}{' (dirty)' if prov['dirty'] else ''}",
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (2 shared cores)",
        "",
        "| run | steps kept | kills | kills with no restart after | goodput | median lost steps per failure | max | "
        "lost per failure | restores by tier | s not training | tier GiB per node: own / replicas (max) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|",
        *(_row(r) for r in runs),
        "",
        "Where the fault-free run's steps went: not training (restarts, at the fault-free pace), re-done after a "
        "rollback, and the rest (slower steps: snapshots, the load, the smaller world while a node was away); "
        "median worker start to rank 0's start line (process group, model, restore) per restart.",
        "",
        "| run | fault-free steps | kept | not training | re-done | slower | median worker init s |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(f"| {r['name']} | {base} | {r['steps_reached']} | {r['shortfall']['idle_steps']} | "
          f"{r['shortfall']['redone_steps']} | {r['shortfall']['slower_steps']} | "
          f"{r.get('median_worker_init_s') if r.get('median_worker_init_s') is not None else '-'} |"
          for r in runs[1:]),
    ]) + "\n"
    write_results(args.out, "storm", date.today().isoformat(), {"args": vars(args), "runs": runs, "provenance": prov,
                                                                 "state_bytes_per_rank": state,
                                                                 "load_before": load_before, "load_after": load_after},
                  text)


if __name__ == "__main__":
    main()
