"""GlobalBatchSampler: a fixed global batch per optimizer step over the elastic sampler, for a DataLoader and DDP."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from elastic_rt.data.batch_plan import BatchPlanError, GlobalBatchPlan, MicroBatch, StepLayout
from elastic_rt.data.partition import epoch_order, position_index
from elastic_rt.data.sampler import ElasticDistributedSampler
from elastic_rt.data.sampler_state import is_int


@dataclass(frozen=True, kw_only=True)
class _Pass:
    """The steps one ``iter()`` handed to the DataLoader, and the epoch they belong to."""

    epoch: int
    steps: tuple[StepLayout, ...]


class Step:
    """One optimizer step on this rank: iterate it for ``(micro_batch, batch)`` pairs, run the
    optimizer, then ``commit()`` (before saving a checkpoint)."""

    def __init__(self, layout: StepLayout, batches: Iterator[Any], sampler: "GlobalBatchSampler", epoch: int) -> None:
        self.layout = layout
        self._batches = batches
        self._sampler = sampler
        self._epoch = epoch
        self._drawn = 0
        self.committed = False

    @property
    def index(self) -> int:
        """Optimizer steps of this epoch before this one (the same at every world size)."""
        return self.layout.index

    @property
    def size(self) -> int:
        """Real samples in this step across all ranks: the global batch, or fewer at the epoch's end."""
        return self.layout.size

    @property
    def micro_batches(self) -> tuple[MicroBatch, ...]:
        return self.layout.micro_batches

    def __iter__(self) -> Iterator[tuple[MicroBatch, Any]]:
        if self._drawn:
            raise BatchPlanError(f"step {self.index} was already iterated; iterate each step once")
        for micro in self.layout.micro_batches:
            try:
                batch = next(self._batches)
            except StopIteration:
                raise BatchPlanError(
                    f"the DataLoader ended inside step {self.index} (after {self._drawn} of "
                    f"{len(self.layout.micro_batches)} micro-batches); build it with "
                    "batch_sampler=this GlobalBatchSampler and nothing else that drops batches"
                ) from None
            self._drawn += 1
            yield micro, batch

    def commit(self) -> None:
        """Record the step as done: the sampler advances by exactly this step's positions."""
        if self.committed:
            raise BatchPlanError(f"step {self.index} was already committed")
        if self._drawn != len(self.layout.micro_batches):
            raise BatchPlanError(
                f"step {self.index} committed after {self._drawn} of {len(self.layout.micro_batches)} "
                "micro-batches; train on all of them (iterate the step to its end) first"
            )
        self._sampler._commit(self.layout, self._epoch)
        self.committed = True


class GlobalBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches of a fixed global batch, for ``DataLoader(batch_sampler=...)``.

    Every optimizer step consumes exactly the next ``global_batch_size`` positions of the
    epoch's order, at any world size, split into micro-batches of at most
    ``micro_batch_size`` on each rank; ``steps(loader)`` groups the loader's micro-batches
    into steps. Progress is the wrapped ElasticDistributedSampler's (one number, saved with
    its ``state_dict()``); its ``drop_last`` decides the epoch's tail shorter than a step.
    See docs/sampler.md.
    """

    def __init__(
        self, sampler: ElasticDistributedSampler, *, global_batch_size: int, micro_batch_size: int
    ) -> None:
        super().__init__()
        if not isinstance(sampler, ElasticDistributedSampler):
            raise BatchPlanError(
                f"GlobalBatchSampler wraps an ElasticDistributedSampler, got {type(sampler).__name__}"
            )
        self.plan = GlobalBatchPlan(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
        self.plan.check_world(sampler.num_replicas)
        self.sampler = sampler
        self._iterated: _Pass | None = None

    @property
    def global_batch_size(self) -> int:
        return self.plan.global_batch_size

    @property
    def micro_batch_size(self) -> int:
        return self.plan.micro_batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in a whole epoch, independent of the world size (for schedules)."""
        return self.plan.steps_per_epoch(
            dataset_length=self.sampler.dataset_length, drop_last=self.sampler.drop_last
        )

    @property
    def optimizer_step(self) -> int:
        """Optimizer steps committed since epoch 0 began, from the sampler's state alone.

        Assumes every epoch so far ran under this global batch size; ``check_step`` compares
        it with the step counter a checkpoint holds.
        """
        return self.sampler.epoch * self.steps_per_epoch + self.plan.steps_done(self.sampler.consumed)

    def check_step(self, step: int) -> None:
        """Refuse a restored step counter that this plan's progress does not account for."""
        if not is_int(step) or step != self.optimizer_step:
            raise BatchPlanError(
                f"the checkpoint is at optimizer step {step!r} but its sampler state (epoch "
                f"{self.sampler.epoch}, {self.sampler.consumed} of {self.sampler.dataset_length} "
                f"samples consumed) is step {self.optimizer_step} at a global batch of "
                f"{self.global_batch_size}; restore with the global batch size it was saved with"
            )

    def layout(self) -> list[StepLayout]:
        """The rest of the current epoch as this rank will run it, from the sampler's progress now."""
        return self.plan.steps(
            consumed=self.sampler.consumed,
            dataset_length=self.sampler.dataset_length,
            world_size=self.sampler.num_replicas,
            rank=self.sampler.rank,
            drop_last=self.sampler.drop_last,
        )

    def __len__(self) -> int:
        return sum(len(step.micro_batches) for step in self.layout())

    def __iter__(self) -> Iterator[list[int]]:
        steps = tuple(self.layout())
        order = epoch_order(
            dataset_length=self.sampler.dataset_length,
            seed=self.sampler.seed,
            epoch=self.sampler.epoch,
            shuffle=self.sampler.shuffle,
        )
        self._iterated = _Pass(epoch=self.sampler.epoch, steps=steps)
        # Materialized now, like the sampler's pass: commits must not move a pass under way
        # (a DataLoader with workers pulls micro-batches ahead of the training loop).
        return iter([[position_index(order, p) for p in m.positions] for s in steps for m in s.micro_batches])

    def steps(self, loader: Iterable[Any]) -> Iterator[Step]:
        """The rest of the epoch's optimizer steps, each holding its micro-batches from ``loader``.

        ``loader`` is the DataLoader built with ``batch_sampler=self``. Commit each step
        before asking for the next one.
        """
        self._iterated = None
        batches = iter(loader)
        current = self._iterated
        if current is None:
            raise BatchPlanError(
                "steps() needs the DataLoader built with batch_sampler=this GlobalBatchSampler "
                "(iterating the given loader did not draw from it)"
            )
        for layout in current.steps:
            step = Step(layout, batches, self, current.epoch)
            yield step
            if not step.committed:
                raise BatchPlanError(
                    f"step {layout.index} of epoch {current.epoch} was not committed; call "
                    "step.commit() after optimizer.step() and before saving a checkpoint"
                )

    def _commit(self, layout: StepLayout, epoch: int) -> None:
        if self.sampler.epoch != epoch or self.sampler.consumed != layout.start:
            raise BatchPlanError(
                f"the sampler moved under the plan (epoch {self.sampler.epoch}, {self.sampler.consumed} "
                f"consumed; the step starts at {layout.start} of epoch {epoch}); do not call "
                "sampler.advance() or set_epoch() while iterating steps()"
            )
        self.sampler.advance_positions(layout.size)


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed from ``seed`` and integer keys (epoch and sample index, or optimizer step):
    the same in every process, rank, DataLoader worker and world size."""
    digest = hashlib.blake2b(digest_size=8, person=b"elastic-rt")
    for key in (seed, *keys):
        if not is_int(key):
            raise BatchPlanError(f"derive_seed() takes ints, got {key!r}")
        digest.update(key.to_bytes(16, "little", signed=True))
    return int.from_bytes(digest.digest(), "little") >> 1


def sample_generator(seed: int, *keys: int) -> torch.Generator:
    """A torch.Generator seeded by ``derive_seed``: randomness per sample or per step that a
    resize cannot change (e.g. a dataset's augmentation for ``(epoch, index)``)."""
    return torch.Generator().manual_seed(derive_seed(seed, *keys))
