"""ElasticDistributedSampler: a DistributedSampler whose epoch progress survives restarts and resizes."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Mapping

import torch.distributed as dist
from torch.utils.data import Sampler

from elastic_rt.data.partition import Partition, epoch_order
from elastic_rt.data.sampler_state import SamplerConfigError, SamplerState, is_int


def _world_from_process_group(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is not None and rank is not None:
        return num_replicas, rank
    if not (dist.is_available() and dist.is_initialized()):
        raise SamplerConfigError(
            "num_replicas/rank not given and torch.distributed is not initialized; "
            "pass num_replicas= and rank= or call init_process_group() first"
        )
    return (
        dist.get_world_size() if num_replicas is None else num_replicas,
        dist.get_rank() if rank is None else rank,
    )


class ElasticDistributedSampler(Sampler[int]):
    """Drop-in for torch's DistributedSampler with exactly-once progress across restarts.

    Iterating yields this rank's share of the *remaining* part of the current epoch.
    Call ``advance(global_batch_size)`` after every optimizer step; save ``state_dict()``
    with the checkpoint; ``load_state_dict()`` into a sampler of any world size
    re-partitions what is left. With a constant world and no ``advance`` calls the
    indices are exactly DistributedSampler's. See docs/sampler.md.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(dataset, Sized):
            raise SamplerConfigError(
                f"dataset must have a length (implement __len__), got {type(dataset).__name__}"
            )
        num_replicas, rank = _world_from_process_group(num_replicas, rank)
        if not is_int(num_replicas) or num_replicas < 1:
            raise SamplerConfigError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        if not is_int(rank) or not 0 <= rank < num_replicas:
            raise SamplerConfigError(
                f"Invalid rank {rank!r}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        if not is_int(seed):
            raise SamplerConfigError(f"seed must be an int, got {seed!r}")
        self.dataset = dataset
        self._dataset_length = len(dataset)
        self._num_replicas = num_replicas
        self._rank = rank
        self._shuffle = bool(shuffle)
        self._seed = seed
        self._drop_last = bool(drop_last)
        self._epoch = 0
        self._consumed = 0
        self._iterated: Partition | None = None

    # Read-only views of the configuration (DistributedSampler exposes these names).
    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def dataset_length(self) -> int:
        """``len(dataset)``, read once at construction."""
        return self._dataset_length

    @property
    def consumed(self) -> int:
        """Positions of this epoch's global order consumed by committed steps (a prefix)."""
        return self._consumed

    @property
    def partition(self) -> Partition:
        """This rank's share of the remaining epoch, as the next ``iter()`` will yield it."""
        return Partition(
            dataset_length=self._dataset_length,
            start=self._consumed,
            num_replicas=self._num_replicas,
            rank=self._rank,
            drop_last=self._drop_last,
        )

    @property
    def num_samples(self) -> int:
        return self.partition.num_samples

    @property
    def total_size(self) -> int:
        return self.partition.total_size

    def __len__(self) -> int:
        return self.partition.num_samples

    def __iter__(self) -> Iterator[int]:
        partition = self.partition
        order = epoch_order(
            dataset_length=self._dataset_length,
            seed=self._seed,
            epoch=self._epoch,
            shuffle=self._shuffle,
        )
        self._iterated = partition
        # Materialized now: later advance() calls must not move a pass already under way
        # (a DataLoader pulls indices ahead of the training loop).
        return iter(partition.indices(order))

    def is_padding(self, position: int) -> bool:
        """Whether the ``position``-th index of the latest pass is padding.

        ``position`` counts from 0 over what this rank's latest ``iter()`` yielded (with a
        DataLoader of per-rank batch b: slot j of step k is ``k*b + j``). Padding exists
        only with drop_last=False, is at most one index per rank, and is always the
        last index of the pass. Before any ``iter()``, refers to the pass ``iter()``
        would yield now.
        """
        if not is_int(position):
            raise SamplerConfigError(f"position must be an int, got {position!r}")
        partition = self._iterated if self._iterated is not None else self.partition
        return partition.is_padding(position)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a different epoch starts it from its beginning.

        Setting the epoch the sampler already holds (as after ``load_state_dict``) keeps
        the progress, so a resumed loop may call ``set_epoch(epoch)`` as usual.
        """
        if not is_int(epoch):
            raise SamplerConfigError(f"epoch must be an int, got {epoch!r}")
        if epoch != self._epoch:
            self._epoch = epoch
            self._consumed = 0
            self._iterated = None

    def advance(self, global_batch_size: int) -> None:
        """Record that one committed step consumed ``global_batch_size`` positions.

        ``global_batch_size`` is the per-rank batch size times ``num_replicas`` (the
        whole world's step). A short last batch may be passed either as its real size or
        as the full batch size: progress stops at the end of the epoch's real data.
        """
        if not is_int(global_batch_size) or global_batch_size < 0:
            raise SamplerConfigError(
                f"advance() takes the global batch size as an int >= 0, got {global_batch_size!r}"
            )
        if global_batch_size % self._num_replicas:
            raise SamplerConfigError(
                f"advance({global_batch_size}): the global batch size must be a multiple of "
                f"num_replicas ({self._num_replicas}); pass per-rank batch size * num_replicas"
            )
        if global_batch_size == 0:
            return
        end = self.partition.end
        if self._consumed >= end:
            raise SamplerConfigError(
                f"advance({global_batch_size}) after epoch {self._epoch} was already fully "
                f"consumed ({self._consumed} of {self._dataset_length} samples); call "
                f"set_epoch({self._epoch + 1}) before the next epoch"
            )
        self._consumed = min(self._consumed + global_batch_size, end)

    def advance_positions(self, count: int) -> None:
        """Record that one committed step consumed the next ``count`` positions of the order.

        The exact form of ``advance`` for steps that are not the same count on every rank
        (GlobalBatchSampler's fixed global batch calls it): any ``count`` from 0 up to what
        is left of the epoch's real positions; no rounding, no clipping.
        """
        if not is_int(count) or count < 0:
            raise SamplerConfigError(f"advance_positions() takes an int >= 0, got {count!r}")
        if self._consumed + count > self._dataset_length:
            raise SamplerConfigError(
                f"advance_positions({count}) would pass the end of epoch {self._epoch} "
                f"({self._consumed} of {self._dataset_length} samples consumed); call "
                f"set_epoch({self._epoch + 1}) before the next epoch"
            )
        self._consumed += count

    def state_dict(self) -> dict[str, int | bool]:
        """Plain data describing progress through the epoch; the same on every rank."""
        return SamplerState(
            epoch=self._epoch,
            seed=self._seed,
            consumed=self._consumed,
            dataset_length=self._dataset_length,
            shuffle=self._shuffle,
            drop_last=self._drop_last,
        ).to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the saved epoch where its committed steps left off, on this world.

        Raises SamplerStateError for a malformed state and SamplerStateMismatchError
        for one saved with another dataset length, seed, shuffle or drop_last; the
        sampler is left unchanged in both cases.
        """
        loaded = SamplerState.from_dict(state)
        loaded.check_compatible(
            dataset_length=self._dataset_length,
            seed=self._seed,
            shuffle=self._shuffle,
            drop_last=self._drop_last,
        )
        self._epoch = loaded.epoch
        self._consumed = loaded.consumed
        self._iterated = None
