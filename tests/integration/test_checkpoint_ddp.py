"""DDP on gloo: async save at world size 2, load at 1 and 3 as docs/checkpoint.md does it."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_rt.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from elastic_rt.checkpoint.storage import CheckpointStore
from elastic_rt.data import ElasticDistributedSampler
from benchmarks.gloo_world import run_world

DATASET = list(range(96))
BATCH = 4  # per rank


def build(world_size: int, rank: int, seed: int):
    torch.manual_seed(seed)
    model = DDP(nn.Sequential(nn.Linear(16, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 16)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ElasticDistributedSampler(DATASET, num_replicas=world_size, rank=rank, seed=3)
    return model, optim, sampler


def train_step(model, optim, sampler, step: int, rank: int, world_size: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    loss = model(torch.randn(BATCH, 16, generator=gen)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    sampler.advance(BATCH * world_size)


def clone_tree(obj):
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tree(v) for v in obj]
    return obj


def assert_tree_equal(got, expected, path: str = "") -> None:
    if torch.is_tensor(expected):
        if not (torch.is_tensor(got) and got.dtype == expected.dtype and torch.equal(got, expected)):
            raise AssertionError(f"{path}: tensors differ")
    elif isinstance(expected, dict):
        if set(got) != set(expected):
            raise AssertionError(f"{path}: keys {sorted(got)} != {sorted(expected)}")
        for key in expected:
            assert_tree_equal(got[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, list):
        if len(got) != len(expected):
            raise AssertionError(f"{path}: lengths differ")
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_tree_equal(g, e, f"{path}[{i}]")
    elif got != expected:
        raise AssertionError(f"{path}: {got!r} != {expected!r}")


def save_worker(rank: int, world_size: int, url: str, ref_path: str) -> dict:
    model, optim, sampler = build(world_size, rank, seed=0)
    for step in range(3):
        train_step(model, optim, sampler, step, rank, world_size)
    mgr = CheckpointManager(url, async_save=True)
    mgr.guard_optimizer(optim)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "sampler": sampler.state_dict(),
        "rng": capture_rng_state(),
        "extra": {"step": 3},
    }
    expected = clone_tree({k: state[k] for k in ("model", "optim", "sampler", "extra")})
    mgr.save(3, state)
    train_step(model, optim, sampler, 3, rank, world_size)  # overlaps with the upload
    stats = mgr.wait()
    mgr.close()
    if rank == 0:
        torch.save(expected, ref_path)
    return {"rng": state["rng"]["torch"], "blocked_s": stats.blocked_s, "duration_s": stats.save_duration_s}


def load_worker(rank: int, world_size: int, url: str, ref_path: str) -> dict:
    # --- the docs/checkpoint.md snippet, resume part ---
    model, optim, sampler = build(world_size, rank, seed=100 + rank)
    mgr = CheckpointManager(url, async_save=True)
    mgr.guard_optimizer(optim)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "sampler": sampler.state_dict(),
        "rng": capture_rng_state(),
        "extra": {"step": 0},
    }
    own_rng = state["rng"]["torch"].clone()
    start_step = mgr.load_latest(state)
    if start_step is not None:
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sampler.load_state_dict(state["sampler"])
        restore_rng_state(state["rng"])
    # --- end of snippet ---
    rng_after = torch.get_rng_state()
    model_sd, optim_sd = get_state_dict(model, optim)
    expected = torch.load(ref_path, weights_only=True)
    assert_tree_equal(model_sd, expected["model"], "model")
    assert_tree_equal(optim_sd, expected["optim"], "optim")
    assert_tree_equal(sampler.state_dict(), expected["sampler"], "sampler")
    assert_tree_equal(state["extra"], expected["extra"], "extra")
    # every rank holds the same parameters, and training goes on from there
    for param in model.parameters():
        gathered = [torch.empty_like(param) for _ in range(world_size)]
        dist.all_gather(gathered, param.detach())
        assert all(torch.equal(g, gathered[0]) for g in gathered)
    train_step(model, optim, sampler, 4, rank, world_size)
    mgr.close()
    return {"step": start_step, "rng": rng_after, "own_rng": own_rng}


def distcp_sizes(url: str, step: int) -> dict[str, int]:
    store = CheckpointStore(url)
    manifest = store.read_manifest(store.step_dir(step))
    return {f.path: f.size for f in manifest.files if f.path.endswith(".distcp")}


def test_ddp_save_at_2_load_at_1_and_3(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    ref_path = str(tmp_path / "expected.pt")
    saved = run_world(save_worker, 2, url, ref_path, timeout_s=240)
    assert all(s["blocked_s"] < s["duration_s"] for s in saved)

    # Replicated DDP tensors are written once: the two ranks' shards together are the size
    # of a one-process save of the same state, and the work is split between the ranks.
    expected = torch.load(ref_path, weights_only=True)
    single_url = f"file://{tmp_path}/single"
    with CheckpointManager(single_url, per_rank_keys=()) as mgr:
        mgr.save(3, expected)
    two, one = distcp_sizes(url, 3), distcp_sizes(single_url, 3)
    assert sorted(two) == ["__0_0.distcp", "__1_0.distcp"]
    assert abs(sum(two.values()) - sum(one.values())) < 0.02 * sum(one.values())
    assert min(two.values()) > 0.25 * sum(two.values())

    for world_size in (1, 3):
        results = run_world(load_worker, world_size, url, ref_path, timeout_s=240)
        assert [r["step"] for r in results] == [3] * world_size
        for rank, result in enumerate(results):
            if rank < 2:  # per-rank RNG state restored for ranks that existed at save time
                assert torch.equal(result["rng"], saved[rank]["rng"])
            else:  # a new rank keeps its own
                assert torch.equal(result["rng"], result["own_rng"])
    assert os.path.exists(ref_path)
