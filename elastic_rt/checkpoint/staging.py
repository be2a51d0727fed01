"""Host staging for async saves: reusable buffers, filled by a DCP planner with this rank's share only."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from elastic_rt.checkpoint.user_state import storage_ptr

BufferKey = tuple[str, tuple[int, ...] | None]


class BufferPool:
    """Host tensors kept between saves, one per write item, so a save copies into memory
    that is already mapped (allocating and faulting in fresh pages costs ~20x the copy)."""

    def __init__(self) -> None:
        self._buffers: dict[BufferKey, torch.Tensor] = {}

    @staticmethod
    def key(index: MetadataIndex) -> BufferKey:
        return index.fqn, (tuple(index.offset) if index.offset is not None else None)

    def get(self, index: MetadataIndex, like: torch.Tensor) -> torch.Tensor:
        key = self.key(index)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = like.device.type == "cuda" and torch.cuda.is_available()
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def retain_only(self, keys: set[BufferKey]) -> None:
        """Drop buffers of items that are no longer saved by this rank."""
        for key in list(self._buffers):
            if key not in keys:
                del self._buffers[key]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()


def dedup_replicated(plans: list[SavePlan], balanced_fqns: set[str]) -> list[SavePlan]:
    """Keep one writer per item that several ranks hold (replicated tensors and objects).
    Items named in balanced_fqns (known to be identical on every rank) go to the least
    loaded rank, largest first; all others to the lowest rank holding them, because
    "replicated" state such as DDP BatchNorm buffers can differ between ranks and rank
    0's copy is the canonical one (DDP broadcasts it)."""
    owners: dict[MetadataIndex, list[int]] = {}
    items: dict[MetadataIndex, WriteItem] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            owners.setdefault(item.index, []).append(rank)
            items[item.index] = item
    load = [0] * len(plans)
    keep: list[set[MetadataIndex]] = [set() for _ in plans]
    balanced = []
    for index, ranks in owners.items():
        if len(ranks) > 1 and index.fqn in balanced_fqns:
            balanced.append(index)
            continue
        keep[ranks[0]].add(index)
        load[ranks[0]] += items[index].tensor_storage_size() or 1
    balanced.sort(key=lambda index: items[index].tensor_storage_size() or 1, reverse=True)
    for index in balanced:
        chosen = min(owners[index], key=lambda rank: (load[rank], rank))
        keep[chosen].add(index)
        load[chosen] += items[index].tensor_storage_size() or 1
    return [
        dataclasses.replace(plan, items=[item for item in plan.items if item.index in keep[rank]])
        for rank, plan in enumerate(plans)
    ]


class StagingSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner with dedup_replicated(); once the global plan is known it copies
    exactly the items this rank writes into the pool and serves writes from those copies.
    Without a pool it writes from the live tensors (a synchronous save).
    balance_ptrs: storages of tensors identical on every rank (parameters and optimizer
    state of guarded optimizers). on_staged(staging_s) is called when the copy is done."""

    def __init__(
        self,
        *,
        pool: BufferPool | None,
        on_staged: Callable[[float], None],
        balance_ptrs: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(dedup_save_to_lowest_rank=True)
        self._pool = pool
        self._on_staged = on_staged
        self._balance_ptrs = balance_ptrs
        self._staged: dict[MetadataIndex, torch.Tensor] = {}

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        balanced = {
            fqn
            for fqn, value in self.state_dict.items()
            if isinstance(value, torch.Tensor) and storage_ptr(value) in self._balance_ptrs
        }
        return dedup_replicated(all_plans, balanced)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        started = time.perf_counter()
        if self._pool is not None:
            self._stage(plan.items)
        self._on_staged(time.perf_counter() - started)
        return plan

    def _stage(self, items: list[WriteItem]) -> None:
        devices = set()
        used: set[BufferKey] = set()
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                continue  # objects were deep-copied when save() was called
            src = super().resolve_data(item)
            if not isinstance(src, torch.Tensor):
                continue
            src = src.detach()
            buf = self._pool.get(item.index, src)  # type: ignore[union-attr]
            buf.copy_(src, non_blocking=src.device.type == "cuda")
            if src.device.type == "cuda":
                devices.add(src.device)
            self._staged[item.index] = buf
            used.add(BufferPool.key(item.index))
        for device in devices:
            torch.cuda.synchronize(device)
        self._pool.retain_only(used)  # type: ignore[union-attr]

    def resolve_data(self, write_item: WriteItem) -> Any:
        staged = self._staged.get(write_item.index)
        if staged is not None:
            return staged
        return super().resolve_data(write_item)
