"""ElasticDistributedSampler: equivalence with DistributedSampler, resume semantics, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DistributedSampler

from elastic_rt.data import (
    ElasticDistributedSampler,
    SamplerConfigError,
    SamplerStateError,
    SamplerStateMismatchError,
)
from elastic_rt.errors import ElasticRTError


def make(n: int = 10, world: int = 2, rank: int = 0, **kwargs) -> ElasticDistributedSampler:
    return ElasticDistributedSampler(range(n), num_replicas=world, rank=rank, **kwargs)


# --- equivalence with torch's DistributedSampler (constant world, no failure) ----------


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_indices_as_distributed_sampler(shuffle: bool, drop_last: bool) -> None:
    checked = 0
    for n in (0, 1, 2, 5, 7, 12, 13, 64, 101):
        for world in (1, 2, 3, 4, 8):
            for seed in (0, 1234):
                for rank in range(world):
                    ours = make(n, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
                    theirs = DistributedSampler(
                        range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                        drop_last=drop_last,
                    )
                    for epoch in (0, 1, 5):
                        ours.set_epoch(epoch)
                        theirs.set_epoch(epoch)
                        assert list(ours) == list(theirs), (n, world, rank, seed, epoch)
                        assert len(ours) == len(theirs)
                        assert ours.num_samples == theirs.num_samples
                        assert ours.total_size == theirs.total_size
                        checked += 1
    assert checked == 9 * (1 + 2 + 3 + 4 + 8) * 2 * 3


def test_training_loop_with_advance_matches_distributed_sampler_every_epoch() -> None:
    # A full run with advance() after each step and set_epoch per epoch: the pass of
    # each epoch is DistributedSampler's pass, advance() does not disturb a pass under way.
    n, world, batch = 23, 3, 2
    ours = [make(n, world, r, seed=5) for r in range(world)]
    theirs = [DistributedSampler(range(n), num_replicas=world, rank=r, seed=5) for r in range(world)]
    for epoch in range(3):
        for s in ours + theirs:
            s.set_epoch(epoch)
        iters = [iter(s) for s in ours]
        expected = [list(s) for s in theirs]
        got: list[list[int]] = [[] for _ in range(world)]
        for _ in range(-(-len(expected[0]) // batch)):
            for r, it in enumerate(iters):
                got[r] += [i for _, i in zip(range(batch), it)]
            for s in ours:
                s.advance(batch * world)
        assert got == expected
        assert all(s.consumed == n for s in ours)


def test_shuffle_off_is_range_order_and_seed_changes_order() -> None:
    assert list(make(10, 1, shuffle=False)) == list(range(10))
    assert list(make(50, 1, seed=1)) != list(make(50, 1, seed=2))
    s = make(50, 1)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first and sorted(list(s)) == list(range(50))


# --- resume and resize ------------------------------------------------------------------


def test_resize_repartitions_the_remaining_order() -> None:
    # 13 samples, world 2, per-rank batch 2: one step consumes positions 0..3.
    old = [make(13, 2, r, seed=3) for r in range(2)]
    order = torch.randperm(13, generator=torch.Generator().manual_seed(3)).tolist()
    for s in old:
        s.advance(4)
    state = old[0].state_dict()
    assert state["consumed"] == 4
    new = [make(13, 3, r, seed=3) for r in range(3)]
    for s in new:
        s.load_state_dict(state)
    remaining = order[4:]  # 9 samples, 3 ranks: no padding
    assert [list(s) for s in new] == [remaining[r::3] for r in range(3)]
    assert [len(s) for s in new] == [3, 3, 3]


def test_padding_repeats_start_of_epoch_order_and_is_flagged() -> None:
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
    samplers = [make(10, 4, r) for r in range(4)]
    for s in samplers:
        s.advance(4)  # 6 remain for 4 ranks: 2 padding positions (10, 11)
    passes = [list(s) for s in samplers]
    assert passes == [
        [order[4], order[8]],
        [order[5], order[9]],
        [order[6], order[0]],
        [order[7], order[1]],
    ]
    flags = [[s.is_padding(p) for p in range(len(s))] for s in samplers]
    assert flags == [[False, False], [False, False], [False, True], [False, True]]
    assert samplers[0].partition.num_padding == 2
    with pytest.raises(IndexError):
        samplers[0].is_padding(2)


def test_is_padding_refers_to_the_pass_under_way_not_later_progress() -> None:
    s = make(5, 2, rank=1)
    it = iter(s)  # positions 1, 3, 5(padding)
    assert len(list(it)) == 3
    s.advance(2)  # the next pass would be positions 3, 5(padding): not what is under way
    assert [s.is_padding(p) for p in range(3)] == [False, False, True]


def test_drop_last_drops_tail_shorter_than_the_world() -> None:
    order = torch.randperm(11, generator=torch.Generator().manual_seed(0)).tolist()
    samplers = [make(11, 3, r, drop_last=True) for r in range(3)]
    for s in samplers:
        s.advance(3)  # 8 remain, 3 ranks: 6 handed out, order[9:] dropped
    assert [list(s) for s in samplers] == [order[3 + r:9:3] for r in range(3)]
    assert samplers[0].partition.num_dropped == 2
    for s in samplers:
        s.advance(6)
    assert samplers[0].consumed == 9 and len(samplers[0]) == 0
    # A smaller world that resumes the finished epoch still trains what fits.
    two = [make(11, 2, r, drop_last=True) for r in range(2)]
    for s in two:
        s.load_state_dict(samplers[0].state_dict())
    assert [list(s) for s in two] == [[order[9]], [order[10]]]


def test_set_epoch_same_epoch_keeps_progress_new_epoch_resets() -> None:
    s = make(10, 2)
    s.set_epoch(3)
    s.advance(4)
    s.set_epoch(3)
    assert s.consumed == 4 and len(s) == 3
    s.set_epoch(4)
    assert s.consumed == 0 and len(s) == 5


def test_finished_epoch_yields_nothing_and_refuses_more_advance() -> None:
    s = make(5, 2)
    for _ in range(2):
        s.advance(4)  # second one is the short last step, passed at full size
    assert s.consumed == 5 and list(s) == [] and len(s) == 0
    with pytest.raises(SamplerConfigError, match="set_epoch"):
        s.advance(2)
    s.advance(0)


def test_advance_rejects_sizes_not_multiple_of_world() -> None:
    s = make(10, 4)
    for bad in (3, -4, 2.0, True, "4"):
        with pytest.raises(SamplerConfigError):
            s.advance(bad)  # type: ignore[arg-type]
    assert s.consumed == 0


def test_state_dict_is_plain_json_data_and_round_trips() -> None:
    s = make(10, 2, seed=9, drop_last=True)
    s.set_epoch(2)
    s.advance(4)
    state = s.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state == {
        "version": 1, "epoch": 2, "seed": 9, "consumed": 4, "dataset_length": 10,
        "shuffle": True, "drop_last": True,
    }
    t = make(10, 5, 4, seed=9, drop_last=True)
    t.load_state_dict(json.loads(json.dumps(state)))
    assert (t.epoch, t.consumed) == (2, 4)


def test_world_defaults_need_a_process_group() -> None:
    with pytest.raises(SamplerConfigError, match="init_process_group"):
        ElasticDistributedSampler(range(4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_replicas": 0, "rank": 0}, "num_replicas"),
        ({"num_replicas": 2, "rank": 2}, "Invalid rank"),
        ({"num_replicas": 2, "rank": -1}, "Invalid rank"),
        ({"num_replicas": 2, "rank": 0, "seed": 1.5}, "seed"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(SamplerConfigError, match=message) as info:
        ElasticDistributedSampler(range(4), **kwargs)
    assert isinstance(info.value, ValueError)  # as DistributedSampler raises


def test_dataset_without_length_refused() -> None:
    with pytest.raises(SamplerConfigError, match="__len__"):
        ElasticDistributedSampler(iter(range(4)), num_replicas=1, rank=0)


# --- bad state --------------------------------------------------------------------------


def saved_state(**changes) -> dict:
    s = make(10, 2, seed=1)
    s.set_epoch(1)
    s.advance(4)
    return {**s.state_dict(), **changes}


@pytest.mark.parametrize(
    ("sampler_kwargs", "message"),
    [
        ({"n": 11}, "dataset length 10 in the state but 11"),
        ({"seed": 2}, "seed 1 in the state but 2"),
        ({"shuffle": False}, "shuffle True in the state but False"),
        ({"drop_last": True}, "drop_last False in the state but True"),
    ],
)
def test_state_from_another_data_order_refused(sampler_kwargs: dict, message: str) -> None:
    kwargs = {"n": 10, "seed": 1, **sampler_kwargs}
    s = make(kwargs.pop("n"), 3, 1, **kwargs)
    with pytest.raises(SamplerStateMismatchError, match=message):
        s.load_state_dict(saved_state())
    assert (s.epoch, s.consumed) == (0, 0)


def _without(key: str) -> dict:
    state = saved_state()
    del state[key]
    return state


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (None, "must be a dict"),
        ([("epoch", 1)], "must be a dict"),
        ({}, "missing"),
        (_without("consumed"), "missing consumed"),
        (_without("seed"), "missing seed"),
        (saved_state(consumed=-1), "consumed must be between 0 and dataset_length"),
        (saved_state(consumed=11), "consumed must be between 0 and dataset_length"),
        (saved_state(consumed="4"), "'consumed' must be an int"),
        (saved_state(consumed=4.0), "'consumed' must be an int"),
        (saved_state(epoch=True), "'epoch' must be an int"),
        (saved_state(epoch=None), "'epoch' must be an int"),
        (saved_state(shuffle=1), "'shuffle' must be a bool"),
        (saved_state(drop_last="no"), "'drop_last' must be a bool"),
        (saved_state(version=2), "version 2 is not supported"),
        (saved_state(dataset_length=-3), "dataset_length must be >= 0"),
        (saved_state(extra=1), "unknown key"),
    ],
)
def test_garbage_state_refused(state: object, message: str) -> None:
    s = make(10, 3, 1, seed=1)
    s.advance(3)
    with pytest.raises(SamplerStateError, match=message) as info:
        s.load_state_dict(state)  # type: ignore[arg-type]
    assert isinstance(info.value, ElasticRTError)
    assert not isinstance(info.value, SamplerStateMismatchError)
    assert (s.epoch, s.consumed) == (0, 3)
