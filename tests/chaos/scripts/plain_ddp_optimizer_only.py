"""A plain torchrun-style DDP script: no elastic_rt import, no report_step; its only progress signal is
optimizer.step(). Injects a fault on request: on the first attempt only (TORCHELASTIC_RESTART_COUNT=0), in
every attempt at the same step (--fault-when always), or at a later step in each of the first
--fault-attempts attempts (--fault-when moving: failures that progress). --restart-step-sleep sets the seconds
per step once any rank of the group is past its first attempt: a test that stretches the first attempt to have
time to inject its fault need not wait that long again for the restarted group to finish."""

from __future__ import annotations

import argparse
import atexit
import ctypes
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

FAULTS = ("none", "raise", "raise-linger", "segfault", "exit", "oom", "deadlock", "sleep")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--restart-step-sleep", type=float, default=None,
                   help="seconds per step once any rank is past its first attempt (default: --step-sleep)")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-when", choices=("first", "always", "moving"), default="first")
    p.add_argument("--fault-attempts", type=int, default=3, help="--fault-when moving: attempts that fail")
    p.add_argument("--oom-cgroup", default="", help="memory cgroup directory to join before allocating (fault oom)")
    return p.parse_args()


def inject_failure(fault: str, args, step: int) -> None:
    if fault == "raise-linger":  # raises, then tears down slowly: its peers' collective times out first
        atexit.register(time.sleep, 60)
        fault = "raise"
    if fault == "raise":
        raise ValueError(f"injected failure at step {step}")
    if fault == "segfault":
        ctypes.string_at(0)
    if fault == "exit":
        os._exit(3)
    if fault == "oom":
        with open(os.path.join(args.oom_cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        hog = []
        while True:
            hog.append(b"\x01" * (16 << 20))
    if fault == "deadlock":  # waits for a message its peer never sends; the peer waits in the next all-reduce
        dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())
    if fault == "sleep":
        time.sleep(3600)


def main() -> int:
    args = parse_args()
    dist.init_process_group("gloo")  # the default timeout: two ranks' start skew on a loaded machine is seconds
    # raise-linger: the steps' collectives time out after 5 s (the ranks step in lock-step, milliseconds apart once
    # the group is up; 5 s is --hang-timeout's value in these tests), so the peers fail while the raising rank
    # still lingers (60 s)
    group = dist.new_group(timeout=datetime.timedelta(seconds=5)) if args.fault == "raise-linger" else None
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    fault_step = {"first": args.fault_step if attempt == 0 else None, "always": args.fault_step,
                  "moving": args.fault_step + 2 * attempt if attempt < args.fault_attempts else None}[args.fault_when]
    step_sleep = args.step_sleep
    if args.restart_step_sleep is not None:  # the group agrees: an agent that followed a new round may count 0
        latest = torch.tensor([attempt])
        dist.all_reduce(latest, op=dist.ReduceOp.MAX)
        step_sleep = args.step_sleep if int(latest) == 0 else args.restart_step_sleep
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 16), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if rank == 0:
        print(f"start world_size={world} pid={os.getpid()}", flush=True)
    for step in range(1, args.steps + 1):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step={step} ", flush=True)
        if args.fault != "none" and step == fault_step and rank == args.fault_rank:
            inject_failure(args.fault, args, step)
        time.sleep(step_sleep)
    if rank == 0:
        print(f"done steps={args.steps} world_size={world}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
