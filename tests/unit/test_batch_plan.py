"""The global batch plan: layouts, loss scales, the sampler under it, and misuse refused with one clear line."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from elastic_rt.data import (
    BatchPlanError,
    ElasticDistributedSampler,
    GlobalBatchPlan,
    GlobalBatchSampler,
    SamplerConfigError,
    derive_seed,
    sample_generator,
)
from elastic_rt.errors import ConfigError


def world(n: int, size: int, *, batch: int, micro: int, state: dict | None = None, **kw) -> list[GlobalBatchSampler]:
    out = []
    for r in range(size):
        s = ElasticDistributedSampler(range(n), num_replicas=size, rank=r, **kw)
        if state is not None:
            s.load_state_dict(state)
        out.append(GlobalBatchSampler(s, global_batch_size=batch, micro_batch_size=micro))
    return out


def sizes(plan: GlobalBatchPlan, **kw) -> list[list[int]]:
    """Micro-batch sizes of one step, rank by rank."""
    return [
        [len(m) for m in plan.step(rank=r, **kw).micro_batches] for r in range(kw["world_size"])
    ]


# --- layout -------------------------------------------------------------------------------


def per_rank_batches(n: int, w: int, b: int, seed: int) -> list[list[list[int]]]:
    """Per rank, the per-rank-batch loop's batches: ElasticDistributedSampler under DataLoader(batch_size=b)."""
    samplers = [ElasticDistributedSampler(range(n), num_replicas=w, rank=r, seed=seed) for r in range(w)]
    return [[t.tolist() for t in DataLoader(range(n), batch_size=b, sampler=s)] for s in samplers]


def test_b_times_w_gives_each_rank_the_per_rank_samplers_batches() -> None:
    w, b = 3, 2
    planned = [list(s) for s in world(30, w, batch=b * w, micro=b, seed=4)]
    assert planned == per_rank_batches(30, w, b, seed=4)
    # An epoch that does not fill its last step: the same steps, but the tail is a short step
    # of real samples where the per-rank sampler pads it to the world size.
    planned = [list(s) for s in world(29, w, batch=b * w, micro=b, seed=4)]
    padded = per_rank_batches(29, w, b, seed=4)
    assert [p[:-1] for p in planned] == [p[:-1] for p in padded]
    assert [p[-1] for p in planned] == [padded[0][-1], padded[1][-1], padded[2][-1][:1]]


def test_unequal_micro_batch_counts_and_a_short_last_micro_batch() -> None:
    plan = GlobalBatchPlan(global_batch_size=10, micro_batch_size=2)
    kw = dict(start=0, size=10, dataset_length=100)
    assert sizes(plan, world_size=4, **kw) == [[2, 1], [2, 1], [2], [2]]
    assert sizes(plan, world_size=3, **kw) == [[2, 2], [2, 1], [2, 1]]
    assert sizes(plan, world_size=2, **kw) == [[2, 2, 1], [2, 2, 1]]
    step = plan.step(rank=0, world_size=4, **kw)
    assert [m.positions for m in step.micro_batches] == [(0, 4), (8,)]
    assert [m.loss_scale for m in step.micro_batches] == [4 * 2 / 10, 4 * 1 / 10]
    assert [m.last for m in step.micro_batches] == [False, True]


def test_weights_of_a_step_sum_to_one_at_every_world() -> None:
    plan = GlobalBatchPlan(global_batch_size=13, micro_batch_size=3)
    for w in range(1, 14):
        micro = [m for r in range(w) for m in plan.step(start=5, size=13, dataset_length=40, world_size=w, rank=r).micro_batches]
        assert sum(m.weight for m in micro) == pytest.approx(1.0, abs=1e-15)
        assert sorted(p for m in micro for p in m.positions) == list(range(5, 18))


def test_short_last_step_gives_ranks_without_a_sample_one_zero_weight_padding_batch() -> None:
    plan = GlobalBatchPlan(global_batch_size=8, micro_batch_size=2)
    steps = [plan.steps(consumed=0, dataset_length=19, world_size=4, rank=r, drop_last=False) for r in range(4)]
    assert [len(s) for s in steps] == [3, 3, 3, 3]
    last = [s[-1] for s in steps]
    assert {st.size for st in last} == {3} and {st.start for st in last} == {16}
    assert [[(m.positions, m.padding, m.loss_scale) for m in st.micro_batches] for st in last] == [
        [((16,), False, 4 / 3)], [((17,), False, 4 / 3)], [((18,), False, 4 / 3)],
        [((19,), True, 0.0)],  # position 19 >= N: padding, order[0]
    ]


def test_drop_last_leaves_the_tail_shorter_than_a_step_untrained() -> None:
    plan = GlobalBatchPlan(global_batch_size=8, micro_batch_size=8)
    steps = plan.steps(consumed=0, dataset_length=19, world_size=2, rank=0, drop_last=True)
    assert [(s.start, s.size) for s in steps] == [(0, 8), (8, 8)]
    assert plan.steps_per_epoch(dataset_length=19, drop_last=True) == 2
    assert plan.steps_per_epoch(dataset_length=19, drop_last=False) == 3


def test_step_index_counts_from_the_restored_progress() -> None:
    plan = GlobalBatchPlan(global_batch_size=8, micro_batch_size=8)
    steps = plan.steps(consumed=16, dataset_length=40, world_size=2, rank=1, drop_last=False)
    assert [s.index for s in steps] == [2, 3, 4]


# --- the sampler under the plan -------------------------------------------------------------


def run(samplers: list[GlobalBatchSampler], steps: int | None = None) -> list[list[list[int]]]:
    """Lock-step over the ranks with steps(): per step, per rank, the real indices it trained."""
    gens = [s.steps(s) for s in samplers]  # the batch sampler is itself an iterable of index lists
    out = []
    for per_rank in zip(*gens):
        out.append([[i for micro, batch in step if not micro.padding for i in batch] for step in per_rank])
        for step in per_rank:
            step.commit()
        if steps is not None and len(out) == steps:
            break
    return out


def test_resize_mid_epoch_continues_the_same_steps() -> None:
    order = torch.randperm(50, generator=torch.Generator().manual_seed(1)).tolist()
    first = world(50, 4, batch=12, micro=2, seed=1)
    head = run(first, steps=2)
    state = first[0].sampler.state_dict()
    assert state["consumed"] == 24
    tail = run(world(50, 3, batch=12, micro=5, seed=1, state=state))
    trained = [sorted(i for rank in step for i in rank) for step in head + tail]
    assert trained == [sorted(order[k:k + 12]) for k in range(0, 50, 12)]


def test_dataloader_with_workers_feeds_the_same_steps() -> None:
    samplers = world(37, 3, batch=10, micro=2, seed=3)
    plain = run(world(37, 3, batch=10, micro=2, seed=3))
    loaders = [DataLoader(range(37), batch_sampler=s, num_workers=2, timeout=120) for s in samplers]
    gens = [s.steps(loader) for s, loader in zip(samplers, loaders)]
    got = []
    for per_rank in zip(*gens):
        got.append([[int(i) for micro, batch in step if not micro.padding for i in batch] for step in per_rank])
        for step in per_rank:
            step.commit()
    assert got == plain
    assert all(s.sampler.consumed == 37 for s in samplers)


def test_optimizer_step_and_check_step_follow_the_state() -> None:
    [s] = world(20, 1, batch=8, micro=4)
    assert (s.steps_per_epoch, s.optimizer_step) == (3, 0)
    run([s])
    s.sampler.set_epoch(1)
    run([s], steps=1)
    assert s.optimizer_step == 4
    s.check_step(4)
    with pytest.raises(BatchPlanError, match="restore with the global batch size it was saved with"):
        s.check_step(5)


# --- misuse -------------------------------------------------------------------------------


def test_global_batch_smaller_than_world_is_one_clear_error() -> None:
    with pytest.raises(BatchPlanError, match="a global batch of 3 samples cannot be split over 4 ranks") as info:
        world(10, 4, batch=3, micro=1)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, SamplerConfigError)


@pytest.mark.parametrize(("batch", "micro"), [(0, 1), (4, 0), (4.0, 1), (True, 1), (4, "2")])
def test_bad_sizes_refused(batch: object, micro: object) -> None:
    with pytest.raises(BatchPlanError, match="must be an int >= 1"):
        GlobalBatchPlan(global_batch_size=batch, micro_batch_size=micro)  # type: ignore[arg-type]


def test_uncommitted_step_refused_before_the_next_one() -> None:
    [s] = world(20, 1, batch=8, micro=4)
    gen = s.steps(s)
    step = next(gen)
    list(step)
    with pytest.raises(BatchPlanError, match=r"step 0 of epoch 0 was not committed; call step.commit\(\)"):
        next(gen)
    assert s.sampler.consumed == 0


def test_commit_before_every_micro_batch_or_twice_refused() -> None:
    [s] = world(20, 1, batch=8, micro=4)
    step = next(s.steps(s))
    with pytest.raises(BatchPlanError, match="after 0 of 2 micro-batches"):
        step.commit()
    list(step)
    step.commit()
    with pytest.raises(BatchPlanError, match="already committed"):
        step.commit()
    assert s.sampler.consumed == 8


def test_sampler_moved_under_the_plan_refused() -> None:
    [s] = world(20, 1, batch=8, micro=8)
    step = next(s.steps(s))
    list(step)
    s.sampler.advance(4)
    with pytest.raises(BatchPlanError, match="the sampler moved under the plan"):
        step.commit()


def test_steps_needs_the_loader_that_draws_from_it() -> None:
    [s] = world(20, 1, batch=8, micro=8)
    with pytest.raises(BatchPlanError, match="batch_sampler=this GlobalBatchSampler"):
        next(s.steps(DataLoader(range(20), batch_size=8)))
    with pytest.raises(BatchPlanError, match="wraps an ElasticDistributedSampler"):
        GlobalBatchSampler(range(4), global_batch_size=4, micro_batch_size=1)  # type: ignore[arg-type]


def test_advance_positions_is_exact_and_bounded() -> None:
    s = ElasticDistributedSampler(range(10), num_replicas=4, rank=0)
    s.advance_positions(7)  # not a multiple of the world: fine here
    with pytest.raises(SamplerConfigError, match="would pass the end of epoch 0"):
        s.advance_positions(4)
    for bad in (-1, 1.0, True):
        with pytest.raises(SamplerConfigError):
            s.advance_positions(bad)  # type: ignore[arg-type]
    assert s.consumed == 7


# --- gradients and seeds ------------------------------------------------------------------


def test_scaled_accumulation_averaged_over_ranks_is_the_mean_gradient_over_the_step() -> None:
    # What DDP computes, written out: per rank, sum of loss_scale x mean-loss gradients; then
    # the mean over ranks. It equals the full-batch mean gradient at every world size.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1)).double()
    x, y = torch.randn(11, 5, dtype=torch.float64), torch.randn(11, 1, dtype=torch.float64)
    full = torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters()))
    plan = GlobalBatchPlan(global_batch_size=11, micro_batch_size=2)
    for w in (1, 2, 3, 4, 5, 11):
        ranks = []
        for r in range(w):
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for m in plan.step(start=0, size=11, dataset_length=11, world_size=w, rank=r).micro_batches:
                idx = list(m.positions)
                loss = nn.functional.mse_loss(model(x[idx]), y[idx]) * m.loss_scale
                for g, d in zip(grads, torch.autograd.grad(loss, list(model.parameters()))):
                    g += d
            ranks.append(grads)
        mean = [sum(rank[i] for rank in ranks) / w for i in range(len(full))]
        for got, want in zip(mean, full):  # reassociation only (torch.testing costs 2.5 s to import)
            assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max()), w


def test_derived_seeds_are_stable_and_distinct() -> None:
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2)
    assert len({derive_seed(0, e, i) for e in range(3) for i in range(100)}) == 300
    assert 0 <= derive_seed(-5, 10**30) < 2**63
    a = torch.rand(3, generator=sample_generator(7, 0, 42))
    assert torch.equal(a, torch.rand(3, generator=sample_generator(7, 0, 42)))
    with pytest.raises(BatchPlanError, match="takes ints"):
        derive_seed(0, 1.5)  # type: ignore[arg-type]
