"""Local SGD test job for the straggler tests: every rank takes its own steps and the ranks average their
parameters every --sync-every steps (the only collective). --step-sleep makes a node slow on purpose."""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from elastic_rt import report_step


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--sync-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.1, help="seconds per step on this node")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_sleep)
        report_step(step)
        if step % args.sync_every == 0:
            for param in model.parameters():
                dist.all_reduce(param.data)
                param.data /= world
            if rank == 0:
                print(f"step={step} world_size={world}", flush=True)
    if rank == 0:
        print(f"done steps={args.steps} world_size={world}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
