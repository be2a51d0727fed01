#!/usr/bin/env python3
"""Recovery-time benchmark: elastic-rt vs torchrun after a killed worker or node, an etcd outage, a hang, a partition.

Runs launch/train_example.py under each launcher, kills a worker (one node, two workers) or a
whole node (two agents on loopback, --nnodes 1:2), and measures the seconds from the kill to the
first training step completed after recovery, read from the launchers' tee'd stdout. The
failure-model scenarios (etcd outage, hang, partition) run a plain DDP script and live in
benchmarks/failure_scenarios.py. See benchmarks/README.md for how to run it and how to read the output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import asdict

import failure_scenarios  # benchmarks/failure_scenarios.py (this script's directory is on sys.path)
from provenance import provenance  # benchmarks/provenance.py
from recovery_harness import Bench, Scenario, TrialFailed, TrialResult, fmt



def all_scenarios() -> list[Scenario]:
    return [
        Scenario("worker/ert-standalone", "worker", "elastic-rt", "standalone", "local rank 1"),
        Scenario("worker/ert-etcd", "worker", "elastic-rt", "etcd-v3 (--nnodes 1)", "local rank 1"),
        Scenario("worker/torchrun", "worker", "torchrun", "standalone (c10d)", "local rank 1"),
        Scenario("node/ert-rank0", "node", "elastic-rt", "etcd-v3", "rank0"),
        Scenario("node/ert-non-rank0", "node", "elastic-rt", "etcd-v3", "non-rank0"),
        Scenario("node/torchrun-non-host", "node", "torchrun", "c10d", "non-host"),
        Scenario("node/torchrun-store-host", "node", "torchrun", "c10d", "store-host"),
        Scenario("node/ert-torch-non-rank0", "node", "elastic-rt", "etcd-v3-torch", "non-rank0"),
        Scenario("node/ert-torch-rank0", "node", "elastic-rt", "etcd-v3-torch", "rank0"),
        *failure_scenarios.scenarios(),
    ]


DEFAULT_SCENARIOS = [s.key for s in all_scenarios() if s.key != "node/ert-torch-rank0"]


def median_s(results: list[TrialResult]) -> float | None:
    """Median over trials, a trial that did not recover counting as infinitely slow; None if not finite."""
    vals = [r.recovery_s if r.outcome == "recovered" else float("inf") for r in results if r.outcome != "error"]
    if not vals:
        return None
    m = statistics.median(vals)
    return m if m != float("inf") else None


def ratio(ert: Scenario, torchrun: Scenario, args: argparse.Namespace) -> dict:
    """elastic-rt / torchrun of the medians. When torchrun did not recover, the wait limit stands in
    for its time and the ratio is an upper bound ('<')."""
    e, t = median_s(ert.results), median_s(torchrun.results)
    limit = limit_s(ert.fault, args)
    if e is None:
        return {"ratio": None, "bound": None, "text": "- (elastic-rt did not recover)"}
    if t is None:
        if not any(r.outcome != "error" for r in torchrun.results):
            return {"ratio": None, "bound": None, "text": "- (torchrun trials could not run)"}
        return {"ratio": None, "bound": e / limit,
                "text": f"<{e / limit:.2f} (torchrun: no recovery within {limit:g} s or crashed)"}
    return {"ratio": e / t, "bound": e / t, "text": f"{e / t:.2f}"}


def _med(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def limit_s(fault: str, args: argparse.Namespace) -> float:
    """How long a trial of this fault waits for recovery: a worker's (and a hang's) or a node's limit."""
    return args.worker_timeout if fault in ("worker", "hang") else args.node_timeout


def summarize(scenarios: list[Scenario], args: argparse.Namespace) -> dict:
    by_key = {s.key: s for s in scenarios}
    rows = []
    for s in scenarios:
        ok = [r.recovery_s for r in s.results if r.outcome == "recovered"]
        rows.append({
            "scenario": s.key, "fault": s.fault, "launcher": s.launcher, "rendezvous": s.rdzv, "kill": s.kill,
            "trials": len(s.results), "recovered": len(ok), "median_s": median_s(s.results),
            "min_s": min(ok) if ok else None, "max_s": max(ok) if ok else None,
            "median_detect_s": _med([r.detect_s for r in s.results]),
            "median_cold_start_s": _med([r.cold_start_s for r in s.results]),
            "group_failures": [r.group_failures for r in s.results if r.outcome != "error"],
            "outcomes": sorted({r.outcome for r in s.results}),
            "results": [asdict(r) for r in s.results],
        })
        if s.fault == "etcd-outage":
            rows[-1].update(failure_scenarios.outage_row(s.results))
        if s.fault == "hang":
            rows[-1]["median_beyond_timeout_s"] = _med([r.extra.get("beyond_timeout_s") for r in s.results])
    ratios: dict[str, dict] = {}
    pairs = [(k, "worker/torchrun") for k in ("worker/ert-standalone", "worker/ert-etcd")]
    pairs += [(k, t) for k in ("node/ert-rank0", "node/ert-non-rank0")
              for t in ("node/torchrun-non-host", "node/torchrun-store-host")]
    pairs += [("hang/ert", "hang/torchrun"), ("partition/ert", "partition/torchrun")]
    for key, tkey in pairs:
        if key in by_key and tkey in by_key:
            ratios[f"{key} / {tkey}"] = ratio(by_key[key], by_key[tkey], args)
    targets: list[dict] = []
    node_keys = [k for k in ("node/ert-rank0", "node/ert-non-rank0") if k in by_key]
    if node_keys:
        meds = {k: median_s(by_key[k].results) for k in node_keys}
        targets.append({"target": "node loss: elastic-rt (etcd-v3) median recovery < 5 s in every variant",
                        "met": all(m is not None and m < 5.0 for m in meds.values()),
                        "evidence": ", ".join(f"{k} {fmt(m, ' s') if m is not None else 'none'}"
                                              for k, m in meds.items())})
    worker = {k: v for k, v in ratios.items() if k.startswith("worker/")}
    for limit, name in ((1.0, "no slower than torchrun (ratio <= 1)"), (0.5, "at most half of torchrun's (ratio <= 0.5, aim)")):
        if worker:
            targets.append({"target": f"worker loss: elastic-rt {name}",
                            "met": all(r["bound"] is not None and r["bound"] <= limit for r in worker.values()),
                            "evidence": ", ".join(f"{k.split(' /')[0]} {r['text']}" for k, r in worker.items())})
    targets += failure_scenarios.extra_targets({r["scenario"]: r for r in rows}, args.hang_timeout)
    return {"rows": rows, "ratios": ratios, "targets": targets}


def print_table(summary: dict, args: argparse.Namespace) -> None:
    head = ["scenario", "rendezvous", "killed", "ok/n", "median s", "min s", "max s", "detect s", "cold s",
            "fails", "notes"]
    lines = []
    for r in summary["rows"]:
        if r["fault"] == "etcd-outage":
            continue
        limit = limit_s(r["fault"], args)
        med = fmt(r["median_s"]) if r["median_s"] is not None else f"none<{limit:g}"
        if r["outcomes"] == ["error"]:
            med = "error"
        notes = []
        r0 = sorted({x["rank0_node"] for x in r["results"] if x["rank0_node"]})
        if r0 and r["launcher"] == "torchrun":
            notes.append(f"rank0 on {'/'.join(r0)} (store host nodeA)")
        reasons = sorted({why for x in r["results"] for why in x["reasons"]})
        if reasons:
            notes.append("restart reasons: " + ", ".join(reasons))
        if r.get("median_beyond_timeout_s") is not None:
            notes.append(f"detected {r['median_beyond_timeout_s']:.2f} s beyond --hang-timeout {args.hang_timeout:g}")
        notes += [f"#{i + 1}: {x['outcome']}: {x['detail']}" for i, x in enumerate(r["results"]) if x["detail"]]
        lines.append([r["scenario"], r["rendezvous"], r["kill"], f"{r['recovered']}/{r['trials']}", med,
                      fmt(r["min_s"]), fmt(r["max_s"]), fmt(r["median_detect_s"]), fmt(r["median_cold_start_s"]),
                      ",".join(map(str, r["group_failures"])) or "-", "; ".join(notes)])
    widths = [max(len(str(x[i])) for x in [head] + lines) for i in range(len(head) - 1)]
    for row in [head] + lines:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    outage = [r for r in summary["rows"] if r["fault"] == "etcd-outage"]
    if outage:
        failure_scenarios.print_outage(outage)
    print("\nratios elastic-rt / torchrun of the medians:")
    for k, v in summary["ratios"].items():
        print(f"  {k}: {v['text']}")
    print("\ntargets:")
    for t in summary["targets"]:
        print(f"  [{'MET' if t['met'] else 'NOT MET'}] {t['target']}: {t['evidence']}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3, help="trials per scenario (default 3)")
    p.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                   help="comma-separated scenario keys or prefixes ('worker', 'node', 'all'); "
                        f"known: {', '.join(s.key for s in all_scenarios())}")
    p.add_argument("--node-timeout", type=float, default=60.0,
                   help="seconds to wait for the survivor of a node loss (default 60)")
    p.add_argument("--worker-timeout", type=float, default=60.0,
                   help="seconds to wait for recovery after a worker kill (default 60)")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds for a job to start and log --warmup-steps steps (default 120)")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps logged before the kill (default 5)")
    p.add_argument("--kill-local-rank", type=int, default=1, choices=(0, 1),
                   help="local rank of the worker killed in the worker scenarios (default 1)")
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--omp-threads", type=int, default=1,
                   help="OMP_NUM_THREADS for every launcher (default 1; 0 leaves the environment alone)")
    p.add_argument("--hang-timeout", type=float, default=5.0,
                   help="elastic-rt's --hang-timeout in the hang scenarios (default 5)")
    p.add_argument("--outage-s", type=float, default=10.0, help="how long etcd stays paused (default 10)")
    p.add_argument("--window-s", type=float, default=10.0,
                   help="steps/s measured over this long before the etcd outage and after it (default 10)")
    p.add_argument("--outage-etcd-members", type=int, default=3,
                   help="etcd members in the etcd-outage scenario, all paused (default 3)")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    p.add_argument("--report", metavar="PATH", help="print the table of a saved --json file; run nothing")
    p.add_argument("--scratch-dir", default=None, help="parent of the scratch directory (default $TMPDIR)")
    p.add_argument("--keep-logs", action="store_true", help="keep every launcher's output in the scratch directory")
    p.add_argument("-v", "--verbose", action="store_true", help="echo commands and launcher output to stderr")
    p.add_argument("--allow-dirty", action="store_true",
                   help="run on a working tree with uncommitted changes (recorded in the results)")
    args = p.parse_args(argv)
    if args.trials < 1:
        p.error("--trials must be >= 1")
    return args


def select(spec: str) -> list[Scenario]:
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    out = [s for s in all_scenarios()
           if "all" in wanted or any(s.key == w or s.key.startswith(w.rstrip("/") + "/") for w in wanted)]
    unknown = [w for w in wanted if w != "all" and not any(s.key == w or s.key.startswith(w.rstrip("/") + "/")
                                                           for s in all_scenarios())]
    if unknown or not out:
        raise SystemExit(f"recovery.py: unknown scenario(s) {', '.join(unknown) or spec!r}; see --help")
    return out


def _sigterm(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def describe_code(prov: dict) -> str:
    """One line for the header: the commit (short), +dirty, and a change during the run."""
    text = prov["commit"][:12] + ("+dirty" if prov["dirty"] else "")
    end = prov.get("commit_at_end")
    return f"{text} -> {end[:12]} (changed during the run)" if end else text


def report(path: str) -> int:
    with open(path) as f:
        saved = json.load(f)
    args = parse_args([])  # settings that older files lack keep their defaults
    vars(args).update(saved["settings"])
    scenarios = [Scenario(r["scenario"], r["fault"], r["launcher"], r["rendezvous"], r["kill"],
                          [TrialResult(**x) for x in r["results"]]) for r in saved["rows"]]
    host = saved.get("host", {})
    code = describe_code(saved["provenance"]) if "provenance" in saved else host.get("git", "?")
    print(f"recovery benchmark (saved {path}): {args.trials} trial(s), --step-sleep {args.step_sleep:g}, "
          f"torch {host.get('torch', '?')}, {host.get('cpus', '?')} CPU(s), code {code}\n")
    print_table(summarize(scenarios, args), args)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        return report(args.report)
    scenarios = select(args.scenarios)
    prov = provenance(args.allow_dirty)  # before anything runs: a dirty tree is refused here
    for s in scenarios:
        if s.fault == "worker":
            s.kill = f"local rank {args.kill_local_rank}"
    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    bench = Bench(args)
    t0 = time.monotonic()
    interrupted = False
    try:
        for s in scenarios:
            for i in range(args.trials):
                print(f"[{time.monotonic() - t0:6.1f}s] {s.key} trial {i + 1}/{args.trials} ...",
                      end=" ", file=sys.stderr, flush=True)
                try:
                    if s.fault in ("worker", "node"):
                        res = (bench.worker_trial if s.fault == "worker" else bench.node_trial)(s, i)
                    else:
                        res = failure_scenarios.run_trial(bench, s, i)
                except TrialFailed as exc:
                    res = TrialResult("error", detail=str(exc))
                s.results.append(res)
                lost = res.extra.get("lost_s")
                figure = fmt(res.recovery_s, " s") if lost is None else f"lost {lost:.2f} s"
                print(f"{res.outcome} {figure} {res.detail}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: cleaning up; results so far follow", file=sys.stderr)
    finally:
        bench.close()
    done = [s for s in scenarios if s.results]
    summary = summarize(done, args)
    at_end = provenance(True)
    if at_end["commit"] != prov["commit"] or at_end["changes"] != prov["changes"]:
        prov["commit_at_end"] = at_end["commit"] + ("+dirty" if at_end["dirty"] else "")
    code = describe_code(prov)
    print(f"\nrecovery benchmark: {args.trials} trial(s), --step-sleep {args.step_sleep:g}, "
          f"torch {_torch_version()}, {os.cpu_count()} CPU(s), code {code}, load {os.getloadavg()[0]:.1f}, "
          f"wall {time.monotonic() - t0:.0f} s\n")
    print_table(summary, args)
    if args.json:
        payload = {
            "provenance": prov,
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "report")},
            "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": _torch_version(),
                     "loadavg": os.getloadavg(), "git": code},
            **summary,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 130 if interrupted else 0


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
