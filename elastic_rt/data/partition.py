"""The partition layout: an epoch's global order and one rank's share of what remains of it."""

# Layout (the same as torch's DistributedSampler when nothing has been consumed yet):
#
# * The epoch's global order is ``order = randperm(N)`` from ``manual_seed(seed + epoch)``
#   (or ``range(N)`` without shuffle). "Position" p means ``order[p]``.
# * After ``start`` positions have been consumed, the remaining positions
#   ``start, start+1, ..., N-1`` are padded (drop_last=False) up to a multiple of the world
#   size W with positions N, N+1, ...; position ``p >= N`` is padding and holds
#   ``order[(p - N) % N]``, i.e. it repeats the start of the epoch's order exactly like
#   DistributedSampler. With drop_last=True the remainder is cut down to a multiple of W.
# * Rank r takes every W-th position: ``start + r, start + r + W, start + r + 2W, ...``.
#
# So local sample ``k*b + j`` (step k, batch slot j) of rank r is global position
# ``start + (k*b + j)*W + r``. Over all ranks and slots, step k covers exactly the positions
# ``start + k*b*W ... start + (k+1)*b*W - 1``: every global step consumes the next
# contiguous ``b*W`` positions, and committed progress is one integer, a prefix length.

from __future__ import annotations

from dataclasses import dataclass

import torch


def epoch_order(*, dataset_length: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's global order, identical on every rank, from (seed, epoch) alone."""
    if not shuffle:
        return list(range(dataset_length))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(dataset_length, generator=generator).tolist()


def position_index(order: list[int], position: int) -> int:
    """The dataset index at ``position`` of the epoch's order; positions from N on are padding
    and repeat the start of the order (``order[(position - N) % N]``)."""
    n = len(order)
    return order[position] if position < n else order[(position - n) % n]


@dataclass(frozen=True, kw_only=True)
class Partition:
    """Rank ``rank``'s share of the epoch's global order from position ``start`` on.

    Built by ElasticDistributedSampler from validated values; positions are
    0-based indexes into what this rank yields ("local") or into the epoch's padded
    global order ("global").
    """

    dataset_length: int
    start: int
    num_replicas: int
    rank: int
    drop_last: bool

    @property
    def remaining(self) -> int:
        """Real (not yet consumed) positions of the epoch, across all ranks."""
        return self.dataset_length - self.start

    @property
    def num_samples(self) -> int:
        """How many indices this rank yields (every rank yields the same number)."""
        if self.drop_last:
            return self.remaining // self.num_replicas
        return -(-self.remaining // self.num_replicas)

    @property
    def total_size(self) -> int:
        """Positions handed out across the world, padding included."""
        return self.num_samples * self.num_replicas

    @property
    def end(self) -> int:
        """The consumed count at which this world has finished the epoch."""
        if self.drop_last:
            return self.start + self.total_size
        return self.dataset_length

    @property
    def num_padding(self) -> int:
        """Padding positions across the world (drop_last=False; fewer than the world size)."""
        return self.start + self.total_size - self.end if not self.drop_last else 0

    @property
    def num_dropped(self) -> int:
        """Real positions at the tail this world will not hand out (drop_last=True)."""
        return self.dataset_length - self.end

    def global_position(self, position: int) -> int:
        """The global position of this rank's ``position``-th yielded index."""
        if not 0 <= position < self.num_samples:
            raise IndexError(
                f"position {position} out of range: rank {self.rank} yields "
                f"{self.num_samples} indices in this pass"
            )
        return self.start + self.rank + position * self.num_replicas

    def is_padding(self, position: int) -> bool:
        """Whether this rank's ``position``-th yielded index is padding, not real data."""
        return self.global_position(position) >= self.dataset_length

    def indices(self, order: list[int]) -> list[int]:
        """This rank's dataset indices, in the order it yields them."""
        stop = self.start + self.total_size
        return [position_index(order, p) for p in range(self.start + self.rank, stop, self.num_replicas)]
