"""What the pre-flight node test costs a healthy job's start: two elastic-rt agents on loopback (one
etcd), a plain DDP script, the seconds from starting the agents to the first training step, with
`--preflight off` and `--preflight report`, trials interleaved. Also the test's own phases as the agents
log them (compute test before the round; ring test and verdict in the round).

    PYTHONPATH=. python benchmarks/preflight_start.py [--trials 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import tempfile
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(REPO)  # etcd_testbed/: the repository's, not part of the installed package
from etcd_testbed.server import EtcdCluster  # noqa: E402

VARIANTS = ("off", "report")


def trial(agents_mod, endpoint: str, mode: str, timeout_s: float) -> dict:
    run_id = f"pf-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        nodes = [agents_mod.Agent([
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--node-id", node, "--local-addr", "127.0.0.1", "--metrics-port", "0", "--tee", "3",
            "--log-dir", os.path.join(tmp, node), "--preflight", mode, agents_mod.PLAIN_SCRIPT, "--steps", "5",
        ], tag=f"{run_id}/{node}") for node in ("a", "b")]
        t0 = min(n.started for n in nodes)
        try:
            first = nodes[0].wait_for(r"\]:step=1 ", timeout_s)  # a: group rank 0 (node ids in order), global rank 0
            codes = [n.proc.wait(timeout=timeout_s) for n in nodes]
        finally:
            for n in nodes:
                n.kill()
    text = "\n".join(n.text() for n in nodes)
    compute = [float(x) for x in re.findall(r"pre-flight compute test \((\d+\.\d+) s\)", text)]
    rounds = [float(x) for x in re.findall(r"pre-flight: \d+ node\(s\) named in (\d+\.\d+) s", text)]
    named = [int(x) for x in re.findall(r"pre-flight: (\d+) node\(s\) named", text)]
    return {"mode": mode, "first_step_s": first[0] - t0 if first else None, "exit_codes": codes,
            "compute_test_s": compute, "round_test_s": rounds, "named": named,
            "loadavg1_at_end": os.getloadavg()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", default=None, help="write NAME-DATE.json/.txt into this directory (results file)")
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import agents
    from provenance import provenance
    from results_file import write_results

    git = provenance(args.allow_dirty) if args.out else None
    load_start = os.getloadavg()
    runs = []
    with EtcdCluster(1) as etcd:
        for i in range(args.trials):
            for mode in (VARIANTS if i % 2 == 0 else tuple(reversed(VARIANTS))):
                r = trial(agents, etcd.endpoints, mode, args.timeout)
                print(r, flush=True)
                runs.append(r)
    summary = {}
    for mode in VARIANTS:
        xs = [r["first_step_s"] for r in runs if r["mode"] == mode and r["first_step_s"] is not None]
        summary[mode] = {"first_step_median_s": statistics.median(xs) if xs else None, "trials": len(xs),
                         "all_s": xs}
    off, on = summary["off"]["first_step_median_s"], summary["report"]["first_step_median_s"]
    summary["added_median_s"] = on - off if off and on else None
    summary["ratio_report_to_off"] = on / off if off and on else None
    mine = [r for r in runs if r["mode"] == "report"]
    summary["compute_test_median_s"] = statistics.median([x for r in mine for x in r["compute_test_s"]] or [0.0])
    summary["round_test_median_s"] = statistics.median([x for r in mine for x in r["round_test_s"]] or [0.0])
    summary["false_positives"] = sum(sum(r["named"]) for r in mine)
    text = (f"pre-flight start cost: 2 agents x 1 worker on loopback, plain DDP script, {args.trials} trials each, "
            f"interleaved; load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end (shared machine)\n"
            f"  --preflight off     first step median {off:.2f} s  ({summary['off']['all_s']})\n"
            f"  --preflight report  first step median {on:.2f} s  ({summary['report']['all_s']})\n"
            f"  added {summary['added_median_s']:+.2f} s, x{summary['ratio_report_to_off']:.3f}; compute test "
            f"{summary['compute_test_median_s']:.2f} s, ring test and verdict {summary['round_test_median_s']:.2f} s "
            f"(medians); nodes named in healthy runs: {summary['false_positives']}\n")
    if not args.out:
        print(text)
        return 0
    stamp = datetime.date.today().isoformat()
    payload = {"benchmark": "preflight-start", "date": stamp, "provenance": git, "trials": args.trials,
               "machine": {"cpus": os.cpu_count(), "loadavg_at_start": list(load_start),
                           "loadavg_at_end": list(os.getloadavg())},
               "runs": runs, "summary": summary}
    write_results(args.out, "preflight-start", stamp, payload, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
