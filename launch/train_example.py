"""Example elastic training job: a small deterministic DDP regression on synthetic data.

Run it on one machine with no etcd:
    elastic-rt launch --standalone --nproc-per-node 2 launch/train_example.py --steps 50
It logs one line per step from rank 0 (step, loss, world size), uses gloo on CPU and
nccl on GPU, and is the workload of elastic-rt's tests and benchmarks.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from elastic_rt.data import ElasticDistributedSampler

try:
    from elastic_rt.health.heartbeat import report_step
except ImportError:  # the heartbeat is optional for this example
    def report_step(step: int) -> None:
        return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps to run in total")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="simulated extra compute per step, in seconds (tests use it to stretch a run)")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--log-indices", action="store_true",
                   help="log a digest of the sample indices every rank trained on at each step")
    return p.parse_args(argv)


def make_dataset(size: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(size, 1, generator=g)
    return TensorDataset(torch.arange(size), x, y)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def main(argv=None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    stop = {"signal": None}
    signal.signal(signal.SIGTERM, lambda s, _f: stop.update(signal=s))

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1)).to(device)
    ddp = DDP(model, device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    dataset = make_dataset(args.dataset_size, args.seed)
    sampler = ElasticDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    step = 0
    if rank == 0:
        print(f"start step={step} world_size={world} backend={backend} "
              f"restart={os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", flush=True)
    while step < args.steps and stop["signal"] is None:
        sampler.set_epoch(step * args.batch_size * world // max(1, args.dataset_size))
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=False)
        for idx, x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sampler.advance(args.batch_size * world)
            step += 1
            report_step(step)
            if args.log_indices:
                gathered = [torch.zeros_like(idx) for _ in range(world)]
                dist.all_gather(gathered, idx.to(device) if backend == "nccl" else idx)
                if rank == 0:
                    print(f"indices step={step} epoch={sampler.epoch} "
                          f"idx={','.join(str(int(i)) for t in gathered for i in t)}", flush=True)
            if rank == 0 and step % args.log_every == 0:
                print(f"step={step} loss={loss.item():.6f} world_size={world}", flush=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if step >= args.steps or stop["signal"] is not None:
                break
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    if rank == 0:
        state = "stopped" if stop["signal"] is not None else "done"
        print(f"{state} steps={step} world_size={world} param_digest={digest(params)}", flush=True)
    dist.barrier()  # nobody tears down gloo while a peer still talks to it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
