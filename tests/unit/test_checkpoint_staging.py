"""Pure pieces of a save: replicated-item dedup, staging buffers, snapshots, checksummed writes."""

from __future__ import annotations

import zlib

import fsspec
import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_tensor

from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint.staging import BufferPool, dedup_replicated
from elastic_rt.checkpoint.user_state import optimizer_storage_ptrs, snapshot, split_state, storage_ptr
from elastic_rt.checkpoint.storage import CheckpointStore
from elastic_rt.errors import CheckpointError


def tensor_item(fqn: str, numel: int) -> WriteItem:
    return _create_write_item_for_tensor(fqn, torch.empty(numel))


def owners(plans: list[SavePlan]) -> dict[str, int]:
    return {item.index.fqn: rank for rank, plan in enumerate(plans) for item in plan.items}


def test_replicated_items_known_identical_are_spread_by_size():
    items = [tensor_item("a", 1000), tensor_item("b", 900), tensor_item("c", 100), tensor_item("d", 50)]
    plans = [SavePlan(list(items)), SavePlan(list(items))]
    result = owners(dedup_replicated(plans, balanced_fqns={"a", "b", "c", "d"}))
    assert set(result) == {"a", "b", "c", "d"}  # each written exactly once
    load = [0, 0]
    for fqn, rank in result.items():
        load[rank] += {"a": 1000, "b": 900, "c": 100, "d": 50}[fqn]
    assert max(load) <= 1100  # largest-first greedy: {a, d} and {b, c}


def test_other_replicated_items_are_written_by_the_lowest_rank():
    items = [tensor_item("weight", 1000), tensor_item("running_mean", 10)]
    plans = [SavePlan(list(items)), SavePlan(list(items)), SavePlan(list(items))]
    result = owners(dedup_replicated(plans, balanced_fqns={"weight"}))
    assert result["running_mean"] == 0


def test_items_held_by_one_rank_stay_with_it():
    plans = [SavePlan([tensor_item("x", 10)]), SavePlan([tensor_item("y", 10)])]
    assert owners(dedup_replicated(plans, balanced_fqns=set())) == {"x": 0, "y": 1}


def test_byte_items_are_deduplicated_to_rank_0():
    item = WriteItem(index=MetadataIndex("sampler.epoch"), type=WriteItemType.BYTE_IO)
    plans = [SavePlan([item]), SavePlan([item])]
    assert owners(dedup_replicated(plans, balanced_fqns={"sampler.epoch"})) == {"sampler.epoch": 0}


def test_buffer_pool_reuses_memory_and_replaces_on_shape_change():
    pool = BufferPool()
    index = MetadataIndex("w", torch.Size([0, 0]))
    first = pool.get(index, torch.ones(4, 4))
    assert pool.get(index, torch.zeros(4, 4)) is first
    assert pool.get(index, torch.zeros(4, 5)) is not first
    assert pool.nbytes == 4 * 5 * 4
    pool.retain_only(set())
    assert pool.nbytes == 0


def test_snapshot_copies_objects_and_clones_unless_told_to_keep_live():
    live = torch.ones(3)
    other = torch.zeros(3)
    state = {"model": {"w": live, "b": other}, "sampler": {"epoch": 1, "order": [1, 2]}}
    snap = snapshot(state, keep_live=lambda t: t is live)
    live.add_(1)
    other.add_(1)
    state["sampler"]["order"].append(3)
    assert torch.equal(snap["model"]["w"], torch.full((3,), 2.0))  # referenced
    assert torch.equal(snap["model"]["b"], torch.zeros(3))  # cloned
    assert snap["sampler"] == {"epoch": 1, "order": [1, 2]}


def test_snapshot_takes_state_dict_of_stateful_objects():
    class Counter:
        def __init__(self) -> None:
            self.n = 5

        def state_dict(self) -> dict:
            return {"n": self.n}

        def load_state_dict(self, sd: dict) -> None:
            self.n = sd["n"]

    assert snapshot({"c": Counter()}, keep_live=lambda t: True) == {"c": {"n": 5}}


def test_split_state_separates_per_rank_keys_and_rejects_non_dicts():
    global_part, per_rank = split_state({"model": 1, "rng": 2}, ("rng",))
    assert global_part == {"model": 1} and per_rank == {"rng": 2}
    with pytest.raises(CheckpointError):
        split_state([1, 2], ("rng",))  # type: ignore[arg-type]


def test_optimizer_storages_cover_parameters_and_state():
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    ptrs = optimizer_storage_ptrs([optim])
    assert storage_ptr(model.weight) in ptrs
    assert storage_ptr(optim.state[model.weight]["exp_avg"]) in ptrs
    assert storage_ptr(torch.ones(1)) not in ptrs


def test_large_writes_are_checksummed_correctly_and_zip_crc_setting_is_restored(tmp_path):
    url = f"file://{tmp_path}"
    big = torch.randn(3 << 20)  # 12 MiB: the overlapped-crc path
    assert torch.serialization.get_crc32_options() is True
    with CheckpointManager(url) as mgr:
        mgr.save(1, {"model": {"big": big}})
    assert torch.serialization.get_crc32_options() is True
    entry = CheckpointStore(url).entry(1)
    for file in entry.manifest.files:
        data = fsspec.filesystem("file").cat_file(f"{entry.data_dir(entry.manifest)}/{file.path}")
        assert (len(data), zlib.crc32(data)) == (file.size, file.crc32)
    target = {"model": {"big": torch.zeros_like(big)}}
    with CheckpointManager(url) as mgr:
        assert mgr.load_latest(target) == 1
    assert torch.equal(target["model"]["big"], big)


def test_loading_into_a_state_with_unknown_keys_says_what_is_wrong(tmp_path):
    url = f"file://{tmp_path}"
    with CheckpointManager(url) as mgr:
        mgr.save(1, {"model": {"w": torch.ones(2)}})
        with pytest.raises(CheckpointError, match="keys and shapes"):
            mgr.load_latest({"model": {"w": torch.ones(2), "new": torch.ones(2)}})
