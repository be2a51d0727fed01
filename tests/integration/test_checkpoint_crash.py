"""Failures on a 2-rank world: SIGKILL in the middle of a save, a damaged shard."""

from __future__ import annotations

import io
import logging
import os
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint.cli import main as ckpt_cli
from elastic_rt.errors import CheckpointError
from tests.support.checkpoint import FilePauseHook, PausingCheckpointManager
from benchmarks.gloo_world import World, run_world


def wait_for(path: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.02)


def worker(rank: int, world_size: int, url: str, pause_file: str, signal_dir: str) -> str:
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 64))
    mgr = PausingCheckpointManager(url, collective_timeout_s=60.0, pause_hook=FilePauseHook(pause_file))
    state = {"model": model.state_dict(), "extra": {"step": 1}}
    mgr.save(1, state)
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{signal_dir}/step1.pt")
    open(f"{signal_dir}/saved1.rank{rank}", "w").close()
    wait_for(f"{signal_dir}/go")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    try:
        mgr.save(2, {"model": model.state_dict(), "extra": {"step": 2}})  # paused, then killed
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"
    return "saved"


def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    pause_file = str(tmp_path / "pause")
    signal_dir = str(tmp_path)
    with World(worker, 2, url, pause_file, signal_dir) as world:
        world.start()
        for rank in (0, 1):
            wait_for(f"{signal_dir}/saved1.rank{rank}")
        open(pause_file, "w").close()  # the next save pauses after each rank's shard
        open(f"{signal_dir}/go", "w").close()
        for rank in (0, 1):
            wait_for(f"{pause_file}.rank{rank}.paused")
        step_dir = tmp_path / "ckpt" / "step_00000002"
        assert any(p.name.endswith(".distcp") for p in step_dir.glob("save-*/*"))  # mid-save indeed
        world.kill(1)  # SIGKILL
        os.remove(pause_file)  # let the survivor run into its dead peer
        survivor = world.results(ranks=[0], timeout_s=120)[0]
        assert survivor.ok, survivor.error
        assert survivor.value.startswith("CheckpointError: saving step 2"), survivor.value
        assert "previous checkpoint stays the latest" in survivor.value
        assert not (step_dir / "MANIFEST.json").exists()

    expected = torch.load(tmp_path / "step1.pt", weights_only=True)
    target = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "extra": {"step": 0}}
    with CheckpointManager(url) as mgr:
        assert mgr.latest_committed_step() == 1
        assert mgr.load_latest(target) == 1
    assert target["extra"] == {"step": 1}
    for key, value in expected.items():
        assert torch.equal(target["model"][key], value), key

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = ckpt_cli(["ckpt", "list", url])
    assert code == 0
    rows = {line.split()[0]: line for line in out.getvalue().splitlines()[1:]}
    assert "uncommitted" not in rows["1"] and "uncommitted" in rows["2"]


def flip_and_load_worker(rank: int, world_size: int, url: str, root: str) -> dict:
    """Save steps 1 and 2, flip a byte in step 2's shard that holds the tensor (rank 0, between two
    barriers), then load: one world for the save and the load."""
    with CheckpointManager(url) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": {"w": torch.full((1000,), float(step))}, "extra": {"step": step}})
    victim = ""
    if rank == 0:
        shards = sorted(Path(root, "step_00000002").glob("save-*/*.distcp"))
        path = max(shards, key=lambda p: p.stat().st_size)  # the one holding the tensor
        data = bytearray(path.read_bytes())
        data[len(data) - 100] ^= 0x40
        path.write_bytes(bytes(data))
        victim = path.name
    dist.barrier()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("elastic_rt.checkpoint").addHandler(handler)
    state = {"model": {"w": torch.zeros(1000)}, "extra": {"step": 0}}
    with CheckpointManager(url) as mgr:
        step = mgr.load_latest(state)
    return {"step": step, "w": state["model"]["w"][0].item(), "warnings": records, "victim": victim}


def test_a_flipped_byte_in_one_ranks_shard_makes_every_rank_fall_back(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    results = run_world(flip_and_load_worker, 2, url, str(tmp_path / "ckpt"), timeout_s=120)
    assert [r["step"] for r in results] == [1, 1]
    assert [r["w"] for r in results] == [1.0, 1.0]
    warning = " ".join(results[0]["warnings"])
    assert f"{results[0]['victim']}: crc32" in warning and "falling back to step 1" in warning
