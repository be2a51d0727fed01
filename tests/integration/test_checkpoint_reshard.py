"""FSDP2 (fully_shard, DTensor) on gloo/CPU: saved at world size 4, loaded at 2 and 3."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from elastic_rt.checkpoint import CheckpointManager
from benchmarks.gloo_world import run_world

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build(world_size: int, seed: int):
    torch.manual_seed(seed)
    # Odd sizes: shards are uneven at world sizes 3 and 4.
    model = nn.Sequential(nn.Linear(10, 26), nn.ReLU(), nn.Linear(26, 7))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train_step(model, optim, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    loss = model(torch.randn(5, 10, generator=gen)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def flat_full(model, optim) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters and optimizer state; collective, complete on rank 0."""
    model_sd, optim_sd = get_state_dict(model, optim, options=FULL)
    flat = {f"model/{k}": v for k, v in model_sd.items()}
    for fqn, per_param in optim_sd.get("state", {}).items():  # empty off rank 0
        for key, value in per_param.items():
            flat[f"optim/{fqn}/{key}"] = value
    return flat


def save_worker(rank: int, world_size: int, url: str, ref_path: str) -> int:
    model, optim = build(world_size, seed=0)
    for step in range(3):
        train_step(model, optim, step, rank)
    model_sd, optim_sd = get_state_dict(model, optim)
    assert all(isinstance(v, DTensor) for v in model_sd.values())
    with CheckpointManager(url, async_save=True) as mgr:  # staged in save(), no guard
        mgr.save(3, {"model": model_sd, "optim": optim_sd, "extra": {"world": world_size}})
        full = flat_full(model, optim)
        stats = mgr.wait()
    if rank == 0:
        torch.save(full, ref_path)
    return stats.bytes_written


def load_worker(rank: int, world_size: int, url: str, ref_path: str) -> list[str]:
    model, optim = build(world_size, seed=1000 + world_size)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "extra": {"world": 0}}
    with CheckpointManager(url) as mgr:
        step = mgr.load_latest(state)
    if step != 3 or state["extra"] != {"world": 4}:
        raise AssertionError(f"loaded step {step}, extra {state['extra']}")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = flat_full(model, optim)
    mismatched = []
    if rank == 0:
        expected = torch.load(ref_path, weights_only=True)
        if set(full) != set(expected):
            raise AssertionError(f"keys differ: {sorted(set(full) ^ set(expected))}")
        mismatched = [k for k in expected if not torch.equal(full[k], expected[k])]
    train_step(model, optim, 3, rank)  # the resharded model trains on
    return mismatched


def test_fsdp2_save_at_4_load_at_2_and_3(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    ref_path = str(tmp_path / "full.pt")
    written = run_world(save_worker, 4, url, ref_path, timeout_s=300)
    assert all(w > 0 for w in written)  # every rank wrote its own shard
    expected = torch.load(ref_path, weights_only=True)
    assert len(expected) == 4 + 4 * 3  # 4 parameters; step, exp_avg, exp_avg_sq each
    for world_size in (2, 3):
        mismatched = run_world(load_worker, world_size, url, ref_path, timeout_s=300)
        assert mismatched[0] == [], f"world size {world_size}: {mismatched[0]}"
