"""Same math: the example's loss curve uninterrupted and resized, with a fixed global batch and per-rank batches; the plan's cost per step.

Part 1 (curves). launch/train_example.py under `elastic-rt launch --standalone`, gloo on CPU:
  uninterrupted   --global-batch-size B at 4 workers for --steps steps
  resized, plan   the same job stopped at the end of each segment and resumed from its
                  checkpoint at the next segment's world size (default 4, 2, 3, 4 workers)
  resized, per-rank batches   the same resizes with --batch-size B/4 per rank (a global batch of
                  B at 4 workers only): what a job gets without the plan
Per dtype (float64: only reassociation can differ; float32: the example's default) it records every
step's loss, the largest relative difference to the uninterrupted run's, and the final parameters'
(max |diff| / max |param|). Failures and restarts by real kills are the end-to-end test's job
(tests/chaos/test_same_math_e2e.py); here the resizes come at fixed steps so the curves line up.

Part 2 (cost). A tight loop, no sleep, in a spawned gloo world of --cost-world ranks: plain DDP
(torch's DistributedSampler, a DataLoader of b per rank) against the plan with B = b x world (the
same samples and compute per step: one micro-batch per rank), trials interleaved; medians, and
each variant's own spread across trials as the noise (after one unrecorded warm-up trial of each).

    PYTHONPATH=. python benchmarks/same_math.py [--steps 200] [--segments 4,2,3,4] [--out benchmarks/results] [--plot-dir docs]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from provenance import provenance  # benchmarks/provenance.py (this script's directory is on sys.path)
from gloo_world import run_world  # benchmarks/gloo_world.py
from results_file import write_results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # launch/ (the example's dataset)
from elastic_rt.data import ElasticDistributedSampler, GlobalBatchSampler  # noqa: E402
from launch.train_example import make_dataset  # noqa: E402

EXAMPLE = os.path.join(REPO, "launch", "train_example.py")
STEP = re.compile(r"\]:step=(\d+) loss=(\S+) world_size=(\d+)$")


# --- part 1: curves -----------------------------------------------------------------------------


def launch(nproc: int, job: list[str], log: list[str]) -> list[tuple[int, float, int]]:
    """One standalone run of the example; (step, loss, world size) per logged step."""
    cmd = [sys.executable, "-m", "elastic_rt.cli", "launch", "--standalone", "--nproc-per-node", str(nproc),
           "--metrics-port", "0", "--tee", "3", EXAMPLE, *job]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    log.append(f"$ {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    if proc.returncode != 0:
        raise SystemExit(f"same_math: {' '.join(cmd[4:])} exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    return [(int(m.group(1)), float(m.group(2)), int(m.group(3)))
            for line in proc.stdout.splitlines() if (m := STEP.search(line))]


def resized(segments: list[int], steps: int, job: list[str], tmp: str, log: list[str]) -> list[tuple[int, float, int]]:
    """The job run segment by segment, each at its world size, resuming from the previous one's checkpoint."""
    length = steps // len(segments)
    out = []
    for k, world in enumerate(segments):
        out += launch(world, [*job, "--steps", str(length * (k + 1)), "--ckpt-url", f"file://{tmp}",
                              "--save-every", str(length)], log)
    return out


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def curves(args: argparse.Namespace, dtype: str, log: list[str]) -> dict:
    common = ["--dtype", dtype, "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps),
              "--dataset-size", str(args.dataset_size)]
    plan = ["--global-batch-size", str(args.global_batch), "--micro-batch-size", str(args.micro_batch)]
    per_rank = ["--batch-size", str(args.global_batch // 4)]
    with tempfile.TemporaryDirectory(prefix="same-math-") as tmp:
        params = {k: os.path.join(tmp, f"{k}.pt") for k in ("uninterrupted", "plan", "per_rank")}
        runs = {
            "uninterrupted": launch(4, [*common, *plan, "--steps", str(args.steps),
                                        "--final-params", params["uninterrupted"]], log),
            "plan": resized(args.segments, args.steps, [*common, *plan, "--final-params", params["plan"]],
                            os.path.join(tmp, "plan"), log),
            "per_rank": resized(args.segments, args.steps, [*common, *per_rank, "--final-params",
                                                            params["per_rank"]], os.path.join(tmp, "per_rank"), log),
        }
        final = {k: torch.load(p, weights_only=True) for k, p in params.items()}
    ref = {s: loss for s, loss, _ in runs["uninterrupted"]}
    eps = torch.finfo(getattr(torch, dtype)).eps  # differences also in units of the dtype's epsilon
    out = {"runs": {k: [list(r) for r in v] for k, v in runs.items()}, "eps": eps}
    for k in ("plan", "per_rank"):
        diffs = [abs(loss - ref[s]) / abs(ref[s]) for s, loss, _ in runs[k]]
        out[f"{k}_max_rel_loss_diff"] = max(diffs)
        out[f"{k}_median_rel_loss_diff"] = statistics.median(diffs)
        out[f"{k}_final_params_rel_diff"] = rel_diff(final[k], final["uninterrupted"])
        for name in ("max_rel_loss_diff", "median_rel_loss_diff", "final_params_rel_diff"):
            out[f"{k}_{name}_eps"] = out[f"{k}_{name}"] / eps
        out[f"{k}_last10_mean_loss"] = statistics.fmean(loss for _, loss, _ in runs[k][-10:])
    out["uninterrupted_last10_mean_loss"] = statistics.fmean(loss for _, loss, _ in runs["uninterrupted"][-10:])
    return out


def plot(path: str, results: dict, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(results["curves"])
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6.5 * len(dtypes), 7), sharex=True, squeeze=False)
    length = args.steps // len(args.segments)
    for col, dtype in enumerate(dtypes):
        runs = results["curves"][dtype]["runs"]
        ref = {s: loss for s, loss, _ in runs["uninterrupted"]}
        top, bottom = axes[0][col], axes[1][col]
        styles = {"uninterrupted": ("uninterrupted, 4 workers", "-", 3.0, "tab:blue"),
                  "plan": ("resized, fixed global batch", "--", 1.5, "tab:orange"),
                  "per_rank": ("resized, per-rank batches", ":", 1.5, "tab:green")}
        for key, (label, style, width, color) in styles.items():
            steps = [s for s, _, _ in runs[key]]
            top.plot(steps, [loss for _, loss, _ in runs[key]], style, lw=width, color=color, label=label)
            if key != "uninterrupted":  # an exact 0 is drawn at 1e-17
                rel = [max(abs(loss - ref[s]) / abs(ref[s]), 1e-17) for s, loss, _ in runs[key]]
                bottom.semilogy(steps, rel, style, lw=width, color=color, label=label)
        for ax in (top, bottom):
            for k, world in enumerate(args.segments):
                ax.axvline(k * length, color="grey", lw=0.5)
                if ax is top:
                    ax.text(k * length + 1, 0.97, f"{world} workers", transform=ax.get_xaxis_transform(),
                            va="top", fontsize=8, color="grey")
        top.set_yscale("log")
        top.set_title(f"{dtype}: B = {args.global_batch} samples per step, micro-batches of {args.micro_batch}")
        top.set_ylabel("step loss (mean over the global batch)")
        bottom.set_ylabel("|loss - uninterrupted| / uninterrupted (0 at 1e-17)")
        bottom.set_xlabel("optimizer step")
        top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- part 2: cost per step ------------------------------------------------------------------------


def cost_trials(rank: int, world: int, order: list[str], steps: int, batch: int, hidden: int) -> list[tuple]:
    """Per trial in ``order``: (variant, wall seconds per step between barriers, this process's CPU
    seconds per step). CPU time is the steadier figure on a loaded machine; wall time is what a job sees."""
    torch.set_num_threads(1)
    dataset = make_dataset(steps * batch * world + batch * world, 0)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    out = []
    for variant in order:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if variant == "ddp":
            sampler = DistributedSampler(dataset, num_replicas=world, rank=rank)
            for _, (_, x, y) in zip(range(steps), DataLoader(dataset, batch_size=batch, sampler=sampler)):
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        else:
            sampler = ElasticDistributedSampler(dataset, num_replicas=world, rank=rank)
            batches = GlobalBatchSampler(sampler, global_batch_size=batch * world, micro_batch_size=batch)
            for _, step in zip(range(steps), batches.steps(DataLoader(dataset, batch_sampler=batches))):
                for micro, (_, x, y) in step:
                    with micro.accumulate(model):
                        (nn.functional.mse_loss(model(x), y) * micro.loss_scale).backward()
                opt.step()
                opt.zero_grad()
                step.commit()
        cpu = time.process_time() - c0
        dist.barrier()
        out.append((variant, (time.perf_counter() - t0) / steps, cpu / steps))
    return out


def step_cost(args: argparse.Namespace) -> dict:
    order = [v for i in range(args.cost_trials) for v in (("ddp", "plan") if i % 2 == 0 else ("plan", "ddp"))]
    warmup = ["ddp", "plan"]  # first iterations (DDP's bucket rebuild, allocations), not recorded
    ranks = run_world(cost_trials, args.cost_world, warmup + order, args.cost_steps, args.micro_batch, 64,
                      timeout_s=1800)
    ranks = [r[len(warmup):] for r in ranks]
    out = {"world": args.cost_world, "steps_per_trial": args.cost_steps, "trials": args.cost_trials,
           "per_rank_batch": args.micro_batch}
    for kind, pick, combine in (("wall", 1, max), ("cpu", 2, statistics.fmean)):
        us = {v: [combine(r[i][pick] for r in ranks) * 1e6 for i, name in enumerate(order) if name == v]
              for v in ("ddp", "plan")}
        med = {v: statistics.median(xs) for v, xs in us.items()}
        out[kind] = {
            "trials_us": us, "ddp_us_median": med["ddp"], "plan_us_median": med["plan"],
            "plan_over_ddp": med["plan"] / med["ddp"],
            # the noise: how far apart trials of the same variant are (max/min - 1)
            "ddp_spread": max(us["ddp"]) / min(us["ddp"]) - 1, "plan_spread": max(us["plan"]) / min(us["plan"]) - 1,
        }
    return out


# --- the report -------------------------------------------------------------------------------


def table(results: dict) -> str:
    lines = [f"same math: torch {torch.__version__}, {os.cpu_count()} CPU(s), load {results['loadavg_start'][0]:.1f} "
             f"at start, {results['loadavg_end'][0]:.1f} at end, code {results['provenance']['commit'][:10]}"
             f"{' (dirty)' if results['provenance']['dirty'] else ''}", "",
             "| dtype | run | max rel. loss diff | median rel. loss diff | final params rel. diff | "
             "the same in epsilons of the dtype | last-10 loss |",
             "|---|---|---|---|---|---|---|"]
    for dtype, c in results["curves"].items():
        lines.append(f"| {dtype} | uninterrupted | - | - | - | - | {c['uninterrupted_last10_mean_loss']:.6f} |")
        for k, label in (("plan", "resized, fixed global batch"), ("per_rank", "resized, per-rank batches")):
            lines.append(f"| {dtype} | {label} | {c[f'{k}_max_rel_loss_diff']:.3e} | "
                         f"{c[f'{k}_median_rel_loss_diff']:.3e} | {c[f'{k}_final_params_rel_diff']:.3e} | "
                         f"{c[f'{k}_max_rel_loss_diff_eps']:.3g} / {c[f'{k}_median_rel_loss_diff_eps']:.3g} / "
                         f"{c[f'{k}_final_params_rel_diff_eps']:.3g} | {c[f'{k}_last10_mean_loss']:.6f} |")
    s = results["step_cost"]
    lines += ["", f"cost per step, tight loop, {s['world']} gloo ranks, {s['per_rank_batch']} samples per rank, "
              f"{s['trials']} interleaved trials of {s['steps_per_trial']} steps (wall: slowest rank; CPU: mean of ranks):"]
    for kind in ("wall", "cpu"):
        k = s[kind]
        lines += [f"  {kind:4s} plain DDP  median {k['ddp_us_median']:.1f} us  (trials spread {100 * k['ddp_spread']:.1f} %)",
                  f"  {kind:4s} plan       median {k['plan_us_median']:.1f} us  (trials spread {100 * k['plan_spread']:.1f} %)",
                  f"  {kind:4s} plan / DDP {k['plan_over_ddp']:.3f}"]
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--segments", default="4,2,3,4", help="world sizes of the resized runs' equal segments")
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--dtypes", default="float64,float32")
    p.add_argument("--cost-world", type=int, default=2)
    p.add_argument("--cost-steps", type=int, default=300)
    p.add_argument("--cost-trials", type=int, default=10)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--plot-dir", default=os.path.join(REPO, "docs"), help="where same-math-DATE.png goes")
    p.add_argument("--allow-dirty", action="store_true", help="run on uncommitted changes (recorded)")
    args = p.parse_args()
    args.segments = [int(w) for w in args.segments.split(",")]
    results = {"provenance": provenance(args.allow_dirty), "loadavg_start": list(os.getloadavg()),
               "config": {k: v for k, v in vars(args).items() if k not in ("out", "allow_dirty")}}
    log: list[str] = []
    results["curves"] = {dtype: curves(args, dtype, log) for dtype in args.dtypes.split(",")}
    results["step_cost"] = step_cost(args)
    results["loadavg_end"] = list(os.getloadavg())
    stamp = datetime.date.today().isoformat()
    path = write_results(args.out, "same-math", stamp, results, table(results))
    png = os.path.join(args.plot_dir, os.path.basename(path) + ".png")  # the results' name: which run it shows
    plot(png, results, args)
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
