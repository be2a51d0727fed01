"""A plain torch DDP job that knows nothing of elastic-rt (what a new user brings): gloo on CPU, a fixed
number of optimizer steps, a gradient all-reduce in each (lock-step). Global rank 0 prints `step=N
world_size=W` every --print-every steps and `done steps=N world_size=W`; --hidden N makes the model an
N x N layer before the output (a batch of 64 of width N), for compute worth timing; --slow-factor F makes a
rank that receives SIGUSR1 a straggler from then on: after each step it sleeps F - 1 times what it computed
in that step outside backward() (forward, loss, optimizer), so it computes F times as long as it would,
whatever the load on the machine."""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--print-every", type=int, default=1)
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--slow-factor", type=float, default=0.0)
    args = p.parse_args()
    slowed = []
    if args.slow_factor > 1:
        signal.signal(signal.SIGUSR1, lambda *_: slowed.append(True))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    width, batch = (args.hidden, 64) if args.hidden else (16, 8)
    layers = [nn.Linear(width, width), nn.ReLU()] if args.hidden else []
    model = DDP(nn.Sequential(*layers, nn.Linear(width, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        loss = model(torch.randn(batch, width)).pow(2).mean()
        opt.zero_grad()
        forward_s = time.perf_counter() - started
        loss.backward()
        stepped = time.perf_counter()
        opt.step()
        if slowed:
            time.sleep((args.slow_factor - 1) * (forward_s + time.perf_counter() - stepped))
        if rank == 0 and step % args.print_every == 0:
            print(f"step={step} world_size={world} restart={os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                  flush=True)
        time.sleep(args.step_sleep)
    dist.barrier()
    if rank == 0:
        print(f"done steps={args.steps} world_size={world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
