"""The memory tier on gloo ranks with two real replica servers as two nodes: a restart reads its own
node's memory, a lost node's shards come from their replica on the survivor (at a smaller world),
storage is read only when no complete snapshot is newer; storage reads are counted."""

from __future__ import annotations

import glob
import logging
import os
import shutil

import pytest
import torch

from elastic_rt.agent.replica_server import ReplicaServer, ReplicaServerConfig
from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint.backends import open_storage
from elastic_rt.checkpoint.memory_tier import ENV_MEMORY_TIER_ADDR, ENV_MEMORY_TIER_DIR
from elastic_rt.checkpoint.writer import ChecksumWriter
from tests.support.checkpoint import LogLines
from benchmarks.gloo_world import run_world

SECRET = b"memory-tier-test-secret"
LAST = 6  # steps 1..6: snapshots at 2 and 6, storage at 4


def _tensors(rank: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return {f"rank{rank}.w{i}": torch.randn(32, 128, generator=gen) for i in range(3)}


class CountingStorage:
    """Storage with its reads of files counted (listings are not file reads)."""

    def __init__(self, inner) -> None:
        self._inner, self.file_reads = inner, []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def read(self, path):
        self.file_reads.append(path)
        return self._inner.read(path)

    def open_read(self, path):
        self.file_reads.append(path)
        return self._inner.open_read(path)


def _manager(url: str, secret_file: str, storage=None) -> CheckpointManager:
    return CheckpointManager(url, collective_timeout_s=60.0, secret_file=secret_file, memory_every=2,
                             persist_every=4, storage=storage)


def train(rank: int, world_size: int, url: str, secret_file: str, nodes: list[tuple[str, str]]) -> None:
    os.environ[ENV_MEMORY_TIER_DIR], os.environ[ENV_MEMORY_TIER_ADDR] = nodes[rank]  # as the agent sets them
    with _manager(url, secret_file) as mgr:
        for step in range(1, LAST + 1):
            mgr.save(step, {"model": _tensors(rank, step), "extra": {"step": step}})


def restore(rank: int, world_size: int, url: str, secret_file: str, nodes: list[tuple[str, str]], ranks_saved: int):
    os.environ[ENV_MEMORY_TIER_DIR], os.environ[ENV_MEMORY_TIER_ADDR] = nodes[rank]
    lines = LogLines()
    logging.getLogger("elastic_rt.checkpoint").addHandler(lines)
    logging.getLogger("elastic_rt.checkpoint").setLevel(logging.INFO)
    model = {k: torch.zeros_like(v) for r in range(ranks_saved) for k, v in _tensors(r, 0).items()}
    state = {"model": model, "extra": {"step": -1}}
    storage = CountingStorage(open_storage(url))
    with _manager(url, secret_file, storage=storage) as mgr:
        step = mgr.load_latest(state)
    expected = {k: v for r in range(ranks_saved) for k, v in _tensors(r, step).items()}
    equal = all(torch.equal(state["model"][k], v) for k, v in expected.items())
    step_files = [p for p in storage.file_reads if f"step_{step:08d}" in p]
    return {"step": step, "equal": equal, "extra": state["extra"]["step"], "storage_reads": step_files,
            "lines": lines.lines}


def _servers(dirs: list[str]) -> list[ReplicaServer]:
    return [ReplicaServer(ReplicaServerConfig(directory=d, secret=SECRET, node=f"node{i}",
                                              max_replica_bytes=1 << 30)).start() for i, d in enumerate(dirs)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One training run on two nodes (snapshots at 2 and 6, storage at 4); each test restores from a copy."""
    tmp = tmp_path_factory.mktemp("memory-tier")
    secret_file = tmp / "secret"
    secret_file.write_bytes(SECRET)
    servers = _servers([str(tmp / "tier-a"), str(tmp / "tier-b")])
    try:
        run_world(train, 2, f"file://{tmp / 'ckpt'}", str(secret_file),
                  [(s.config.directory, s.address) for s in servers])
    finally:
        for s in servers:
            s.close()
    return tmp


@pytest.fixture()
def two_nodes(trained, tmp_path):
    dirs = []
    for name in ("tier-a", "tier-b"):
        shutil.copytree(trained / name, tmp_path / name)
        dirs.append(str(tmp_path / name))
    servers = _servers(dirs)
    nodes = [(s.config.directory, s.address) for s in servers]
    yield f"file://{trained / 'ckpt'}", str(trained / "secret"), nodes, servers
    for s in servers:
        s.close()


def _lose_node_a(servers, nodes) -> None:
    servers[0].close()  # the node is gone: its server and its host memory
    shutil.rmtree(nodes[0][0])


def test_restart_on_the_same_nodes_reads_its_own_memory_and_no_storage_file(two_nodes):
    url, secret_file, nodes, _ = two_nodes
    results = run_world(restore, 2, url, secret_file, nodes, 2)
    for r in results:
        assert (r["step"], r["equal"], r["extra"], r["storage_reads"]) == (6, True, 6, []), "\n".join(r["lines"])
        restored = [line for line in r["lines"] if "step 6 restored from the memory tier" in line]
        assert restored and "0 from this node's snapshots" not in restored[0], r["lines"]


def test_lost_node_is_restored_from_its_replica_at_a_smaller_world(two_nodes):
    url, secret_file, nodes, servers = two_nodes
    _lose_node_a(servers, nodes)
    (r,) = run_world(restore, 1, url, secret_file, nodes[1:], 2)
    assert (r["step"], r["equal"], r["extra"], r["storage_reads"]) == (6, True, 6, [])
    restored = [line for line in r["lines"] if "restored from the memory tier" in line]
    assert restored and "0 from replicas held here" not in restored[0], restored


def test_corrupt_replica_falls_back_to_storage_with_a_warning(two_nodes):
    url, secret_file, nodes, servers = two_nodes
    _lose_node_a(servers, nodes)
    (shard,) = glob.glob(os.path.join(nodes[1][0], "replicas", "step_00000006", "save-*", "__0_0.distcp"))
    with open(shard, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    (r,) = run_world(restore, 1, url, secret_file, nodes[1:], 2)
    assert (r["step"], r["equal"], r["extra"]) == (4, True, 4)
    assert any("step 6" in line and "__0_0.distcp" in line for line in r["lines"]), r["lines"]
    # the abandoned snapshot is removed from the tier (a cache), so no later restore tries it again
    assert not glob.glob(os.path.join(nodes[1][0], "*", "step_00000006")), os.listdir(nodes[1][0])


def test_replica_node_lost_too_reads_storage(two_nodes):
    url, secret_file, nodes, servers = two_nodes
    _lose_node_a(servers, nodes)
    shutil.rmtree(os.path.join(nodes[1][0], "replicas"))  # the node that held a's replica lost it too
    os.makedirs(os.path.join(nodes[1][0], "replicas"))
    (r,) = run_world(restore, 1, url, secret_file, nodes[1:], 2)
    assert (r["step"], r["equal"], r["extra"]) == (4, True, 4)  # step 6 has no manifest left: absent, not damaged
    assert not any("restored from the memory tier" in line for line in r["lines"]), r["lines"]


class HeldWriter(ChecksumWriter):
    """A snapshot writer that waits for `release` after the state was copied to host memory."""

    release = None

    def write_data(self, plan, planner):
        if not self.release.wait(timeout=120):
            raise RuntimeError("the test never released the snapshot")
        return super().write_data(plan, planner)


class HeldSnapshotManager(CheckpointManager):
    """A manager whose snapshot of step 1 stays in flight, staged but not written, until `release` is set."""

    def __init__(self, *args, **kwargs) -> None:
        import threading

        self.release = threading.Event()
        super().__init__(*args, **kwargs)

    def _make_writer(self, storage, path, *, step, **kwargs):
        writer = super()._make_writer(storage, path, step=step, **kwargs)
        if step == 1 and path.startswith("/memory-tier"):
            writer.__class__, writer.release = HeldWriter, self.release
        return writer


def coalesce(rank: int, world_size: int, url: str, secret_file: str, nodes: list[tuple[str, str]]) -> dict:
    os.environ[ENV_MEMORY_TIER_DIR], os.environ[ENV_MEMORY_TIER_ADDR] = nodes[rank]
    saved = []
    mgr = HeldSnapshotManager(url, collective_timeout_s=60.0, secret_file=secret_file, memory_every=1,
                              persist_every=1000, async_save=True, on_saved=lambda s: saved.append((s.step, s.tier)))
    with mgr:  # if_busy stays "wait": snapshots coalesce whatever it says
        returned = [mgr.save(step, {"model": _tensors(rank, step), "extra": {"step": step}}) for step in (1, 2, 3)]
        skipped_while_held = mgr.skipped_snapshots
        mgr.release.set()
        mgr.wait()
        returned.append(mgr.save(4, {"model": _tensors(rank, 4), "extra": {"step": 4}}))
        mgr.wait()
    own = sorted(os.listdir(os.path.join(nodes[rank][0], "own")))
    replicas = sorted(os.listdir(os.path.join(nodes[rank][0], "replicas")))
    return {"returned": returned, "skipped": skipped_while_held, "saved": saved, "own": own, "replicas": replicas}


def test_a_snapshot_due_while_one_is_in_flight_is_skipped_on_every_rank_not_queued(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    servers = _servers([str(tmp_path / "tier-a"), str(tmp_path / "tier-b")])
    try:
        results = run_world(coalesce, 2, f"file://{tmp_path / 'ckpt'}", str(secret_file),
                            [(s.config.directory, s.address) for s in servers])
    finally:
        for s in servers:
            s.close()
    for r in results:
        # step 1 in flight (held): 2 and 3 coalesce into it; 4 is taken once 1 has committed
        assert (r["returned"], r["skipped"]) == ([True, False, False, True], 2), r
        assert r["saved"] == [(1, "memory"), (4, "memory")], r
        # each node keeps its two newest snapshots, and the replicas of its peer's: never 2 or 3
        assert r["own"] == r["replicas"] == ["step_00000001", "step_00000004"], r


def unreplicated(rank: int, world_size: int, url: str, secret_file: str, nodes: list[tuple[str, str]]) -> dict:
    os.environ[ENV_MEMORY_TIER_DIR], os.environ[ENV_MEMORY_TIER_ADDR] = nodes[rank]
    lines = LogLines()
    logging.getLogger("elastic_rt.checkpoint").addHandler(lines)
    saved = []
    with CheckpointManager(url, collective_timeout_s=60.0, secret_file=secret_file, memory_every=1, persist_every=2,
                           on_saved=lambda s: saved.append((s.step, s.tier))) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": _tensors(rank, step), "extra": {"step": step}})
    return {"saved": saved, "lines": lines.lines}


def test_a_snapshot_one_node_could_not_replicate_is_not_reported_as_committed(tmp_path):
    """Node b's replica server is gone: rank 0 (node a) cannot push its snapshot of step 1, rank 1 can. Step 1
    would not survive node a's loss, so no rank reports it (the goodput ledger counts reported commits as kept);
    the storage save of step 2 is reported as usual."""
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    servers = _servers([str(tmp_path / "tier-a"), str(tmp_path / "tier-b")])
    nodes = [(s.config.directory, s.address) for s in servers]
    servers[1].close()
    try:
        results = run_world(unreplicated, 2, f"file://{tmp_path / 'ckpt'}", str(secret_file), nodes)
    finally:
        servers[0].close()
    for r in results:
        assert r["saved"] == [(2, "storage")], r
    assert any("snapshot step 1 not replicated to" in line for line in results[0]["lines"]), results[0]["lines"]
    assert any("snapshot step 1 is in its nodes' memory but not replicated from every node" in line
               for line in results[0]["lines"]), results[0]["lines"]


def _all_ranks(step: int, ranks: int = 3) -> dict[str, torch.Tensor]:
    return {k: v for r in range(ranks) for k, v in _tensors(r, step).items()}


def continue_after_loss(rank: int, world_size: int, url: str, secret_file: str,
                        nodes: list[tuple[str, str]]) -> dict:
    """The survivors of a 3-node job restore, train one more step (7, not a due snapshot step) and stop."""
    os.environ[ENV_MEMORY_TIER_DIR], os.environ[ENV_MEMORY_TIER_ADDR] = nodes[rank]
    saved = []
    state = {"model": {k: torch.zeros_like(v) for k, v in _all_ranks(0).items()}, "extra": {"step": -1}}
    with CheckpointManager(url, collective_timeout_s=60.0, secret_file=secret_file, memory_every=2, persist_every=4,
                           on_saved=lambda s: saved.append((s.step, s.tier))) as mgr:
        restored = (mgr.load_latest(state), mgr.restored_from)
        returned = [mgr.save(7, {"model": _all_ranks(7), "extra": {"step": 7}})]
    return {"restored": restored, "returned": returned, "saved": saved}


def restore_all(rank: int, world_size: int, url: str, secret_file: str, nodes: list[tuple[str, str]]) -> dict:
    os.environ[ENV_MEMORY_TIER_DIR], os.environ[ENV_MEMORY_TIER_ADDR] = nodes[rank]
    state = {"model": {k: torch.zeros_like(v) for k, v in _all_ranks(0).items()}, "extra": {"step": -1}}
    with _manager(url, secret_file) as mgr:
        step = mgr.load_latest(state)
        tier = mgr.restored_from
    equal = all(torch.equal(state["model"][k], v) for k, v in _all_ranks(step).items())
    return {"step": step, "tier": tier, "equal": equal, "extra": state["extra"]["step"]}


def train3(rank: int, world_size: int, url: str, secret_file: str, nodes: list[tuple[str, str]]) -> None:
    os.environ[ENV_MEMORY_TIER_DIR], os.environ[ENV_MEMORY_TIER_ADDR] = nodes[rank]
    with _manager(url, secret_file) as mgr:
        for step in range(1, LAST + 1):
            mgr.save(step, {"model": _all_ranks(step), "extra": {"step": step}})


def test_a_step_restored_from_a_replica_is_replicated_again_before_a_second_node_loss(tmp_path):
    """Three nodes a -> b -> c -> a snapshot step 6 (memory_every=2). Node a is lost: b and c restore step 6 (a's
    shards from b's replicas) and train step 7, not a due snapshot step. Step 6's copy of a's shards lives only on
    b, so the survivors snapshot step 7 at once, along their own ring. Node b is then lost too: c alone restores
    step 7 from the memory tier, not storage's step 4."""
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    url = f"file://{tmp_path / 'ckpt'}"
    dirs = [str(tmp_path / f"tier-{n}") for n in "abc"]
    servers = _servers(dirs)
    nodes = [(s.config.directory, s.address) for s in servers]
    try:
        run_world(train3, 3, url, str(secret_file), nodes)
        _lose_node_a(servers, nodes)
        for r in run_world(continue_after_loss, 2, url, str(secret_file), nodes[1:]):
            assert r["restored"] == (6, "memory"), r
            assert (r["returned"], r["saved"]) == ([True], [(7, "memory")]), r
        servers[1].close()
        shutil.rmtree(nodes[1][0])
        (r,) = run_world(restore_all, 1, url, str(secret_file), nodes[2:])
        assert (r["step"], r["tier"], r["equal"], r["extra"]) == (7, "memory", True, 7), r
    finally:
        for s in servers:
            s.close()

