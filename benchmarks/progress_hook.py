"""Per-step cost of what the worker entry point adds to every training step: the progress hook
(torch's global optimizer step post hook writes the 52-byte heartbeat record into a shared mapping)
and the compute timer of lock-step straggler detection (backward() and the collectives wrapped, the
step closed in the hook: goodput/compute.py).

Tight loops, no sleep, interleaved so that load changes hit every variant alike:
- `optimizer`: optimizer.step() alone on a one-parameter model (the hook's cost next to the smallest step);
- `train`: a whole step of a small model on CPU (forward, loss.backward(), an all-reduce of the loss as
  scripts do for logging, optimizer.step()) in a one-rank gloo group;
each without anything (what torchrun runs), with the progress hook, and with the hook and the timer.
The figure is the process's CPU time per step (on a shared machine the wall time also holds what other
sessions took); the wall time is recorded beside it.

    PYTHONPATH=. python benchmarks/progress_hook.py [--steps 20000] [--repeats 7] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.optim.optimizer as optimizer_module

from elastic_rt.goodput import compute
from elastic_rt.worker_reports import heartbeat
from elastic_rt.worker_env import ENV_HEARTBEAT_FILE

VARIANTS = ("none", "progress_hook", "progress_hook+compute_timer")


def _optimizer_loop() -> tuple[object, callable]:
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.zeros(1)
    opt = torch.optim.SGD([param], lr=0.0)
    return opt, opt.step


def _train_loop() -> tuple[object, callable]:
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(16, 32)

    def step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        opt.step()

    return opt, step


def per_step_us(step, steps: int) -> tuple[float, float]:
    """(wall, CPU) microseconds per step. The CPU time of the process (all its threads) is what the hooks
    add; on a shared machine the wall time also holds whatever the other sessions took."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1e6, (time.process_time() - c0) / steps * 1e6


class Variant:
    """Installs what one variant adds, and removes it again."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._handle = None

    def __enter__(self) -> "Variant":
        heartbeat.report_to(None)
        if self.name != "none":
            self._handle = heartbeat.install_optimizer_progress(optimizer_module)
        if self.name.endswith("compute_timer"):
            compute.install_in_worker(torch.autograd)
            compute.install_collectives_in_worker(dist)
        return self

    def __exit__(self, *_exc) -> None:
        if self._handle is not None:
            self._handle.remove()
        compute.uninstall(torch.autograd, dist, dist.distributed_c10d)
        heartbeat.set_step_timer(None)


def measure(loop: str, steps: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for i in range(repeats):
        order = VARIANTS if i % 2 == 0 else tuple(reversed(VARIANTS))
        for name in order:
            with Variant(name):
                _opt, step = _optimizer_loop() if loop == "optimizer" else _train_loop()
                per_step_us(step, max(100, steps // 20))  # warm up (and the timer's first, untimed step)
                results[name].append(per_step_us(step, steps))
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="write NAME-DATE.json/.txt into this directory (results file)")
    p.add_argument("--allow-dirty", action="store_true", help="run on uncommitted changes (recorded)")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import provenance
    from results_file import write_results

    git = provenance(args.allow_dirty) if args.out else None
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[ENV_HEARTBEAT_FILE] = os.path.join(tmp, "worker-0")
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            loops = {loop: measure(loop, args.steps, args.repeats) for loop in ("optimizer", "train")}
        finally:
            dist.destroy_process_group()
        beat = heartbeat.read_heartbeat(os.environ[ENV_HEARTBEAT_FILE])
    rows = {}
    for loop, res in loops.items():
        rows[loop] = {}
        for kind, i in (("cpu", 1), ("wall", 0)):
            base = statistics.median(x[i] for x in res["none"])
            rows[loop][kind] = {name: {"median_us": statistics.median(x[i] for x in xs), "best_us": min(x[i] for x in xs),
                                       "runs_us": [x[i] for x in xs],
                                       "added_median_us": statistics.median(x[i] for x in xs) - base,
                                       "ratio_to_none": statistics.median(x[i] for x in xs) / base}
                                for name, xs in res.items()}
    lines = [f"torch {torch.__version__}, {args.steps} steps x {args.repeats} repeats, interleaved; "
             f"load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end (shared machine); "
             "CPU time of the process per step (what the hooks add), then wall time (plus the other sessions')"]
    for loop, kinds in rows.items():
        for kind, row in kinds.items():
            lines.append(f"{loop}, {kind}:")
            for name, r in row.items():
                lines.append(f"  {name:30s} median {r['median_us']:8.2f} us  best {r['best_us']:8.2f} us  "
                             f"added {r['added_median_us']:+7.2f} us  x{r['ratio_to_none']:.3f}")
            none = row["none"]["runs_us"]
            lines.append(f"  run-to-run spread without anything: {100 * (max(none) - min(none)) / statistics.median(none):.1f} "
                         "% of the median")
    lines.append(f"last record: step={beat.step if beat else None} timed_steps={beat.timed_steps if beat else None}")
    text = "\n".join(lines) + "\n"
    if not args.out:
        print(text)
        return 0
    stamp = datetime.date.today().isoformat()
    payload = {"benchmark": "progress-hook", "date": stamp, "provenance": git, "torch": torch.__version__,
               "steps": args.steps, "repeats": args.repeats,
               "machine": {"cpus": os.cpu_count(), "loadavg_at_start": list(load_start),
                           "loadavg_at_end": list(os.getloadavg())},
               "loops": rows}
    write_results(args.out, "progress-hook", stamp, payload, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
