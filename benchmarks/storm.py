#!/usr/bin/env python3
"""Goodput under a worker storm: kept / fault-free steps in the same wall time, torchrun beside elastic-rt (+ memory tier).

One node, 2 workers of the example job (launch/train_example.py, `--step-sleep` per step), a worker
(local rank 1) SIGKILLed every `--kill-every` seconds for `--duration` seconds, counted from the first
training step. Configurations, one run each, in this order:

  fault-free         elastic-rt launch, no kill: the steps the job makes in `--duration` s
  torchrun           torchrun --standalone --max-restarts 100, checkpoints every --persist-every steps
  elastic-rt persist elastic-rt launch --standalone, checkpoints every --persist-every steps
  elastic-rt memory  the same, with --memory-every M --async-save (a snapshot in the node's memory tier
                     every M steps on the background thread, coalesced while one is in flight)

Per run: the step reached `--duration` s after the first step (kept steps: a restart rolls the step
counter back to what it restored), goodput = that / fault-free's, and per failure the lost steps (the
last step printed before the kill minus the step the restart resumed from). One node, so the memory
tier has no replica here: a node storm (replicas) is not part of this benchmark.

    python benchmarks/storm.py [--duration 90] [--kill-every 30] [--persist-every 50] [--memory-every 5] [--hidden 64]

Results: benchmarks/results/storm-DATE[-K].json and .txt, with the commit and the load average.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from datetime import date

from checkpoint_restart import REPO, SCRIPT, START_RE, STEP_RE, Launcher
from provenance import provenance
from results_file import write_results


def _job(args: argparse.Namespace, url: str, memory: bool) -> list[str]:
    return [SCRIPT, "--steps", "100000000", "--save-every", str(args.persist_every), "--step-sleep",
            str(args.step_sleep), "--hidden", str(args.hidden), "--ckpt-url", url,
            *(["--memory-every", str(args.memory_every), "--async-save"] if memory else [])]


def run(name: str, args: argparse.Namespace, scratch: str, *, kill: bool) -> dict:
    url = f"file://{scratch}/{name.replace(' ', '-')}"
    log = f"{scratch}/{name.replace(' ', '-')}.log"
    if name == "torchrun":
        node = Launcher(REPO, ["--standalone", "--nproc-per-node", "2", "--max-restarts", "100", "--tee", "3",
                               *_job(args, url, False)], log, launcher=(sys.executable, "-m", "torch.distributed.run"))
    else:
        node = Launcher(REPO, ["--standalone", "--nproc-per-node", "2", "--metrics-port", "0", "--tee", "3",
                               "--max-restarts", "100", *_job(args, url, name.endswith("memory"))], log)
    kills: list[float] = []
    try:
        t0, _ = node.wait_for(re.compile(r"\]:step=1 loss="), args.startup_timeout)
        end = t0 + args.duration
        next_kill = t0 + args.kill_every
        while time.monotonic() < end:
            if kill and time.monotonic() >= next_kill:
                try:
                    node.worker(1).send_signal(signal.SIGKILL)
                    kills.append(time.monotonic())
                except Exception as exc:  # between restarts: no worker 1 yet; the next try kills it
                    print(f"{name}: no kill at {time.monotonic() - t0:.1f} s ({exc})", flush=True)
                next_kill += args.kill_every
            time.sleep(0.05)
        steps = [(t, int(line_m.group(1))) for t, line in list(node.lines) if (line_m := STEP_RE.search(line))]
        starts = [(t, int(m.group(1))) for t, line in list(node.lines) if (m := START_RE.search(line))]
    finally:
        node.kill()
    reached = max((s for t, s in steps if t <= end), default=0)
    lost = []
    for k in kills:
        before = [s for t, s in steps if t <= k]
        after = [s for t, s in starts if t > k]
        if before and after:
            lost.append(max(before) - after[0])
    return {"name": name, "steps_reached": reached, "kills": len(kills), "lost_per_failure": lost}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=90.0)
    p.add_argument("--kill-every", type=float, default=30.0)
    p.add_argument("--persist-every", type=int, default=50)
    p.add_argument("--memory-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=64, help="the example model's hidden width: its state is "
                   "144 x hidden bytes (parameters and SGD momentum, float32); 7456540 for 1 GiB")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args()
    prov = provenance(args.allow_dirty)
    load_before = list(os.getloadavg())
    scratch = tempfile.mkdtemp(prefix="elastic-rt-storm-")
    try:
        runs = [run("fault-free", args, scratch, kill=False)]
        for name in ("torchrun", "elastic-rt persist", "elastic-rt memory"):
            runs.append(run(name, args, scratch, kill=True))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = runs[0]["steps_reached"]
    for r in runs:
        r["goodput"] = r["steps_reached"] / base if base else 0.0
    load_after = list(os.getloadavg())
    rows = [f"| {r['name']} | {r['steps_reached']} | {r['kills']} | {r['goodput']:.3f} | "
            f"{statistics.median(r['lost_per_failure']) if r['lost_per_failure'] else '-'} | "
            f"{r['lost_per_failure']} |" for r in runs]
    text = "\n".join([
        f"worker storm: 1 node x 2 workers, example job (--step-sleep {args.step_sleep}, --hidden {args.hidden}: "
        f"{144 * args.hidden / 2**30:.3g} GiB of state), local rank 1 SIGKILLed every "
        f"{args.kill_every:g} s for {args.duration:g} s; persist every {args.persist_every} steps, memory tier every "
        f"{args.memory_every}; commit {prov['commit'][:10]}{' (dirty)' if prov['dirty'] else ''}",
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (2 shared cores)",
        "",
        "| run | steps kept | kills | goodput | median lost steps per failure | lost per failure |",
        "|---|---:|---:|---:|---:|---|",
        *rows,
    ]) + "\n"
    write_results(args.out, "storm", date.today().isoformat(), {"args": vars(args), "runs": runs, "provenance": prov,
                                                                 "load_before": load_before, "load_after": load_after},
                  text)


if __name__ == "__main__":
    main()
