"""The global batch plan: how each optimizer step's B positions split into per-rank micro-batches at any world size."""

# Layout (pure arithmetic on positions of the epoch's global order, see partition.py):
#
# * Optimizer steps consume the epoch's order in chunks of B positions from ``consumed``:
#   step k covers ``[consumed + k*B, consumed + (k+1)*B)``. What is left at the end of the
#   epoch, fewer than B positions, is a short last step (drop_last=False) or not trained
#   (drop_last=True). None of this depends on the world size W.
# * Within a step starting at s with n samples, rank r takes the positions
#   ``s + r, s + r + W, s + r + 2W, ... < s + n`` (the interleaved split), n_r of them, and
#   cuts them into micro-batches of at most b: ``ceil(n_r / b)`` micro-batches, all of b
#   samples but the last. With B = b*W this is exactly one micro-batch per rank holding the
#   positions ElasticDistributedSampler (and so DistributedSampler) gives that rank.
# * A micro-batch of m samples scales its mean loss by ``W * m / n``: rank r's accumulated
#   gradient is then ``(W/n) * sum of its samples' gradients`` and DDP's all-reduce, a mean
#   over W ranks, is the mean over the step's n samples, whatever the split.
# * B >= W, so every rank has at least one sample in every full step. Only a short last
#   step may leave rank r (r >= n) without one: it gets one padding micro-batch (position
#   ``s + r`` >= N, i.e. ``order[(s + r - N) % N]``) with loss scale 0, so it still joins
#   the all-reduce, with a zero gradient.
# * Ranks may hold different numbers of micro-batches. Each rank runs all but its last
#   under DDP's no_sync() (local accumulation, no communication) and its last with sync:
#   every rank joins exactly one gradient all-reduce per step.

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from elastic_rt.data.sampler_state import SamplerConfigError, is_int


class BatchPlanError(SamplerConfigError):
    """A global batch plan cannot be built or used: bad sizes, a world too large, a misused step."""


@runtime_checkable
class SupportsNoSync(Protocol):
    """A data-parallel wrapper that can skip its gradient all-reduce (DDP's ``no_sync``)."""

    def no_sync(self) -> AbstractContextManager[None]: ...


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """One forward and backward on one rank: its positions and the weight of its loss."""

    positions: tuple[int, ...]
    weight: float  # this micro-batch's share of the step's samples (0 for padding)
    loss_scale: float  # world size x weight: multiplies the loss averaged over this micro-batch
    padding: bool  # a stand-in sample (weight 0) for a rank with nothing in a short last step
    last: bool  # the rank's last micro-batch of the step: its backward all-reduces

    def __len__(self) -> int:
        return len(self.positions)

    def accumulate(self, model: object) -> AbstractContextManager[None]:
        """Context for this micro-batch's forward and backward: ``model.no_sync()`` (gradients
        accumulate locally) unless it is the rank's last micro-batch of the step, whose backward
        all-reduces. A model without ``no_sync`` (no DDP) gets a context that does nothing."""
        if self.last or not isinstance(model, SupportsNoSync):
            return nullcontext()
        return model.no_sync()


@dataclass(frozen=True, kw_only=True)
class StepLayout:
    """One optimizer step of the plan: the positions it consumes and this rank's micro-batches."""

    index: int  # optimizer steps of this epoch before this one
    start: int  # first position of the epoch's order the step consumes
    size: int  # real samples in the step: B, or fewer in a short last step
    world_size: int
    rank: int
    micro_batches: tuple[MicroBatch, ...]

    @property
    def stop(self) -> int:
        """One past the last position the step consumes (the sampler's ``consumed`` after it)."""
        return self.start + self.size

    def rank_positions(self) -> list[int]:
        """This rank's real positions in the step, micro-batch by micro-batch."""
        return [p for m in self.micro_batches if not m.padding for p in m.positions]


def _check_size(name: str, value: object) -> int:
    if not is_int(value) or value < 1:  # type: ignore[operator]
        raise BatchPlanError(f"{name} must be an int >= 1, got {value!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class GlobalBatchPlan:
    """A fixed global batch: ``global_batch_size`` samples per optimizer step at any world size,
    in micro-batches of at most ``micro_batch_size`` samples per rank (gradient accumulation)."""

    global_batch_size: int
    micro_batch_size: int

    def __post_init__(self) -> None:
        _check_size("global_batch_size", self.global_batch_size)
        _check_size("micro_batch_size", self.micro_batch_size)

    def check_world(self, world_size: int) -> None:
        """Refuse a world in which some rank would have no sample in a full step (B < W)."""
        _check_size("world_size", world_size)
        if self.global_batch_size < world_size:
            raise BatchPlanError(
                f"a global batch of {self.global_batch_size} samples cannot be split over "
                f"{world_size} ranks (every rank needs at least one sample per optimizer step); "
                f"use a global batch of at least {world_size} or at most "
                f"{self.global_batch_size} workers (--nnodes MAX x --nproc-per-node)"
            )

    def epoch_end(self, *, dataset_length: int, consumed: int, drop_last: bool) -> int:
        """The ``consumed`` count at which the steps from ``consumed`` on have finished the epoch."""
        if drop_last:
            return consumed + (dataset_length - consumed) // self.global_batch_size * self.global_batch_size
        return dataset_length

    def steps_per_epoch(self, *, dataset_length: int, drop_last: bool) -> int:
        """Optimizer steps in a whole epoch: the same at every world size."""
        if drop_last:
            return dataset_length // self.global_batch_size
        return -(-dataset_length // self.global_batch_size)

    def steps_done(self, consumed: int) -> int:
        """Optimizer steps of this plan that consumed the first ``consumed`` positions of an epoch."""
        return -(-consumed // self.global_batch_size)

    def step(
        self, *, start: int, size: int, dataset_length: int, world_size: int, rank: int, index: int = 0
    ) -> StepLayout:
        """Rank ``rank``'s micro-batches of the step consuming ``size`` positions from ``start``."""
        self.check_world(world_size)
        if not 0 <= rank < world_size:
            raise BatchPlanError(f"rank {rank} is not in a world of {world_size}")
        if not 1 <= size <= self.global_batch_size or start + size > dataset_length:
            raise BatchPlanError(
                f"a step of {size} samples from position {start} does not fit a global batch of "
                f"{self.global_batch_size} in an epoch of {dataset_length}"
            )
        mine = list(range(start + rank, start + size, world_size))
        if not mine:  # a short last step with fewer samples than ranks
            micro = (
                MicroBatch(positions=(start + rank,), weight=0.0, loss_scale=0.0, padding=True, last=True),
            )
        else:
            b = self.micro_batch_size
            chunks = [mine[i:i + b] for i in range(0, len(mine), b)]
            micro = tuple(
                MicroBatch(
                    positions=tuple(chunk),
                    weight=len(chunk) / size,
                    loss_scale=world_size * len(chunk) / size,
                    padding=False,
                    last=i == len(chunks) - 1,
                )
                for i, chunk in enumerate(chunks)
            )
        return StepLayout(
            index=index, start=start, size=size, world_size=world_size, rank=rank, micro_batches=micro
        )

    def steps(
        self, *, consumed: int, dataset_length: int, world_size: int, rank: int, drop_last: bool
    ) -> list[StepLayout]:
        """The rest of the epoch from ``consumed`` on, step by step, as rank ``rank`` runs it."""
        self.check_world(world_size)
        end = self.epoch_end(dataset_length=dataset_length, consumed=consumed, drop_last=drop_last)
        first = self.steps_done(consumed)
        return [
            self.step(
                start=start,
                size=min(self.global_batch_size, end - start),
                dataset_length=dataset_length,
                world_size=world_size,
                rank=rank,
                index=first + k,
            )
            for k, start in enumerate(range(consumed, end, self.global_batch_size))
        ]
