"""The checkpoint's own gloo process groups and the few object collectives it needs."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic_rt.errors import ConfigError


@dataclass(kw_only=True)
class CheckpointGroups:
    """Two gloo groups over the job's ranks: `io` for the (possibly background) writer and for
    loads, `ctl` for decisions taken on the training thread. Own groups keep checkpoint
    collectives off the training group (NCCL streams, DDP all-reduces in another thread).
    Without torch.distributed both are None: a single process, rank 0 of 1."""

    io: dist.ProcessGroup | None
    ctl: dist.ProcessGroup | None
    rank: int
    world_size: int

    @classmethod
    def create(cls, process_group: dist.ProcessGroup | None, timeout_s: float) -> "CheckpointGroups":
        if not (dist.is_available() and dist.is_initialized()):
            if process_group is not None:
                raise ConfigError("process_group was given but torch.distributed is not initialized")
            return cls(io=None, ctl=None, rank=0, world_size=1)
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        timeout = timedelta(seconds=timeout_s)
        io = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, group_desc="elastic_rt_ckpt_io")
        ctl = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, group_desc="elastic_rt_ckpt_ctl")
        rank = dist.get_rank(io)
        if rank < 0:
            raise ConfigError("this process is not a member of the checkpoint process_group")
        return cls(io=io, ctl=ctl, rank=rank, world_size=dist.get_world_size(io))

    def destroy(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        for group in (self.io, self.ctl):
            if group is not None:
                dist.destroy_process_group(group)
        self.io = self.ctl = None


def broadcast(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """Group rank 0's obj, on every rank."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every rank's obj in rank order on group rank 0; None elsewhere."""
    if group is None:
        return [obj]
    is_root = dist.get_rank(group) == 0
    out: list[Any] | None = [None] * dist.get_world_size(group) if is_root else None
    dist.gather_object(obj, out, group=group, group_dst=0)
    return out


def all_gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def any_true(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """True on every rank if flag is true on any rank."""
    if group is None:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())
