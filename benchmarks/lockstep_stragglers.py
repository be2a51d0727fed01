"""Naming the slow rank of a lock-step job: two elastic-rt agents on loopback (one etcd), one worker each,
a plain DDP script in a tight loop (no sleep, a gradient all-reduce every step, no elastic_rt import).
Per trial: a healthy phase (flags there are false positives), then one worker slowed by a CPU quota on
its process (cgroup; root), and the windows until its node names it. The slowed rank's step-time and
compute-time ratios at the flag show what each signal sees.

    PYTHONPATH=. python benchmarks/lockstep_stragglers.py [--trials 3] [--window 2] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import time
import urllib.request
import uuid

from elastic_rt.chaos import cpu_quota

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(REPO)  # etcd_testbed/: the repository's, not part of the installed package
from etcd_testbed.server import EtcdCluster, free_port  # noqa: E402

FLAG = r"\[{node} round \d+\] straggler: local rank (\d) (steps in|computes).* (\d+\.\d+)x the job median"


def _metric(port: int, name: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    m = re.search(rf"^{name}{{[^}}]*local_rank=\"0\"[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def trial(agents_mod, endpoint: str, args: argparse.Namespace, k: int) -> dict:
    run_id = f"ls-{uuid.uuid4().hex[:8]}"
    ports = {n: free_port() for n in "ab"}
    nodes = {}
    try:
        for n in "ab":
            nodes[n] = agents_mod.Agent([
                "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                "--node-id", n, "--local-addr", "127.0.0.1", "--metrics-port", str(ports[n]), "--tee", "3",
                "--warm-workers", "off", "--straggler-window", str(args.window), "--straggler-windows", "3",
                agents_mod.PLAIN_SCRIPT, "--steps", "100000000", "--hidden", "512", "--print-every", "100",
            ], tag=f"{run_id}/{n}")
        if nodes["a"].wait_for(r"\]:step=100 ", args.timeout) is None:
            raise RuntimeError("no training step:\n" + nodes["a"].text()[-3000:])
        deadline = time.monotonic() + args.timeout
        while _metric(ports["b"], "elastic_rt_compute_time_ratio") is None:  # the first verdict came
            if time.monotonic() > deadline:
                raise RuntimeError("no compute ratio exported:\n" + nodes["b"].text()[-3000:])
            time.sleep(0.5)
        healthy_from = time.monotonic()
        time.sleep(args.healthy_windows * args.window)
        healthy_to = time.monotonic()
        false_flags = sum(nodes[n].count(r"straggler: local rank") for n in "ab")  # any before the slowdown
        pid = _worker_pid(nodes["b"])
        with cpu_quota.CpuQuota(args.quota) as quota:
            quota.add(pid)
            slowed_at = time.monotonic()
            found = nodes["b"].wait_for(FLAG.format(node="b"), args.timeout, after=slowed_at)
            ratios = {"step_time": _metric(ports["b"], "elastic_rt_step_time_ratio"),
                      "compute_time": _metric(ports["b"], "elastic_rt_compute_time_ratio")}
        other_flags = nodes["a"].count(r"straggler: local rank", after=slowed_at)
    finally:
        for node in nodes.values():
            node.kill()
    detected_s = found[0] - slowed_at if found else None
    return {"trial": k, "healthy_windows": (healthy_to - healthy_from) / args.window,
            "false_positives_healthy": false_flags, "detected": found is not None,
            "detection_s": detected_s, "windows_to_detection": detected_s / args.window if detected_s else None,
            "signal": found[1].group(2) if found else None, "flag_ratio": float(found[1].group(3)) if found else None,
            "ratios_at_flag": ratios, "flags_on_the_healthy_node": other_flags,
            "loadavg1": os.getloadavg()[0]}


def _worker_pid(agent) -> int:
    import psutil

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in psutil.Process(agent.proc.pid).children():
            try:
                if "elastic_rt.worker.main" in " ".join(child.cmdline()) and "RANK" in child.environ():
                    return child.pid
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise RuntimeError("no worker process found")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--window", type=float, default=2.0, help="--straggler-window of the agents (seconds)")
    p.add_argument("--healthy-windows", type=int, default=15)
    p.add_argument("--quota", type=float, default=0.05, help="CPUs the slowed worker gets")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", default=None, help="write NAME-DATE.json/.txt into this directory (results file)")
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args()
    why = cpu_quota.available()
    if why:
        raise SystemExit(f"lockstep_stragglers: {why}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import agents
    from provenance import provenance
    from results_file import write_results

    git = provenance(args.allow_dirty) if args.out else None
    load_start = os.getloadavg()
    with EtcdCluster(1) as etcd:
        runs = []
        for k in range(args.trials):
            runs.append(trial(agents, etcd.endpoints, args, k))
            print(runs[-1], flush=True)
    detected = [r for r in runs if r["detected"]]
    windows = [r["windows_to_detection"] for r in detected]
    summary = {
        "trials": len(runs), "detected": len(detected),
        "windows_to_detection_median": statistics.median(windows) if windows else None,
        "windows_to_detection_max": max(windows) if windows else None,
        "healthy_windows_judged": sum(r["healthy_windows"] for r in runs),
        "false_positives_healthy": sum(r["false_positives_healthy"] for r in runs),
        "flags_on_the_healthy_node": sum(r["flags_on_the_healthy_node"] for r in runs),
        "compute_ratio_at_flag_median": statistics.median([r["ratios_at_flag"]["compute_time"] for r in detected
                                                           if r["ratios_at_flag"]["compute_time"]] or [0.0]),
        "step_ratio_at_flag_median": statistics.median([r["ratios_at_flag"]["step_time"] for r in detected
                                                        if r["ratios_at_flag"]["step_time"]] or [0.0]),
    }
    text = (f"lock-step stragglers: 2 agents x 1 worker, plain DDP (hidden 512, tight loop), window {args.window:g} s, "
            f"3 windows to flag, threshold 1.5; slowed worker: {args.quota:g} CPU; {args.trials} trials; load average "
            f"{load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end (shared machine)\n"
            f"  detected {summary['detected']} of {summary['trials']}; windows to detection median "
            f"{summary['windows_to_detection_median']:.2f}, max {summary['windows_to_detection_max']:.2f}\n"
            f"  healthy: {summary['false_positives_healthy']} flags in {summary['healthy_windows_judged']:.0f} windows "
            f"judged; after the slowdown, {summary['flags_on_the_healthy_node']} flags on the other node\n"
            f"  at the flag, the slowed rank's compute ratio {summary['compute_ratio_at_flag_median']:.2f}, its step "
            f"time ratio {summary['step_ratio_at_flag_median']:.2f} (medians)\n")
    if not args.out:
        print(text)
        return 0
    stamp = datetime.date.today().isoformat()
    payload = {"benchmark": "lockstep-stragglers", "date": stamp, "provenance": git, "settings": vars(args),
               "machine": {"cpus": os.cpu_count(), "loadavg_at_start": list(load_start),
                           "loadavg_at_end": list(os.getloadavg())},
               "runs": runs, "summary": summary}
    write_results(args.out, "lockstep-stragglers", stamp, payload, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
