"""Per-step cost of counting every optimizer step as progress (torch's global optimizer step post hook).

Tight loop, no sleep: optimizer.step() on a one-parameter model with and without the hook
(the hook writes the 36-byte heartbeat record into a shared mapping), plus the hook alone.

    PYTHONPATH=. python benchmarks/progress_hook.py [--steps 200000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.optim.optimizer as optimizer_module

from elastic_rt.reporting import heartbeat
from elastic_rt.worker_env import ENV_HEARTBEAT_FILE


def per_step_us(opt: torch.optim.Optimizer, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[ENV_HEARTBEAT_FILE] = os.path.join(tmp, "worker-0")
        param = torch.nn.Parameter(torch.zeros(1))
        param.grad = torch.zeros(1)
        opt = torch.optim.SGD([param], lr=0.0)
        per_step_us(opt, 1000)  # warm up
        off, on = [], []
        for i in range(args.repeats):  # interleaved, order alternating, so load changes hit both
            for hooked in ((False, True) if i % 2 == 0 else (True, False)):
                handle = heartbeat.install_optimizer_progress(optimizer_module) if hooked else None
                (on if hooked else off).append(per_step_us(opt, args.steps))
                if handle is not None:
                    handle.remove()
        hook = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                heartbeat.optimizer_step_hook(opt, (), {})
            hook.append((time.perf_counter() - t0) / args.steps * 1e6)
        beat = heartbeat.read_heartbeat(os.environ[ENV_HEARTBEAT_FILE])
    print(f"torch {torch.__version__}, {args.steps} steps x {args.repeats} repeats; median and best (least disturbed)")
    for label, xs in (("optimizer.step() without hook", off), ("optimizer.step() with hook", on),
                      ("hook alone", hook)):
        print(f"{label:30s} median {statistics.median(xs):8.2f} us   best {min(xs):8.2f} us")
    print(f"added per step: median {statistics.median(on) - statistics.median(off):+.2f} us, "
          f"best {min(on) - min(off):+.2f} us")
    print(f"last record: seq={beat.seq if beat else None} step={beat.step if beat else None}")


if __name__ == "__main__":
    main()
