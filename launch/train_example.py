"""Example elastic training job: a small deterministic DDP regression on synthetic data.

Run it on one machine with no etcd:
    elastic-rt launch --standalone --nproc-per-node 2 --tee 3 launch/train_example.py --steps 50
Rank 0 logs one line per step (step, the step's mean loss over all ranks, world size). It
uses gloo on CPU and nccl on GPU, the elastic sampler (every sample once per epoch across
restarts and resizes) and, with --ckpt-url (or ELASTIC_RT_CHECKPOINT_URL), sharded
checkpoints: after any restart or resize it resumes from the last committed one. SIGTERM
(preemption) saves and exits 0. It is the workload of elastic-rt's tests and benchmarks.

With --global-batch-size B every optimizer step trains the next B samples at any world size
(micro-batches of --micro-batch-size per rank, gradient accumulation): a resized job trains the
same model as an uninterrupted one (docs/sampler.md). Without it, each rank trains
--batch-size samples per step, so a step's global batch is --batch-size x world size.
"""

from __future__ import annotations

import argparse
import gc
from functools import partial
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from elastic_rt import report_checkpoint, report_step
from elastic_rt.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from elastic_rt.data import ElasticDistributedSampler, GlobalBatchSampler
from elastic_rt.errors import ElasticRTError
from elastic_rt.worker_env import WorkerEnvironment


EXIT_PEER_PREEMPTED = 75  # EX_TEMPFAIL: stopped because a peer was preempted; restart me


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps to run in total")
    p.add_argument("--batch-size", type=int, default=8,
                   help="samples per rank per step (without --global-batch-size)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step at any world size (the fixed global batch plan)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="with --global-batch-size: at most this many samples per rank per forward (default --batch-size)")
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="raise the learning rate linearly over the first N optimizer steps")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="simulated extra compute per step, in seconds (tests use it to stretch a run)")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--log-indices", action="store_true",
                   help="log the sample indices all ranks trained on at each step (rank 0)")
    p.add_argument("--ckpt-url", default=None,
                   help="fsspec URL of the checkpoints (default: $ELASTIC_RT_CHECKPOINT_URL; none: no checkpoints)")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--async-save", action="store_true", help="upload checkpoints in the background")
    p.add_argument("--final-params", default=None,
                   help="rank 0 writes the final parameters here (torch.save of one flat tensor)")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def make_dataset(size: int, seed: int, dtype: torch.dtype = torch.float32) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(size, 1, generator=g)
    return TensorDataset(torch.arange(size), x.to(dtype), y.to(dtype))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def build(args, device: torch.device, local_rank: int):
    """(model, its DDP wrapper, optimizer, dataset, sampler, GlobalBatchSampler or None), the same on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1)).to(device, dtype)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    dataset = make_dataset(args.dataset_size, args.seed, dtype)
    sampler = ElasticDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    batches = None
    if args.global_batch_size is not None:  # raises at B < world size
        batches = GlobalBatchSampler(sampler, global_batch_size=args.global_batch_size,
                                     micro_batch_size=args.micro_batch_size or args.batch_size)
    return model, ddp, opt, dataset, sampler, batches


def training_steps(ddp, dataset, sampler: ElasticDistributedSampler, batches: GlobalBatchSampler | None,
                   per_rank_batch: int, device: torch.device):
    """Optimizer steps from the sampler's progress on, epoch after epoch. Yields, with the step's
    gradients ready: (the indices this rank trained, this rank's share of the step's mean loss,
    the epoch, what to call after optimizer.step() to record the step in the sampler)."""
    world = sampler.num_replicas
    epoch = sampler.epoch
    while True:
        sampler.set_epoch(epoch)  # the restored epoch keeps its progress
        fresh, trained = sampler.consumed == 0, False
        if batches is None:  # per-rank batches: the global batch is per_rank_batch x world size
            for idx, x, y in DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler):
                loss = nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
                loss.backward()
                trained = True
                yield idx.tolist(), loss.detach() / world, epoch, partial(sampler.advance, per_rank_batch * world)
        else:  # the fixed global batch: micro-batches, each rank's last one all-reduces
            for step in batches.steps(DataLoader(dataset, batch_sampler=batches)):
                indices, share = [], torch.zeros((), device=device)
                for micro, (idx, x, y) in step:
                    with micro.accumulate(ddp):
                        loss = nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
                        (loss * micro.loss_scale).backward()
                    share = share + loss.detach() * micro.weight
                    if not micro.padding:
                        indices += idx.tolist()
                trained = True
                yield indices, share, epoch, step.commit
        if fresh and not trained:
            return  # an empty dataset
        epoch += 1


def save_params(path: str, params: torch.Tensor) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(params.detach().cpu().clone(), tmp)
    os.replace(tmp, path)  # a reader never sees half a file


def main(argv=None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        return train(args, device, local_rank, backend)
    except ElasticRTError as exc:  # bad flags or state: one line, not a traceback
        print(f"train_example.py: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


def train(args, device: torch.device, local_rank: int, backend: str) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    sigterm: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, _f: sigterm.append(s))
    model, ddp, opt, dataset, sampler, batches = build(args, device, local_rank)

    url = args.ckpt_url or WorkerEnvironment.from_env().checkpoint_url
    mgr = None
    if url:
        def on_saved(stats) -> None:
            if local_rank == 0:  # the agent exports it as elastic_rt_checkpoint_* metrics
                report_checkpoint(step=stats.step, save_duration_s=stats.save_duration_s, blocked_s=stats.blocked_s)
            if rank == 0:
                print(f"checkpoint saved step={stats.step} world_size={stats.world_size} "
                      f"blocked_s={stats.blocked_s:.4f} save_s={stats.save_duration_s:.4f}", flush=True)

        mgr = CheckpointManager(url, keep_last=3, async_save=args.async_save, on_saved=on_saved)
        mgr.guard_optimizer(opt)

    def checkpoint_state(step: int) -> dict:
        model_sd, optim_sd = get_state_dict(ddp, opt)
        return {"model": model_sd, "optim": optim_sd, "sampler": sampler.state_dict(),
                "rng": capture_rng_state(), "extra": {"step": step}}

    step = 0
    if mgr is not None:
        state = checkpoint_state(0)
        loaded = mgr.load_latest(state)
        if loaded is not None:
            set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            sampler.load_state_dict(state["sampler"])
            restore_rng_state(state["rng"])
            step = loaded
            if batches is not None:  # saved with another global batch size: refused
                batches.check_step(step)
    if rank == 0:
        print(f"start step={step} world_size={world} backend={backend} "
              f"restart={os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", flush=True)

    def lr_at(step: int) -> float:  # keyed on optimizer steps: the same schedule at any world size
        return args.lr * min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else args.lr

    stop = False
    steps = training_steps(ddp, dataset, sampler, batches, args.batch_size, device) if step < args.steps else iter(())
    for idx, loss_share, epoch, commit in steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        commit()  # the sampler's progress now includes this step
        step += 1
        if args.log_indices:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, idx)
            if rank == 0:
                print(f"indices step={step} epoch={epoch} "
                      f"idx={','.join(str(i) for part in gathered for i in part)}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        # One all-reduce: any rank's SIGTERM (every rank stops at the same step) and the mean loss.
        sync = torch.stack([torch.tensor(float(bool(sigterm)), device=device, dtype=torch.float64),
                            loss_share.to(torch.float64)])
        dist.all_reduce(sync)
        stop = bool(sync[0].item())
        report_step(step)  # after the step's last collective: every rank has finished it, none is ahead
        if rank == 0 and step % args.log_every == 0:
            print(f"step={step} loss={sync[1].item()!r} world_size={world}", flush=True)
        if mgr is not None and (step % args.save_every == 0 or stop):
            mgr.save(step, checkpoint_state(step))
        if step >= args.steps or stop:
            break
    if mgr is not None:
        mgr.close()  # waits for a background upload; raises if it failed
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    if rank == 0:
        if args.final_params:
            save_params(args.final_params, params)
        state = "stopped" if stop else "done"
        print(f"{state} steps={step} world_size={world} param_digest={digest(params)}", flush=True)
    dist.barrier()  # nobody tears down gloo while a peer still talks to it
    # Free the DDP module while the group is still registered: if its Reducer held the group's
    # last reference, freeing it later (with the GIL held) would run gloo's destructor, which can
    # wait forever for a gloo thread that needs the GIL (README: "No hang at worker exit").
    ddp = opt = steps = None
    gc.collect()
    dist.destroy_process_group()
    if stop and not sigterm:
        # Another node was preempted: we saved with it, but the job is not finished.
        # A non-zero exit makes our agent re-form the group without that node.
        return EXIT_PEER_PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
