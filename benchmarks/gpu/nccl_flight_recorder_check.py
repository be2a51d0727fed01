"""Exercise elastic-rt's NCCL flight recorder path on a GPU machine; prints one PASS/FAIL line per scenario.

NOT RUN on this project's development machine (CPU only); `--backend gloo` dry-runs the same
scenarios on CPU to check the script itself (gloo records collectives too, but does not dump
on a timeout). Each scenario runs `elastic-rt launch --standalone` on a small job written to
a scratch directory, with --flight-recorder on:

  single   (1 GPU)  one rank, NCCL; it stops making steps (sleeps); --hang-timeout 10: the agent
                    asks the worker for a dump; flight_recorder-rank0.json holds nccl:all_reduce
                    entries and the hang line says "no collective pending".
  hang     (2 GPUs) rank 1 sleeps at step 5 outside any collective, NCCL timeout 600 s,
                    --hang-timeout 10: both workers dump on request; the line names the pending
                    all_reduce: "joined by ranks [0], not joined by ranks [1]".
  timeout  (2 GPUs) the same with an NCCL timeout of 20 s and no hang detection: NCCL's watchdog
                    on rank 0 times out, dumps to <log dir>/flight_recorder/nccl_trace_rank_0 and
                    aborts; the failure line says cause=collective_timeout with that summary, and
                    elastic_rt_collective_errors_total{backend="nccl",kind="timeout"} counts it.

    PYTHONPATH=. python benchmarks/gpu/nccl_flight_recorder_check.py            # what the GPUs allow
    PYTHONPATH=. python benchmarks/gpu/nccl_flight_recorder_check.py --backend gloo --scenarios hang,timeout
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

JOB = textwrap.dedent('''
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    mode, backend, timeout_s = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(dev)
    p = torch.nn.Parameter(torch.zeros(1024, device=dev))
    opt = torch.optim.SGD([p], lr=0.1)
    for step in range(1, 400):
        if step == 5 and rank == world - 1:
            print(f"rank {rank} stops at step {step}", flush=True)
            time.sleep(3600)  # outside any collective: the others wait in the next all_reduce
        g = torch.ones(1024, device=dev)
        dist.all_reduce(g)
        p.grad = g
        opt.step()
        if backend == "nccl":
            torch.cuda.synchronize()
        if rank == 0:
            print(f"step={step}", flush=True)
        time.sleep(0.05)
''')

SCENARIOS = {  # name: (workers, collective timeout s, --hang-timeout, what must appear in the agent's output)
    "single": (1, 600, "10", [r"workers hung: .*flight recorder: no collective pending"]),
    "hang": (2, 600, "10", [r"workers hung: .*flight recorder: pg \S+ #\d+ (nccl|gloo):all_?reduce.* joined by ranks "
                            r"\[0\], not joined by ranks \[1\]"]),
    "timeout": (2, 20, "0", [r"worker failed: rank 0 \(local 0, pid \d+\) cause=collective_timeout"]),
}


def run(name: str, backend: str, scratch: str, limit_s: float) -> dict:
    nproc, coll_timeout, hang_timeout, patterns = SCENARIOS[name]
    log_dir = os.path.join(scratch, name)
    job = os.path.join(scratch, "job.py")
    cmd = [sys.executable, "-m", "elastic_rt.cli", "launch", "--standalone", "--nproc-per-node", str(nproc),
           "--metrics-port", "0", "--tee", "3", "--log-dir", log_dir, "--max-restarts", "0",
           "--flight-recorder", "on", "--hang-timeout", hang_timeout, job, name, backend, str(coll_timeout)]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=limit_s).stdout
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    lines = [ln for ln in out.splitlines() if "elastic-rt:" in ln]
    missing = [p for p in patterns if not any(re.search(p, ln) for ln in lines)]
    if name == "timeout" and backend == "nccl":
        fr_dir = os.path.join(log_dir, "flight_recorder")
        dumps = sorted(os.listdir(fr_dir)) if os.path.isdir(fr_dir) else []
        if not dumps:
            missing.append(f"no NCCL dump in {fr_dir}")
        if not any("flight recorder: pg" in ln for ln in lines):
            missing.append("failure line without a flight recorder summary")
    return {"scenario": name, "backend": backend, "ok": not missing, "missing": missing,
            "seconds": round(time.monotonic() - t0, 1),
            "lines": [ln for ln in lines if "hung" in ln or "failed" in ln][:6]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--scenarios", default="", help="comma-separated (default: what the GPU count allows)")
    p.add_argument("--limit", type=float, default=240.0, help="seconds per scenario")
    args = p.parse_args()
    if args.scenarios:
        names = args.scenarios.split(",")
    elif args.backend == "gloo":
        names = ["single", "hang", "timeout"]
    else:
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            print("no CUDA device: nothing run (use --backend gloo for a CPU dry run)")
            return 2
        names = ["single"] + (["hang", "timeout"] if gpus >= 2 else [])
        if gpus < 2:
            print("one GPU: the two-rank scenarios (hang, timeout) need two and are skipped")
    results = []
    with tempfile.TemporaryDirectory(prefix="er-fr-check-") as scratch:
        with open(os.path.join(scratch, "job.py"), "w") as f:
            f.write(JOB)
        for name in names:
            r = run(name, args.backend, scratch, args.limit)
            results.append(r)
            print(f"{'PASS' if r['ok'] else 'FAIL'} {name} ({args.backend}, {r['seconds']} s)"
                  + ("" if r["ok"] else f": missing {r['missing']}"))
            for ln in r["lines"]:
                print("    " + ln[:400])
    print(json.dumps(results))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
