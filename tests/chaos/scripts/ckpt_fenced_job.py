"""A small DDP job that checkpoints with CheckpointManager every few steps, for the stale-rank-0 test.

Its rank 0 can be held just before a commit (tests/support/checkpoint.py, phase "commit"): while
the file --pause-file exists and holds this job's world size, rank 0's next commit waits, after
creating PAUSE_FILE.rank0.paused with the step and the rendezvous round (ELASTIC_RT_ROUND). Only a
group of that size is held, so the group that re-forms without a node saves freely.

Global rank 0 prints `start step=N world_size=W round=R`, `checkpoint saved step=N round=R` after each
commit, and `checkpoint refused: <the error's line>` when a save fails (then it exits 3); `done
steps=N` at the end.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from elastic_rt.errors import CheckpointError  # noqa: E402
from tests.support.checkpoint import PHASE_COMMIT, PausingCheckpointManager  # noqa: E402

ROUND = os.environ.get("ELASTIC_RT_ROUND", "")


class WorldPause:
    """Hold rank 0's commit while the pause file names this job's world size."""

    def __init__(self, path: str, world_size: int) -> None:
        self.path, self.world_size = path, world_size

    def _armed(self) -> bool:
        try:
            with open(self.path) as f:
                return f.read().strip() == str(self.world_size)
        except FileNotFoundError:
            return False

    def __call__(self, *, rank: int, step: int, phase: str) -> None:
        if phase != PHASE_COMMIT or not self._armed():
            return
        marker = f"{self.path}.rank{rank}.paused"
        with open(marker + ".tmp", "w") as f:
            f.write(f"{step} {ROUND}\n")
        os.replace(marker + ".tmp", marker)  # whole when it appears
        while self._armed():
            time.sleep(0.02)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--pause-file", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # keep every checkpoint: the test checks that each one the new group saved is still there
    mgr = PausingCheckpointManager(args.url, keep_last=1000, pause_hook=WorldPause(args.pause_file, world))
    mgr.guard_optimizer(opt)

    def state(step: int) -> dict:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd, "extra": {"step": step}}

    step = 0
    loaded_state = state(0)
    loaded = mgr.load_latest(loaded_state)
    if loaded is not None:
        set_state_dict(model, opt, model_state_dict=loaded_state["model"], optim_state_dict=loaded_state["optim"])
        step = loaded
    if rank == 0:
        print(f"start step={step} world_size={world} round={ROUND}", flush=True)
    while step < args.steps:
        loss = model(torch.randn(16, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        time.sleep(args.step_sleep)
        if step % args.save_every == 0:
            try:
                mgr.save(step, state(step))
            except CheckpointError as exc:
                if rank == 0:
                    print(f"checkpoint refused: {exc}", flush=True)
                return 3
            if rank == 0:
                print(f"checkpoint saved step={step} round={ROUND}", flush=True)
    mgr.close()
    dist.barrier()
    if rank == 0:
        print(f"done steps={step} world_size={world}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
