"""Checkpoint restore from host memory on a 2-rank world: memory copies are used when they match the
manifest; a corrupt or stale copy falls back to storage with a warning; storage stays the truth."""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess

import pytest
import torch

from elastic_rt.checkpoint import CheckpointManager
from benchmarks.gloo_world import run_world
from tests.support.tmpfs import mounted_tmpfs
from elastic_rt.errors import CheckpointError
from elastic_rt.worker_env import ENV_HOST_CACHE_DIR, ENV_HOST_CACHE_RESERVE

STEP = 5


def _state(rank: int, fill: float | None = None) -> dict:
    """Each rank's own tensors (so each rank writes and reads its own shard file)."""
    gen = torch.Generator().manual_seed(rank)
    tensors = {f"rank{rank}.w{i}": torch.randn(64, 256, generator=gen) for i in range(4)}
    if fill is not None:
        tensors = {k: torch.full_like(v, fill) for k, v in tensors.items()}
    return {"model": tensors, "extra": {"step": STEP}}


def save(rank: int, world_size: int, url: str, cache: str, reserve: str = "0") -> None:
    os.environ[ENV_HOST_CACHE_DIR] = cache  # as the agent sets it for its workers
    os.environ[ENV_HOST_CACHE_RESERVE] = reserve  # a directory on disk here, not shared memory: nothing to keep free
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))  # one node
    with CheckpointManager(url, collective_timeout_s=60.0) as mgr:
        mgr.save(STEP, _state(rank))
    # close() waited for the copy into host memory


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def load(rank: int, world_size: int, url: str, cache: str):
    os.environ[ENV_HOST_CACHE_DIR] = cache
    lines = _Lines()
    logging.getLogger("elastic_rt.checkpoint").addHandler(lines)
    logging.getLogger("elastic_rt.checkpoint").setLevel(logging.INFO)
    state = _state(rank, fill=0.0)
    with CheckpointManager(url, collective_timeout_s=60.0) as mgr:
        try:
            step = mgr.load_latest(state)
        except CheckpointError as exc:
            return {"error": str(exc), "lines": lines.lines}
    equal = all(torch.equal(state["model"][k], v) for k, v in _state(rank)["model"].items())
    return {"step": step, "equal": equal, "lines": lines.lines}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One committed step saved by a 2-rank world with a host cache; copied afresh per test."""
    root = tmp_path_factory.mktemp("saved")
    (root / "shm").mkdir()  # the agent creates the node's directory
    run_world(save, 2, f"file://{root}/ckpt", str(root / "shm"))
    return root


@pytest.fixture
def run(saved, tmp_path):
    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    shutil.copytree(saved / "shm", tmp_path / "shm")
    return tmp_path


def _shards(directory) -> list[str]:
    """The shard files (DCP's __<rank>_0.distcp) on storage, or their copies in host memory."""
    return sorted(p for p in glob.glob(f"{directory}/**/__*_0.distcp*", recursive=True) if not p.endswith(".ok"))


def _flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_every_rank_copied_its_files_into_host_memory(saved):
    copies = [os.path.basename(p) for p in _shards(saved / "shm")]
    assert [c.split("@")[0] for c in copies] == ["__0_0.distcp", "__1_0.distcp"]


def test_restore_reads_host_memory_not_storage(run):
    for shard in _shards(run / "ckpt"):
        _flip_byte(shard)  # storage damaged: only the memory copies can give the right values
    results = run_world(load, 2, f"file://{run}/ckpt", str(run / "shm"))
    for r in results:
        assert r.get("step") == STEP and r["equal"], r
        assert any("from host memory" in line for line in r["lines"]), r["lines"]
        assert not any("reading it from storage" in line for line in r["lines"])


def test_corrupt_or_stale_memory_copy_falls_back_to_storage_with_a_warning(run):
    corrupt, stale = _shards(run / "shm")
    _flip_byte(corrupt)
    name, _, _ = os.path.basename(stale).partition("@")
    os.rename(stale, os.path.join(os.path.dirname(stale), f"{name}@00000000-1"))  # another save's bytes
    results = run_world(load, 2, f"file://{run}/ckpt", str(run / "shm"))
    warnings = [line for r in results for line in r["lines"] if "reading it from storage" in line]
    for r in results:
        assert r.get("step") == STEP and r["equal"], r
    assert any("does not match the manifest's crc32" in w for w in warnings), warnings
    assert any("holds another save of step" in w for w in warnings), warnings


def test_corrupt_memory_and_storage_is_an_error_not_a_silent_load(run):
    for shard in _shards(run / "shm") + _shards(run / "ckpt"):
        _flip_byte(shard)
    results = run_world(load, 2, f"file://{run}/ckpt", str(run / "shm"))
    assert all("does not match its manifest" in r.get("error", "") for r in results), results


@pytest.fixture
def small_shm(tmp_path):
    """A 1 MiB tmpfs standing in for /dev/shm (root only)."""
    with mounted_tmpfs(tmp_path / "shm", "1m") as mnt:
        yield mnt


def test_one_decision_per_node_keeps_the_reserve_free(small_shm, tmp_path):
    """Each rank's 256 KiB would fit in the 1 MiB alone, the node's 512 KiB beside a 600 KiB reserve would not:
    neither rank copies (each copied before, leaving less free than the reserve), and both say why."""
    cache = small_shm / "elastic-rt-run-node"
    cache.mkdir()
    run_world(save, 2, f"file://{tmp_path}/ckpt", str(cache), str(600 << 10))
    assert _shards(cache) == []
    assert shutil.disk_usage(cache).free >= 600 << 10
    decision = (cache / f".decision-{STEP}").read_text()
    assert decision.startswith("the node's 0.5 MiB of it and the 0.6 MiB reserve do not fit in the "), decision


def test_the_copy_is_dropped_before_a_restart_when_shared_memory_is_low(small_shm, tmp_path, caplog):
    from elastic_rt.agent.host_memory import HOST_CACHE_OWNER, HostCacheRoom

    cache = small_shm / "elastic-rt-run-node"
    cache.mkdir()
    (cache / HOST_CACHE_OWNER).write_text("1 0")
    run_world(save, 2, f"file://{tmp_path}/ckpt", str(cache), str(100 << 10))
    assert len(_shards(cache)) == 2  # kept: 512 KiB and the 100 KiB reserve fit
    room = HostCacheRoom(str(cache), reserve_bytes=800 << 10, node_id="n0")  # now others need more of it
    with caplog.at_level(logging.WARNING, logger="elastic_rt"):
        room.on_round(round=1)
    assert _shards(cache) == [] and (cache / HOST_CACHE_OWNER).exists()
    assert "below the 0.8 MiB reserve" in caplog.text and "dropped before the workers start" in caplog.text
    HostCacheRoom(str(cache), reserve_bytes=100 << 10, node_id="n0").on_round(round=2)  # enough room: kept as is
    assert (cache / HOST_CACHE_OWNER).exists()


def test_root_removes_stale_copies_of_any_user_and_never_follows_a_link(tmp_path):
    from elastic_rt.agent.host_memory import HOST_CACHE_OWNER, remove_stale_host_caches

    if os.geteuid() != 0:
        pytest.skip("removing another user's directory needs root")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / "elastic-rt-run-other"
    stale.mkdir()
    (stale / HOST_CACHE_OWNER).write_text(f"{dead.pid} 0.000")
    os.chown(stale, 65534, 65534)  # nobody's: an agent of another user, SIGKILLed
    target = tmp_path / "precious"
    target.mkdir()
    (target / HOST_CACHE_OWNER).write_text(f"{dead.pid} 0.000")
    (tmp_path / "elastic-rt-link").symlink_to(target)
    assert remove_stale_host_caches(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and target.exists() and (tmp_path / "elastic-rt-link").is_symlink()
