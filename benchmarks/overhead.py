#!/usr/bin/env python3
"""Step-overhead benchmark: a plain tight-loop DDP job under torchrun and under elastic-rt, alternating.

Measures training steps/s of each launcher and the CPU its agent process uses (psutil, the agent's
pid alone, not its workers) over the same training window. See benchmarks/README.md ("overhead.py").

    python benchmarks/overhead.py                      # 3 trials of every configuration and variant
    python benchmarks/overhead.py --baseline main      # also elastic-rt at git ref `main`, same session
    python benchmarks/overhead.py --quick --allow-dirty --out /tmp/x   # CI: shows it works, < 60 s

The same file is the training job (`overhead.py job ...`): it imports torch only, never elastic_rt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.abspath(__file__)
NPROC = 2

# name -> (launcher, source, extra launcher flags, metrics on, extra environment, nodes)
# One node runs NPROC workers (--standalone); two nodes (etcd on loopback) run NPROC // 2 each, so
# every configuration trains the same world of NPROC workers on this machine. With one worker per
# node neither launcher sets OMP_NUM_THREADS (torchrun's rule), but these two "nodes" share one
# machine's cores, so the benchmark sets it as each real node's single worker would get all its own.
_TWO_NODES_ENV = {"OMP_NUM_THREADS": "1"}
CONFIGS = {
    "torchrun": ("torchrun", None, (), False, {}, 1),
    "ert": ("elastic-rt", "head", (), True, {}, 1),
    "ert-nometrics": ("elastic-rt", "head", (), False, {}, 1),
    "ert-hang": ("elastic-rt", "head", ("--hang-timeout", "300"), True, {}, 1),
    "ert-2node": ("elastic-rt", "head", (), True, _TWO_NODES_ENV, 2),  # the collective probe runs after rendezvous
    "ert-2node-noprobe": ("elastic-rt", "head", ("--probe-bytes", "0"), True, _TWO_NODES_ENV, 2),
    "base": ("elastic-rt", "baseline", (), True, {}, 1),
    "base-omp1": ("elastic-rt", "baseline", (), True, {"OMP_NUM_THREADS": "1"}, 1),
    "base-2node": ("elastic-rt", "baseline", (), True, _TWO_NODES_ENV, 2),
}
DEFAULT_CONFIGS = "torchrun,ert,ert-nometrics,ert-hang,ert-2node,ert-2node-noprobe"
VARIANTS = {"plain": 0, "dataloader": 2}  # variant -> DataLoader worker processes per rank


# ---- the training job (runs in every worker) --------------------------------------------------
def job(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="overhead.py job")
    p.add_argument("--out", required=True, help="rank 0 writes its result (JSON) here")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--check-every", type=int, default=25, help="steps between two stop-flag broadcasts")
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DDP(nn.Sequential(nn.Linear(a.width, a.width), nn.ReLU(), nn.Linear(a.width, a.width)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    if a.loader_workers:
        data = TensorDataset(torch.randn(4096, a.width), torch.randn(4096, a.width))
        loader = DataLoader(data, batch_size=a.batch, shuffle=True, drop_last=True,
                            num_workers=a.loader_workers, persistent_workers=True)

        def batches():
            while True:
                yield from loader
    else:
        x, y = torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)

        def batches():
            while True:
                yield x, y
    it = batches()
    flag = torch.zeros(1)

    def step() -> None:
        bx, by = next(it)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(bx), by).backward()
        opt.step()

    def train_until(deadline: float) -> int:
        """Steps until rank 0's clock passes deadline (checked every --check-every steps)."""
        n = 0
        while True:
            for _ in range(a.check_every):
                step()
            n += a.check_every
            flag[0] = 1.0 if rank == 0 and time.monotonic() >= deadline else 0.0
            dist.broadcast(flag, src=0)
            if flag.item():
                return n

    step()  # the first step: DDP builds its buckets
    t_first = time.monotonic()
    early = train_until(t_first + a.warmup_s)  # the first seconds of the round, untimed for the window
    t0 = time.monotonic()
    steps = train_until(t0 + a.seconds)
    t1 = time.monotonic()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"steps": steps, "t_first": t_first, "t0": t0, "t1": t1, "steps_per_s": steps / (t1 - t0),
                       "early_steps_per_s": early / (t0 - t_first),
                       "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                       "torch_threads": torch.get_num_threads()}, f)
    dist.destroy_process_group()
    # torch 2.13 sometimes aborts at interpreter exit ("terminate called without an active exception": a
    # C++ thread left joinable), under torchrun and elastic-rt alike, after the results are written; the
    # trial's figures are in, so leave without the interpreter's teardown rather than fail the trial
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the harness -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


def export_ref(ref: str, dest: str) -> str:
    """Unpack the tree of git ref `ref` into dest (no worktree is created); returns its commit."""
    commit = _git("rev-parse", f"{ref}^{{commit}}")
    archive = os.path.join(dest, "src.tar")
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", commit], cwd=REPO, stdout=f, check=True, timeout=60)
    with tarfile.open(archive) as tar:
        tar.extractall(os.path.join(dest, "src"), filter="data")
    return commit


class CpuSampler:
    """CPU seconds (user + system) of the agent processes and of their descendants, sampled with psutil.

    Each process is sampled on its own (threads included, children not), so an agent's figure is
    its own work only. Descendants are told apart by role: "probe" (the collective probe child)
    and "workers" (the workers and their own children, e.g. DataLoader workers). Between two
    samples a process's CPU time is interpolated linearly, from 0 at its birth.
    """

    def __init__(self, agent_pids: list[int], rescan_s: float = 0.5) -> None:
        import psutil

        self._err = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)
        self._procs = {pid: psutil.Process(pid) for pid in agent_pids}
        self.roles = {pid: "agent" for pid in agent_pids}
        self._rescan_s, self._next_rescan = rescan_s, 0.0
        self.series: dict[int, list[tuple[float, float]]] = {}

    def _adopt(self, child) -> None:
        try:
            cmdline = child.cmdline()
            born = child.create_time() - (time.time() - time.monotonic())  # wall clock -> monotonic
        except self._err:
            return
        self._procs[child.pid] = child
        self.roles[child.pid] = "probe" if any(a.endswith(".probe") for a in cmdline) else "workers"
        self.series[child.pid] = [(born, 0.0)]

    def sample(self) -> None:
        now = time.monotonic()
        if now >= self._next_rescan:  # a /proc scan: not at every sample
            self._next_rescan = now + self._rescan_s
            for pid, role in list(self.roles.items()):
                if role != "agent":
                    continue
                try:
                    for child in self._procs[pid].children(recursive=True):
                        if child.pid not in self._procs:
                            self._adopt(child)
                except self._err:
                    pass
        for pid, proc in list(self._procs.items()):
            try:
                t = proc.cpu_times()
            except self._err:
                continue
            self.series.setdefault(pid, []).append((time.monotonic(), t.user + t.system))

    @staticmethod
    def _at(series: list[tuple[float, float]], when: float) -> float:
        if when <= series[0][0]:
            return series[0][1]
        for (ta, ca), (tb, cb) in zip(series, series[1:]):
            if ta <= when <= tb:
                return ca if tb == ta else ca + (cb - ca) * (when - ta) / (tb - ta)
        return series[-1][1]

    def agents(self, t0: float, t1: float) -> list[float | None]:
        """CPU seconds of each agent between t0 and t1 (None: not sampled over all of it)."""
        out = []
        for pid, role in self.roles.items():
            if role == "agent":
                s = self.series.get(pid, [])
                ok = s and s[0][0] <= t0 and s[-1][0] >= t1
                out.append(self._at(s, t1) - self._at(s, t0) if ok else None)
        return out

    def role(self, role: str, t0: float, t1: float) -> float:
        """CPU seconds of every process of `role` between t0 and t1."""
        return sum(self._at(s, t1) - self._at(s, t0) for pid, s in self.series.items() if self.roles[pid] == role)


def _commands(args, config: str, variant: str, trial: int, sources: dict, scratch: str, result_path: str,
              etcd_endpoint: str | None) -> list[tuple[list[str], dict[str, str], int | None]]:
    """(command, environment, metrics port) of each agent of one trial."""
    launcher, source, flags, metrics, extra_env, nodes = CONFIGS[config]
    tag = f"{variant}-{config}-{trial}"
    job_args = [SCRIPT, "job", "--out", result_path, "--warmup-s", str(args.warmup), "--seconds",
                str(args.seconds), "--loader-workers", str(VARIANTS[variant])]
    env = dict(os.environ, **extra_env)
    if launcher == "torchrun":
        return [([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
                  *job_args], env, None)]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [sources[source], env.get("PYTHONPATH")]))
    out = []
    for node in range(nodes):
        port = _free_port() if metrics else 0
        if nodes == 1:
            where = ["--standalone", "--nproc-per-node", str(NPROC)]
        else:
            where = ["--nnodes", str(nodes), "--nproc-per-node", str(NPROC // nodes), "--rdzv-endpoint",
                     etcd_endpoint, "--rdzv-id", tag, "--local-addr", "127.0.0.1", "--node-id", f"node{node}"]
        out.append(([sys.executable, "-m", "elastic_rt.cli", "launch", *where, "--metrics-port", str(port),
                     "--log-dir", os.path.join(scratch, f"{tag}-node{node}"), *flags, *job_args], env, port))
    return out


def run_trial(args, config: str, variant: str, trial: int, sources: dict, scratch: str,
              etcd_endpoint: str | None) -> dict:
    tag = f"{variant}-{config}-{trial}"
    result_path = os.path.join(scratch, f"{tag}.json")
    agents = _commands(args, config, variant, trial, sources, scratch, result_path, etcd_endpoint)
    load = os.getloadavg()
    procs, logs = [], []
    t_start = time.monotonic()
    for i, (cmd, env, _port) in enumerate(agents):
        logs.append(os.path.join(scratch, f"{tag}-{i}.log"))
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    cpu = CpuSampler([p.pid for p in procs])
    ports = [port for _cmd, _env, port in agents if port]
    deadline = t_start + args.startup_timeout + args.warmup + args.seconds
    next_scrape, scrapes, outcome = t_start + args.scrape_interval, 0, "ok"
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                outcome = "timeout"
                break
            if ports and now >= next_scrape:  # what a Prometheus server would do
                next_scrape += args.scrape_interval
                for port in ports:
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
                        scrapes += 1
                    except OSError:
                        pass
            cpu.sample()
            time.sleep(args.sample_interval)
    finally:
        for p in procs:  # leftovers; the job has normally exited by now
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    row = {"variant": variant, "config": config, "launcher": CONFIGS[config][0], "nodes": len(procs),
           "trial": trial, "loadavg_at_start": list(load), "exit_codes": [p.returncode for p in procs],
           "scrapes": scrapes, "outcome": outcome}
    try:
        with open(result_path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        row.update(outcome="failed" if outcome == "ok" else outcome, log_tails=_tails(logs))
        return row
    if outcome == "ok" and any(p.returncode != 0 for p in procs):  # trained, then failed: not a clean trial
        row.update(outcome="failed", log_tails=_tails(logs))
    window = res["t1"] - res["t0"]
    per_agent = cpu.agents(res["t0"], res["t1"])
    agent_s = None if None in per_agent else sum(per_agent) / len(per_agent)
    first, end = res["t_first"], time.monotonic()
    row.update(steps=res["steps"], window_s=window, steps_per_s=res["steps_per_s"],
               early_steps_per_s=res["early_steps_per_s"], first_step_s=res["t_first"] - t_start,
               omp_num_threads=res["omp_num_threads"], torch_threads=res["torch_threads"],
               agent_cpu_s=per_agent,
               agent_cpu_pct=None if agent_s is None else 100.0 * agent_s / window,
               agent_cpu_s_per_min=None if agent_s is None else 60.0 * agent_s / window,
               workers_cpu_ms_per_step=1e3 * cpu.role("workers", res["t0"], res["t1"]) / res["steps"],
               # the probe children's CPU seconds (all nodes) before the first step, during the
               # first seconds after it (the warm-up), and after those
               probe_cpu_s_before_early_later=[cpu.role("probe", t_start, first), cpu.role("probe", first, res["t0"]),
                            cpu.role("probe", res["t0"], end)])
    return row


def _tails(logs: list[str]) -> list[str]:
    tails = []
    for path in logs:
        with open(path, errors="replace") as f:
            tails.append(f.read()[-2000:])
    return tails


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rows: list[dict], configs: list[str], variants: list[str]) -> list[dict]:
    out = []
    for variant in variants:
        ref = [r for r in rows if r["variant"] == variant and r["config"] == "torchrun"]
        ref_sps = _median([r.get("steps_per_s") for r in ref])
        ref_cpu = _median([r.get("workers_cpu_ms_per_step") for r in ref])
        for config in configs:
            mine = [r for r in rows if r["variant"] == variant and r["config"] == config]
            sps = [r["steps_per_s"] for r in mine if r.get("steps_per_s") and r["outcome"] == "ok"]
            med, cpu = _median(sps), _median([r.get("workers_cpu_ms_per_step") for r in mine])
            out.append({
                "variant": variant, "config": config, "launcher": CONFIGS[config][0], "nodes": CONFIGS[config][5],
                "trials": len(mine), "ok": len(sps), "steps_per_s_median": med, "steps_per_s_all": sps,
                "ratio_to_torchrun": med / ref_sps if med and ref_sps else None,
                "workers_cpu_ms_per_step_median": cpu,
                "workers_cpu_ratio_to_torchrun": cpu / ref_cpu if cpu and ref_cpu else None,
                "early_steps_per_s_median": _median([r.get("early_steps_per_s") for r in mine]),
                "first_step_s_median": _median([r.get("first_step_s") for r in mine]),
                "agent_cpu_pct_median": _median([r.get("agent_cpu_pct") for r in mine]),
                "agent_cpu_s_per_min_median": _median([r.get("agent_cpu_s_per_min") for r in mine]),
                "loadavg1_median": _median([r["loadavg_at_start"][0] for r in mine]),
                "omp_num_threads": sorted({str(r.get("omp_num_threads")) for r in mine if "steps" in r}),
                "probe_cpu_s_before_early_later_median": [
                    _median([r["probe_cpu_s_before_early_later"][i] for r in mine if "steps" in r]) for i in range(3)],
            })
    return out


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(summary: list[dict]) -> str:
    cols = [("variant", 10, "variant", "s"), ("config", 17, "config", "s"), ("steps/s", 7, "steps_per_s_median", ".0f"),
            ("ratio", 6, "ratio_to_torchrun", ".3f"), ("wCPUms/step", 11, "workers_cpu_ms_per_step_median", ".3f"),
            ("wCPU ratio", 10, "workers_cpu_ratio_to_torchrun", ".3f"),
            ("early/s", 7, "early_steps_per_s_median", ".0f"), ("1st step s", 10, "first_step_s_median", ".1f"),
            ("agent %core", 11, "agent_cpu_pct_median", ".2f"), ("agent s/min", 11, "agent_cpu_s_per_min_median", ".2f"),
            ("load1", 5, "loadavg1_median", ".1f")]
    head = " ".join(f"{name:<{w}}" if spec == "s" else f"{name:>{w}}" for name, w, _k, spec in cols)
    head += "  OMP  steps/s of each trial"
    lines = [head, "-" * len(head)]
    for s in summary:
        cells = [f"{s[k]:<{w}}" if spec == "s" else f"{_fmt(s[k], spec):>{w}}" for _n, w, k, spec in cols]
        lines.append(" ".join(cells) + f"  {','.join(s['omp_num_threads']):<4} "
                     f"{','.join(f'{v:.0f}' for v in s['steps_per_s_all']) or 'none'}")
    probes = [s for s in summary if any(s["probe_cpu_s_before_early_later_median"])]
    if probes:
        lines.append("\ncollective probe children, CPU s of all nodes (medians): before the 1st step / "
                     "during early/s / later")
        lines += [f"  {s['variant']:<10} {s['config']:<17} "
                  + " / ".join(_fmt(v, ".2f") for v in s["probe_cpu_s_before_early_later_median"]) for s in probes]
    return "\n".join(lines)


def _interrupted(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _out_path(out_dir: str, stamp: str) -> str:
    base = os.path.join(out_dir, f"overhead-{stamp}")
    n = 1
    while os.path.exists(base + (f"-{n}" if n > 1 else "") + ".json"):
        n += 1
    return base + (f"-{n}" if n > 1 else "")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="overhead.py", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3, help="trials per configuration and variant (default 3)")
    p.add_argument("--seconds", type=float, default=15.0, help="timed training window per trial (default 15)")
    p.add_argument("--warmup", type=float, default=3.0, help="untimed training before the window (default 3)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--variants", default="plain,dataloader", help="plain, dataloader (DataLoader, 2 workers)")
    p.add_argument("--baseline", default=None, metavar="REF",
                   help="git ref whose elastic-rt the base* configs run (adds 'base' to --configs)")
    p.add_argument("--scrape-interval", type=float, default=15.0, help="GET /metrics this often when on")
    p.add_argument("--sample-interval", type=float, default=0.2, help="agent CPU sampling period")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results directory")
    p.add_argument("--allow-dirty", action="store_true", help="run on a tree with uncommitted changes")
    p.add_argument("--quick", action="store_true",
                   help="CI smoke run: torchrun and ert, plain variant, 1 trial of 2 s (< 60 s in all)")
    p.add_argument("--keep-logs", action="store_true", help="keep the scratch directory (launcher logs)")
    a = p.parse_args(argv)
    if a.quick:
        a.trials, a.seconds, a.warmup, a.configs, a.variants = 1, 2.0, 0.5, "torchrun,ert", "plain"
    if a.baseline and "base" not in a.configs.split(","):
        a.configs += ",base"
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        return job(argv[1:])
    args = parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    variants = [v for v in args.variants.split(",") if v]
    bad = [c for c in configs if c not in CONFIGS] + [v for v in variants if v not in VARIANTS]
    if bad or not configs or not variants:
        sys.exit(f"overhead.py: unknown configuration or variant {', '.join(bad) or '(none given)'}")
    if "torchrun" not in configs:
        configs.insert(0, "torchrun")  # every ratio is taken against it
    if any(CONFIGS[c][1] == "baseline" for c in configs) and not args.baseline:
        sys.exit("overhead.py: the base* configurations need --baseline REF")
    from provenance import provenance  # benchmarks/provenance.py: benchmarks/ is sys.path[0]

    git = provenance(args.allow_dirty)  # refuses a dirty tree unless --allow-dirty
    signal.signal(signal.SIGTERM, _interrupted)
    scratch = tempfile.mkdtemp(prefix="elastic-rt-overhead-")
    sources, baseline, etcd, interrupted = {"head": REPO}, None, None, False
    rows, t0 = [], time.monotonic()
    try:
        if args.baseline:
            baseline = {"ref": args.baseline, "commit": export_ref(args.baseline, scratch)}
            sources["baseline"] = os.path.join(scratch, "src")
        if any(CONFIGS[c][5] > 1 for c in configs):
            sys.path.insert(0, REPO)
            from etcd_testbed.server import EtcdCluster  # the harness may import elastic_rt; the job never

            etcd = EtcdCluster(1)
            etcd.__enter__()
        for trial in range(args.trials):
            for variant in variants:
                # alternate: every configuration once per round, the order rotated from round to round
                k = trial % len(configs)
                for config in configs[k:] + configs[:k]:
                    row = run_trial(args, config, variant, trial, sources, scratch,
                                    etcd.endpoints if etcd else None)
                    rows.append(row)
                    print(f"[{time.monotonic() - t0:6.0f}s] {variant:<10} {config:<17} trial {trial + 1}: "
                          f"{_fmt(row.get('steps_per_s'), '.0f')} steps/s, agent "
                          f"{_fmt(row.get('agent_cpu_pct'), '.2f')} %core, load {row['loadavg_at_start'][0]:.2f}"
                          f"{'' if row['outcome'] == 'ok' else ' ' + row['outcome'].upper()}",
                          file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: the trials run so far follow", file=sys.stderr)
    finally:
        if etcd is not None:
            etcd.__exit__(None, None, None)
        if not args.keep_logs:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"logs kept in {scratch}", file=sys.stderr)
    summary = summarize(rows, configs, variants)
    import torch

    stamp = datetime.date.today().isoformat()
    payload = {
        "benchmark": "overhead", "date": stamp, "provenance": git,
        "baseline": baseline,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "loadavg_at_end": list(os.getloadavg()), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "keep_logs")},
        "workers_per_job": NPROC, "wall_s": time.monotonic() - t0, "interrupted": interrupted,
        "summary": summary, "trials": rows,
    }
    text = (f"overhead benchmark {stamp}: code {git['commit']}{' (dirty)' if git['dirty'] else ''}"
            f"{', baseline ' + baseline['ref'] + ' ' + baseline['commit'] if baseline else ''}; torch "
            f"{torch.__version__}, {os.cpu_count()} CPU(s), {NPROC} workers per job, {args.trials} trial(s) x "
            f"{args.seconds:g} s{' (INTERRUPTED)' if interrupted else ''}\n\n{table(summary)}\n")
    os.makedirs(args.out, exist_ok=True)
    path = _out_path(args.out, stamp)
    with open(path + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    with open(path + ".txt", "w") as f:
        f.write(text)
    print("\n" + text + f"\nwritten: {path}.json, {path}.txt")
    return 130 if interrupted else 0 if all(s["ok"] for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
