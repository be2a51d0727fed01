"""ElasticDistributedSampler under a DataLoader with worker processes that prefetch ahead."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DataLoader, Dataset

from elastic_rt.data import ElasticDistributedSampler

N, BATCH, SEED = 53, 3, 7


class Indices(Dataset):
    """Sample i is the int i: what a batch holds is what the sampler handed out."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


class CountingSampler(ElasticDistributedSampler):
    """Counts how many indices the DataLoader pulled from the current pass."""

    pulled = 0

    def __iter__(self) -> Iterator[int]:
        self.pulled = 0
        for index in super().__iter__():
            self.pulled += 1
            yield index


def world_of(size: int, state: dict | None = None) -> list[CountingSampler]:
    samplers = [CountingSampler(Indices(), num_replicas=size, rank=r, seed=SEED) for r in range(size)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
        s.set_epoch(1)
    return samplers


def loaders(samplers: list[CountingSampler]) -> list[Iterator]:
    return [
        iter(
            DataLoader(
                Indices(), batch_size=BATCH, sampler=s, num_workers=2, prefetch_factor=2,
                timeout=120,
            )
        )
        for s in samplers
    ]


def train(samplers: list[CountingSampler], steps: int | None = None) -> list[list[list[int]]]:
    """Lock-step over all ranks; advance after each step. Returns steps x ranks x batch."""
    its = loaders(samplers)
    done: list[list[list[int]]] = []
    try:
        while steps is None or len(done) < steps:
            batches = [next(it, None) for it in its]
            if all(b is None for b in batches):
                break
            assert all(b is not None for b in batches), "ranks ran out at different steps"
            done.append([b.tolist() for b in batches])
            for s in samplers:
                s.advance(BATCH * len(samplers))
    finally:
        del its  # shuts the worker processes down
    return done


def real_indices(steps: list[list[list[int]]], samplers: list[CountingSampler]) -> list[int]:
    return [
        index
        for k, step in enumerate(steps)
        for r, batch in enumerate(step)
        for j, index in enumerate(batch)
        if not samplers[r].is_padding(k * BATCH + j)
    ]


def test_restore_mid_epoch_same_world_gives_the_uninterrupted_remainder() -> None:
    uninterrupted = world_of(2)
    reference = train(uninterrupted)
    assert sorted(real_indices(reference, uninterrupted)) == list(range(N))

    first = world_of(2)
    head = train(first, steps=3)
    # The workers prefetched beyond what was trained: progress cannot come from iteration.
    assert all(s.pulled > 3 * BATCH for s in first)
    state = first[0].state_dict()
    assert state["consumed"] == 3 * BATCH * 2

    tail = train(world_of(2, state))
    assert head + tail == reference


def test_restore_mid_epoch_into_a_larger_world_trains_each_sample_once() -> None:
    first = world_of(2)
    head = train(first, steps=4)
    assert all(s.pulled > 4 * BATCH for s in first)
    state = first[0].state_dict()

    second = world_of(3, state)
    tail = train(second)
    trained = real_indices(head, first) + real_indices(tail, second)
    assert sorted(trained) == list(range(N))
    assert second[0].consumed == N
