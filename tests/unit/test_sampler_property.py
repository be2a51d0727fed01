"""Property test: every sample once per epoch across random crashes, restores and resizes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_rt.data import ElasticDistributedSampler

EPOCHS = 2


def expected_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The spec'd global order, written out independently of the implementation."""
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


@dataclass(frozen=True, kw_only=True)
class Segment:
    """One incarnation of the job: a world size, when it saves, when it dies."""

    world: int
    saves: frozenset[int]  # global step counts (within this segment) after which it saves
    crash_after: int | None  # dies after this many steps; None: runs to the end


@dataclass(frozen=True, kw_only=True)
class Scenario:
    n: int
    batch: int
    shuffle: bool
    drop_last: bool
    seed: int
    full_last_advance: bool  # advance a short last batch by the full global batch size
    segments: tuple[Segment, ...]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    crashed = draw(
        st.lists(
            st.builds(
                lambda world, saves, crash: Segment(world=world, saves=saves, crash_after=crash),
                st.integers(1, 6),
                st.frozensets(st.integers(1, 14), max_size=4),
                st.integers(0, 14),
            ),
            max_size=4,
        )
    )
    final = Segment(world=draw(st.integers(1, 6)), saves=frozenset(), crash_after=None)
    return Scenario(
        n=draw(st.integers(0, 70)),
        batch=draw(st.integers(1, 6)),
        shuffle=draw(st.booleans()),
        drop_last=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31)),
        full_last_advance=draw(st.booleans()),
        segments=(*crashed, final),
    )


def trained(log: list, epoch: int, padding: bool) -> list[int]:
    """Indices trained in ``epoch`` of the lineage, real ones or padding ones."""
    return [e[1] for e in log if len(e) == 3 and e[0] == epoch and e[2] is padding]


def run_segment(sc: Scenario, seg: Segment, state: dict | None, log: list) -> tuple[dict | None, list]:
    """Run one incarnation lock-step over all its ranks; return what its last save holds.

    ``log`` is the committed lineage so far: (epoch, index, is_padding) per trained
    sample, plus ("end", epoch, world, consumed) when an epoch's pass is finished.
    """
    world = seg.world
    samplers = [
        ElasticDistributedSampler(
            range(sc.n), num_replicas=world, rank=r, shuffle=sc.shuffle, seed=sc.seed,
            drop_last=sc.drop_last,
        )
        for r in range(world)
    ]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    log = list(log)
    saved = (state, list(log))
    steps = 0
    for epoch in range(state["epoch"] if state else 0, EPOCHS):
        for s in samplers:
            s.set_epoch(epoch)
        order = expected_order(sc.n, sc.seed, epoch, sc.shuffle)
        passes = [list(s) for s in samplers]
        assert len({len(p) for p in passes}) == 1, "ranks would take different step counts"
        num_steps = -(-len(passes[0]) // sc.batch)
        for k in range(num_steps):
            size = 0
            for r, s in enumerate(samplers):
                batch = passes[r][k * sc.batch:(k + 1) * sc.batch]
                size = len(batch)
                for j, idx in enumerate(batch):
                    log.append((epoch, idx, s.is_padding(k * sc.batch + j)))
            for s in samplers:
                s.advance((sc.batch if sc.full_last_advance else size) * world)
            steps += 1
            consumed = samplers[0].consumed
            assert {s.consumed for s in samplers} == {consumed}
            # Committed progress is a contiguous prefix of the global order, once each.
            real = trained(log, epoch, padding=False)
            assert Counter(real) == Counter(order[:consumed])
            if steps in seg.saves:
                dicts = [s.state_dict() for s in samplers]
                assert all(d == dicts[0] for d in dicts)
                saved = (dicts[0], list(log))
            if seg.crash_after is not None and steps >= seg.crash_after:
                return saved
        log.append(("end", epoch, world, samplers[0].consumed))
    if seg.crash_after is not None:
        return saved
    return None, log


@settings(
    max_examples=250,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(sc=scenarios())
def test_every_index_once_per_epoch_across_crashes_and_resizes(sc: Scenario) -> None:
    state: dict | None = None
    log: list = []
    for seg in sc.segments:
        state, log = run_segment(sc, seg, state, log)
    for epoch in range(EPOCHS):
        order = expected_order(sc.n, sc.seed, epoch, sc.shuffle)
        ends = [entry for entry in log if entry[0] == "end" and entry[1] == epoch]
        assert len(ends) == 1
        _, _, world, consumed = ends[0]
        real = trained(log, epoch, padding=False)
        padding = trained(log, epoch, padding=True)
        assert len(real) == len(set(real)), "a real sample was trained twice"
        if sc.drop_last:
            assert padding == []
            # What is dropped is the tail of the order, fewer samples than the world
            # that finished the epoch.
            assert 0 <= sc.n - consumed < world
            assert sorted(real) == sorted(order[:consumed])
        else:
            assert consumed == sc.n
            assert sorted(real) == list(range(sc.n))
            # Padding repeats the start of the epoch's order; a world of W pads fewer
            # than W positions and W <= 6 here.
            assert set(padding) <= set(order[:5])
