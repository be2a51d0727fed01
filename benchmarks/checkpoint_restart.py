#!/usr/bin/env python3
"""Restarts with checkpoints: from a kill to the first training step after it, this tree's code beside another ref's.

The example job (launch/train_example.py) checkpoints every --save-every steps under `elastic-rt launch`
and is killed after its first commit:

  worker   one node (--standalone), 2 workers: local rank 1 is SIGKILLed; the agent restarts both workers,
           which load the checkpoint (the new rank 0 is another process of the same job)
  node     two nodes on one etcd (--nnodes 1:2, 1 worker each): the node hosting rank 0 is SIGKILLed; the
           survivor re-forms alone, and its worker, rank 0 of a newer round, loads the checkpoint and saves

Measured per trial, from the kill: `restart s` until the restarted job's `start step=K` line (it has loaded
step K), `first step s` until its first training step after that. The trees alternate trial by trial (this
checkout at HEAD, and --baseline, main by default, exported with `git archive`), so that the shared
machine's drift hits both alike; medians and the ratio this / baseline are reported. The checkpoint layer's
part of a restart is the manager's construction (the writer lease: at once for the same job, or a wait)
and load_latest; everything else (rendezvous, process start, imports) is the same code in both trees.

    python benchmarks/checkpoint_restart.py [--trials 3] [--baseline main] [--scenarios worker,node]

Results: benchmarks/results/checkpoint-restart-DATE[-K].json and .txt, with both commits and the load average.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import date

import psutil

from provenance import provenance  # benchmarks/provenance.py (this script's directory is on sys.path)
from results_file import write_results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
SCRIPT = os.path.join("launch", "train_example.py")
STEP_RE = re.compile(r"\]:step=(\d+) loss=")
START_RE = re.compile(r"\]:start step=(\d+) world_size=(\d+)")
SAVED_RE = re.compile(r"\]:checkpoint saved step=(\d+) ")
STARTED_RE = re.compile(r"\] started local rank\(s\)")  # the agent started the restarted workers


class Launcher:
    """One `elastic-rt launch` of a tree's code, in a session of its own; its output lines with their times."""

    def __init__(self, tree: str, args: list[str], log_path: str, *, launcher: tuple[str, ...] = ()) -> None:
        """`launcher`: the command before `args` (default `python -m elastic_rt.cli launch`)."""
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=tree, PYTHONUNBUFFERED="1")
        env.pop("ELASTIC_RT_CHECKPOINT_URL", None)
        command = list(launcher or (sys.executable, "-m", "elastic_rt.cli", "launch"))
        self.proc = subprocess.Popen([*command, *args], cwd=tree, env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True, errors="replace")
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                t = time.monotonic()
                log.write(f"{t:.3f} {line}")
                with self._cond:
                    self.lines.append((t, line.rstrip("\n")))
                    self._cond.notify_all()

    def wait_for(self, rx: re.Pattern, timeout_s: float, *, after: float = 0.0) -> tuple[float, re.Match]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for t, line in self.lines:
                    if t >= after and (m := rx.search(line)):
                        return t, m
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    tail = "\n".join(line for _, line in self.lines[-15:])
                    raise TimeoutError(f"no line matching {rx.pattern!r} within {timeout_s:g} s:\n{tail}")
                self._cond.wait(0.5)

    def matches(self, rx: re.Pattern) -> list[re.Match]:
        with self._cond:
            return [m for _, line in self.lines if (m := rx.search(line))]

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def worker(self, local_rank: int) -> psutil.Process:
        for p in self.tree()[1:]:
            try:
                env = p.environ()
                if env.get("LOCAL_RANK") == str(local_rank) and "RANK" in env:
                    return p
            except psutil.Error:
                continue
        raise RuntimeError(f"no worker with LOCAL_RANK={local_rank}")

    def kill(self) -> float:
        """SIGKILL the agent and every process under it (workers run in sessions of their own)."""
        procs = self.tree()
        t = time.monotonic()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        return t


def _after_kill(node: Launcher, killed_at: float, timeout_s: float) -> dict:
    t_start, m = node.wait_for(START_RE, timeout_s, after=killed_at)
    resumed = int(m.group(1))
    step_rx = re.compile(rf"\]:step=({resumed + 1}) loss=")
    t_step, _ = node.wait_for(step_rx, timeout_s, after=t_start)
    started = [t for t, line in node.lines if killed_at <= t <= t_start and STARTED_RE.search(line)]
    return {"restart_s": t_start - killed_at, "first_step_s": t_step - killed_at, "resumed_step": resumed,
            "world_size": int(m.group(2)),
            # the workers' own start: process group, model, CheckpointManager (writer lease), load_latest
            "worker_init_s": t_start - started[-1] if started else None}


def job(url: str, save_every: int) -> list[str]:
    return [SCRIPT, "--steps", "100000", "--save-every", str(save_every), "--step-sleep", "0.05", "--ckpt-url", url]


def trial_worker(tree: str, scratch: str, args: argparse.Namespace) -> dict:
    node = Launcher(tree, ["--standalone", "--nproc-per-node", "2", "--metrics-port", "0", "--tee", "3",
                           *job(f"file://{scratch}/ckpt", args.save_every)], f"{scratch}/node.log")
    try:
        node.wait_for(SAVED_RE, args.startup_timeout)
        victim = node.worker(1)
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        return _after_kill(node, killed_at, args.recovery_timeout)
    finally:
        node.kill()


def trial_node(tree: str, scratch: str, args: argparse.Namespace, endpoint: str) -> dict:
    run_id = f"ckrestart-{uuid.uuid4().hex[:8]}"
    nodes = [Launcher(tree, ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id",
                             run_id, "--node-id", name, "--local-addr", "127.0.0.1", "--metrics-port", "0",
                             "--tee", "3", "--rdzv-conf", "last_call_timeout=3",
                             *job(f"file://{scratch}/ckpt", args.save_every)], f"{scratch}/{name}.log")
             for name in ("a", "b")]
    try:
        deadline = time.monotonic() + args.startup_timeout
        started_2 = re.compile(r"\]:start step=\d+ world_size=2 ")
        while not (leaders := [n for n in nodes if n.matches(started_2)]):  # rank 0 of the group of 2 prints
            if time.monotonic() > deadline:
                raise TimeoutError("no group of 2 formed")
            time.sleep(0.1)
        leader = leaders[0]
        t_formed, _ = leader.wait_for(started_2, 1)
        leader.wait_for(SAVED_RE, max(1.0, deadline - time.monotonic()), after=t_formed)
        survivor = nodes[1] if leader is nodes[0] else nodes[0]
        killed_at = leader.kill()
        return _after_kill(survivor, killed_at, args.recovery_timeout)
    finally:
        for n in nodes:
            n.kill()


def export_tree(ref: str, into: str) -> str:
    commit = subprocess.run(["git", "rev-parse", ref], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return commit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--baseline", default="main", help="git ref whose code runs beside this checkout's")
    p.add_argument("--scenarios", default="worker,node")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--recovery-timeout", type=float, default=180.0)
    p.add_argument("--results-dir", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--keep-logs", action="store_true", help="keep each trial's launcher logs (the path is printed)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="run on a working tree with uncommitted changes (recorded in the results)")
    args = p.parse_args()
    prov = provenance(args.allow_dirty)
    scenarios = [s for s in args.scenarios.split(",") if s]
    scratch = tempfile.mkdtemp(prefix="elastic-rt-ckrestart-")
    baseline_dir = os.path.join(scratch, "baseline")
    os.makedirs(baseline_dir)
    baseline_commit = export_tree(args.baseline, baseline_dir)
    trees = {"this": REPO, "baseline": baseline_dir}
    etcd = None
    rows: list[dict] = []
    try:
        if "node" in scenarios:
            from etcd_testbed.server import EtcdCluster
            etcd = EtcdCluster(1).start()
        for scenario in scenarios:
            for i in range(args.trials):
                order = ("this", "baseline") if i % 2 == 0 else ("baseline", "this")
                for which in order:
                    where = os.path.join(scratch, f"{scenario}-{which}-{i}")
                    os.makedirs(where)
                    load = os.getloadavg()[0]
                    try:
                        if scenario == "worker":
                            got = trial_worker(trees[which], where, args)
                        else:
                            got = trial_node(trees[which], where, args, etcd.endpoints)
                        row = {"scenario": scenario, "tree": which, "trial": i, "ok": True, **got}
                    except (TimeoutError, RuntimeError) as exc:
                        row = {"scenario": scenario, "tree": which, "trial": i, "ok": False, "error": str(exc)}
                    row["loadavg1_at_start"] = load
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
                    if not args.keep_logs:
                        shutil.rmtree(where, ignore_errors=True)
    finally:
        if etcd is not None:
            etcd.stop()
        if args.keep_logs:
            print(f"logs kept in {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    summary, lines = [], [f"kill -> restarted job's start line / first step after it, medians of {args.trials} "
                          f"trials per tree; this {prov['commit'][:12]} vs baseline {args.baseline} "
                          f"{baseline_commit[:12]}", "",
                          "| scenario | tree | trials ok | restart s | first step s | worker init s | resumed step | load1 |",
                          "|---|---|--:|--:|--:|--:|--:|--:|"]
    for scenario in scenarios:
        med = {}
        for which in ("this", "baseline"):
            ok = [r for r in rows if r["scenario"] == scenario and r["tree"] == which and r["ok"]]
            all_ = [r for r in rows if r["scenario"] == scenario and r["tree"] == which]
            entry = {"scenario": scenario, "tree": which, "trials": len(all_), "ok": len(ok),
                     "restart_s_median": statistics.median(r["restart_s"] for r in ok) if ok else None,
                     "first_step_s_median": statistics.median(r["first_step_s"] for r in ok) if ok else None,
                     "worker_init_s_median": (statistics.median(inits) if (inits := [r["worker_init_s"] for r in ok
                                              if r["worker_init_s"] is not None]) else None),
                     "loadavg1_median": statistics.median(r["loadavg1_at_start"] for r in all_)}
            summary.append(entry)
            med[which] = entry
            fmt = (lambda v: f"{v:.2f}" if v is not None else "-")
            lines.append(f"| {scenario} | {which} | {len(ok)}/{len(all_)} | {fmt(entry['restart_s_median'])} | "
                         f"{fmt(entry['first_step_s_median'])} | {fmt(entry['worker_init_s_median'])} | "
                         f"{','.join(str(r['resumed_step']) for r in ok)} | "
                         f"{entry['loadavg1_median']:.1f} |")
        this, base = med["this"]["first_step_s_median"], med["baseline"]["first_step_s_median"]
        if this and base:
            ratio = this / base
            summary.append({"scenario": scenario, "first_step_ratio_this_over_baseline": ratio})
            lines.append(f"{scenario}: first step after the kill, this / baseline = {ratio:.2f}")
    text = "\n".join(lines) + "\n"
    text += f"load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)\n"
    payload = {"provenance": prov, "baseline": {"ref": args.baseline, "commit": baseline_commit},
               "settings": {k: v for k, v in vars(args).items() if k != "results_dir"}, "summary": summary,
               "trials": rows, "loadavg_at_end": list(os.getloadavg()), "cpus": os.cpu_count()}
    write_results(args.results_dir, "checkpoint-restart", date.today().isoformat(), payload, text)


if __name__ == "__main__":
    main()
