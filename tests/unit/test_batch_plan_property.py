"""Property test: under a fixed global batch, each optimizer step trains the same samples whatever the world sizes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_rt.data import ElasticDistributedSampler, GlobalBatchSampler

EPOCHS = 2


def expected_order(n: int, seed: int, epoch: int) -> list[int]:
    """The spec'd global order (shuffle on), written out independently of the implementation."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def expected_steps(n: int, batch: int, seed: int, epoch: int, drop_last: bool) -> list[Counter]:
    """Step k of an epoch trains order[k*B:(k+1)*B]; the tail is a short step or not trained."""
    order = expected_order(n, seed, epoch)
    end = n // batch * batch if drop_last else n
    return [Counter(order[k:min(k + batch, end)]) for k in range(0, end, batch)]


@dataclass(frozen=True, kw_only=True)
class Segment:
    """One incarnation: its world size, its micro-batch size, when it saves, when it dies."""

    world: int
    micro: int
    saves: frozenset[int]  # steps (counted within this segment) after which it saves
    crash_after: int | None  # dies after this many steps; None: runs to the end


@dataclass(frozen=True, kw_only=True)
class Scenario:
    n: int
    batch: int
    seed: int
    drop_last: bool
    segments: tuple[Segment, ...]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    batch = draw(st.integers(1, 12))
    worlds = st.integers(1, min(batch, 6))  # B >= W, or the plan refuses the world
    segment = st.builds(
        lambda world, micro, saves, crash: Segment(world=world, micro=micro, saves=saves, crash_after=crash),
        worlds, st.integers(1, 5), st.frozensets(st.integers(1, 10), max_size=4), st.integers(0, 10),
    )
    crashed = draw(st.lists(segment, max_size=4))
    final = Segment(world=draw(worlds), micro=draw(st.integers(1, 5)), saves=frozenset(), crash_after=None)
    return Scenario(
        n=draw(st.integers(0, 60)),
        batch=batch,
        seed=draw(st.integers(0, 2**31)),
        drop_last=draw(st.booleans()),
        segments=(*crashed, final),
    )


def check_step_layout(steps: list, sc: Scenario, seg: Segment) -> None:
    """What every step must look like on its ranks: micro sizes, scales, one all-reduce each."""
    assert len({(s.index, s.start, s.size) for s in steps}) == 1
    weights = 0.0
    for s in steps:
        micro = s.micro_batches
        assert micro, "every rank joins the step's all-reduce"
        assert [m.last for m in micro] == [False] * (len(micro) - 1) + [True]
        assert all(1 <= len(m) <= seg.micro for m in micro)
        for m in micro:
            assert m.loss_scale == m.weight * seg.world or abs(m.loss_scale - m.weight * seg.world) < 1e-12
            assert m.padding == (m.weight == 0.0)
        weights += sum(m.weight for m in micro)
    assert abs(weights - 1.0) < 1e-12


def run_segment(sc: Scenario, seg: Segment, state: dict | None, log: list) -> tuple[dict | None, list]:
    """Run one incarnation lock-step over its ranks; return what its last save holds.

    ``log`` is the committed lineage: (epoch, step index, Counter of real indices) per step.
    """
    batches = []
    for r in range(seg.world):
        s = ElasticDistributedSampler(
            range(sc.n), num_replicas=seg.world, rank=r, seed=sc.seed, drop_last=sc.drop_last
        )
        if state is not None:
            s.load_state_dict(state)
        batches.append(GlobalBatchSampler(s, global_batch_size=sc.batch, micro_batch_size=seg.micro))
    log = list(log)
    saved = (state, list(log))
    done = 0
    for epoch in range(state["epoch"] if state else 0, EPOCHS):
        for b in batches:
            b.sampler.set_epoch(epoch)
        for per_rank in zip(*(b.steps(b) for b in batches)):
            check_step_layout([s.layout for s in per_rank], sc, seg)
            trained: Counter = Counter()
            for step in per_rank:
                for micro, indices in step:
                    assert len(indices) == len(micro)
                    if not micro.padding:
                        trained.update(indices)
            for step in per_rank:
                step.commit()
            log.append((epoch, per_rank[0].index, trained))
            done += 1
            assert len({b.optimizer_step for b in batches}) == 1
            if done in seg.saves:
                dicts = [b.sampler.state_dict() for b in batches]
                assert all(d == dicts[0] for d in dicts)
                saved = (dicts[0], list(log))
            if seg.crash_after is not None and done >= seg.crash_after:
                return saved
    if seg.crash_after is not None:
        return saved
    return None, log


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_each_optimizer_step_trains_the_same_samples_at_any_world_sizes(sc: Scenario) -> None:
    state: dict | None = None
    log: list = []
    for seg in sc.segments:
        state, log = run_segment(sc, seg, state, log)
    for epoch in range(EPOCHS):
        committed = [(index, trained) for e, index, trained in log if e == epoch]
        want = expected_steps(sc.n, sc.batch, sc.seed, epoch, sc.drop_last)
        assert [index for index, _ in committed] == list(range(len(want)))
        # The multiset of each step is the uninterrupted run's, whatever the worlds, micro-batch
        # sizes and crash points: so every sample of the epoch is trained once, in the same step.
        assert [trained for _, trained in committed] == want
