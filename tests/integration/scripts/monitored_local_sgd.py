"""The job the Prometheus tests watch: local SGD (every rank steps on its own, the ranks average their parameters
every --sync-every steps) with sharded checkpoints every --save-every steps, so that every dashboard panel has
something to draw: steps, checkpoints, restores, and a straggler (--step-sleep makes one node slow on purpose;
in lock-step DDP no rank would stand out)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from elastic_rt import report_checkpoint, report_step
from elastic_rt.checkpoint import CheckpointManager


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--sync-every", type=int, default=5)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds per step on this node")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def on_saved(stats) -> None:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            report_checkpoint(step=stats.step, save_duration_s=stats.save_duration_s, blocked_s=stats.blocked_s)

    mgr = CheckpointManager(os.environ["ELASTIC_RT_CHECKPOINT_URL"], keep_last=2, on_saved=on_saved)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    step = mgr.load_latest(state) or 0
    if step:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    torch.manual_seed(rank + step)
    if rank == 0:
        print(f"start step={step} world_size={world}", flush=True)
    while step < args.steps:
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_sleep)
        step += 1
        report_step(step)
        if step % args.sync_every == 0:
            for param in model.parameters():
                dist.all_reduce(param.data)
                param.data /= world
            if rank == 0:
                print(f"step={step} world_size={world}", flush=True)
        if step % args.save_every == 0:
            mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    mgr.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
