"""Local SGD test job for the straggler and monitoring tests: every rank takes its own steps and the ranks average
their parameters every --sync-every steps (the only collective). --step-sleep makes a node slow on purpose (in
lock-step DDP no rank would stand out). --save-every N also saves sharded checkpoints every N steps (a multiple
of --sync-every) to $ELASTIC_RT_CHECKPOINT_URL and resumes from the last one."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from elastic_rt import report_checkpoint, report_step


def checkpoints(save_every: int, sync_every: int):
    """A CheckpointManager on $ELASTIC_RT_CHECKPOINT_URL that reports each commit to the agent, or None."""
    if not save_every:
        return None
    if save_every % sync_every:
        raise SystemExit(f"--save-every {save_every} must be a multiple of --sync-every {sync_every}")
    from elastic_rt.checkpoint import CheckpointManager

    def on_saved(stats) -> None:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            report_checkpoint(step=stats.step, save_duration_s=stats.save_duration_s, blocked_s=stats.blocked_s)

    return CheckpointManager(os.environ["ELASTIC_RT_CHECKPOINT_URL"], keep_last=2, on_saved=on_saved)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--sync-every", type=int, default=5)
    # from the environment when set: every node of a job runs the same command line (its fingerprint), so a
    # test slows one node through its environment
    p.add_argument("--step-sleep", type=float, default=float(os.environ.get("GOODPUT_STEP_SLEEP", "0.1")),
                   help="seconds per step on this node (default: $GOODPUT_STEP_SLEEP, else 0.1)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mgr = checkpoints(args.save_every, args.sync_every)
    first = 1
    if mgr is not None:
        state = {"model": model.state_dict()}  # plain SGD keeps no optimizer state
        resumed = mgr.load_latest(state)
        if resumed:
            model.load_state_dict(state["model"])
            first = resumed + 1
        if rank == 0:
            print(f"start step={first - 1} world_size={world}", flush=True)
    for step in range(first, args.steps + 1):
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
        if mgr is not None and step % args.save_every == 0:
            mgr.save(step, {"model": model.state_dict()})
    if mgr is not None:
        mgr.close()
    if rank == 0:
        print(f"done steps={args.steps} world_size={world}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
