"""The example's model trained twice side by side in one elastic job, through the same failures and resizes.

One copy with the fixed global batch (--global-batch-size, --micro-batch-size), one with per-rank
batches (--batch-size per rank, the global batch follows the world size), built and stepped by
launch/train_example.py's own code, checkpointed together every --save-every steps. Global rank 0
logs `step=N loss=X world_size=W` for the planned copy (the example's line) and
`per_rank step=N loss=X world_size=W` for the other; SIGTERM saves, writes --final-params (planned)
and --per-rank-final-params, and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: launch/ is a folder there

from elastic_rt.checkpoint import CheckpointManager  # noqa: E402
from launch.train_example import EXIT_PEER_PREEMPTED, build, build_parser, save_params, training_steps  # noqa: E402

COPIES = ("planned", "per_rank")


def main() -> int:
    p = build_parser()
    p.add_argument("--per-rank-final-params", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sigterm: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, _f: sigterm.append(s))
    device = torch.device("cpu")
    copies = {
        "planned": build(args, device, 0),  # (model, ddp, opt, dataset, sampler, batches)
        "per_rank": build(argparse.Namespace(**{**vars(args), "global_batch_size": None}), device, 0),
    }
    mgr = CheckpointManager(args.ckpt_url, keep_last=2, on_saved=lambda st: rank == 0 and print(
        f"checkpoint saved step={st.step} world_size={st.world_size}", flush=True))

    def state(step: int) -> dict:
        out: dict = {"extra": {"step": step}}
        for name, (_, ddp, opt, _, sampler, _) in copies.items():
            model_sd, optim_sd = get_state_dict(ddp, opt)
            out[name] = {"model": model_sd, "optim": optim_sd, "sampler": sampler.state_dict()}
        return out

    loaded = state(0)
    step = mgr.load_latest(loaded) or 0
    if step:
        for name, (_, ddp, opt, _, sampler, batches) in copies.items():
            set_state_dict(ddp, opt, model_state_dict=loaded[name]["model"], optim_state_dict=loaded[name]["optim"])
            sampler.load_state_dict(loaded[name]["sampler"])
        copies["planned"][5].check_step(step)
    if rank == 0:
        print(f"start step={step} world_size={world}", flush=True)

    def lr_at(step: int) -> float:
        return args.lr * min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else args.lr

    streams = [training_steps(ddp, dataset, sampler, batches, args.batch_size, device)
               for (_, ddp, _, dataset, sampler, batches) in copies.values()]
    stop = False
    for pair in zip(*streams):
        shares = []
        for (_, _, opt, *_), (_, share, _, commit) in zip(copies.values(), pair):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            commit()
            shares.append(share.to(torch.float64))
        step += 1
        time.sleep(args.step_sleep)
        sync = torch.stack([torch.tensor(float(bool(sigterm)), dtype=torch.float64), *shares])
        dist.all_reduce(sync)
        stop = bool(sync[0].item())
        if rank == 0:
            print(f"step={step} loss={sync[1].item()!r} world_size={world}", flush=True)
            print(f"per_rank step={step} loss={sync[2].item()!r} world_size={world}", flush=True)
        if step % args.save_every == 0 or stop:
            mgr.save(step, state(step))
        if stop or step >= args.steps:
            break
    mgr.close()
    if rank == 0:
        for name, path in (("planned", args.final_params), ("per_rank", args.per_rank_final_params)):
            save_params(path, torch.cat([p.detach().flatten() for p in copies[name][0].parameters()]))
        print(f"{'stopped' if stop else 'done'} steps={step} world_size={world}", flush=True)
    dist.barrier()
    copies = streams = None  # free the DDP modules while the group is registered (see train_example.py)
    gc.collect()
    dist.destroy_process_group()
    return EXIT_PEER_PREEMPTED if stop and not sigterm else 0


if __name__ == "__main__":
    sys.exit(main())
