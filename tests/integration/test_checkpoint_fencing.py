"""Stale writers and failure symmetry on real processes: a SIGSTOPped writer resumed mid-save, one rank failing."""

from __future__ import annotations

import os
import signal
import time

import torch
from fsspec.core import url_to_fs

from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint.backends import PosixStorage
from elastic_rt.checkpoint.storage import CheckpointStore
from elastic_rt.errors import CheckpointError
from tests.support.checkpoint import PHASE_COMMIT, FilePauseHook, PausingCheckpointManager
from benchmarks.gloo_world import World, run_world

TTL_S = 2.0


def wait_for(path: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.02)


def state_at(step: int) -> dict:
    return {"w": torch.full((4096,), float(step)), "extra": {"step": step}}


def stale_writer(rank: int, world_size: int, url: str, pause_file: str, signal_dir: str) -> str:
    mgr = PausingCheckpointManager(url, keep_last=2, writer_lease_ttl_s=TTL_S,
                                   pause_hook=FilePauseHook(pause_file, phase=PHASE_COMMIT))
    mgr.save(10, state_at(10))
    open(f"{signal_dir}/saved10", "w").close()
    wait_for(f"{signal_dir}/go")
    try:
        mgr.save(20, state_at(-20))  # held just before its commit, SIGSTOPped, resumed
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"
    return "committed"


def test_a_stopped_writer_resumed_mid_save_commits_and_deletes_nothing(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    pause_file = str(tmp_path / "pause")
    with World(stale_writer, 1, url, pause_file, str(tmp_path)) as world:
        world.start()
        wait_for(f"{tmp_path}/saved10")
        open(pause_file, "w").close()
        open(f"{tmp_path}/go", "w").close()
        wait_for(f"{pause_file}.rank0.paused")
        os.kill(world.procs[0].pid, signal.SIGSTOP)  # frozen mid-save, lease beats included
        try:
            # the next writer waits until the frozen one's lease beat stood still for its TTL, then takes over
            with CheckpointManager(url, keep_last=2, writer_lease_ttl_s=TTL_S, writer_wait_s=60.0) as mgr:
                assert mgr.save(20, state_at(20)) is True
                assert mgr.save(30, state_at(30)) is True
                new_epoch = mgr._guard.epoch
            os.remove(pause_file)
        finally:
            os.kill(world.procs[0].pid, signal.SIGCONT)
        stale = world.results(timeout_s=120)[0]
    assert stale.ok, stale.error
    assert stale.value.startswith("CheckpointError: saving step 20"), stale.value
    assert "not committing" in stale.value and "\n" not in stale.value, stale.value
    entry = CheckpointStore(url).entry(20)
    assert [c.generation for c in entry.commits] == [1] and entry.manifest.writer.epoch == new_epoch
    target = {"w": torch.zeros(4096), "extra": {"step": -1}}
    with CheckpointManager(url, keep_last=2) as mgr:
        assert mgr.load_latest(target) == 30
        assert [e.step for e in mgr.list_checkpoints() if e.committed] == [20, 30]
    assert torch.equal(target["w"], state_at(30)["w"])


class FailingCommitStorage(PosixStorage):
    """Local storage whose create-only write (the commit, rank 0's alone) fails with a bug-like error."""

    def create(self, path: str, data: bytes) -> None:
        if path.rsplit("/", 1)[-1].startswith("MANIFEST"):
            raise RuntimeError("injected: rank 0 failed outside DCP")
        super().create(path, data)


def one_rank_fails(rank: int, world_size: int, root: str) -> dict[str, str]:
    out = {}
    for how in ("rank1-unpicklable", "rank0-commit"):
        url = f"file://{root}/{how}"
        storage = None
        if how == "rank0-commit":
            fs, path = url_to_fs(url)
            storage = FailingCommitStorage(url, fs, path.rstrip("/"))
        mgr = CheckpointManager(url, collective_timeout_s=600.0, storage=storage)
        state = state_at(1)
        state["rng"] = {"x": (lambda: 0) if (how == "rank1-unpicklable" and rank == 1) else 0}
        try:
            mgr.save(1, state)
            out[how] = "saved"
        except CheckpointError as exc:
            out[how] = str(exc)
        finally:
            mgr.close()
    return out


def test_an_error_on_one_rank_is_one_checkpoint_error_on_every_rank(tmp_path):
    """rank 1's per-rank state cannot be pickled (after DCP's part of the save), then rank 0's commit
    raises a non-OSError: both ranks raise, well before collective_timeout_s (600 s here; the world's own
    deadline, process start-up included, is 300 s)."""
    results = run_world(one_rank_fails, 2, str(tmp_path), timeout_s=300)
    for how, culprit in (("rank1-unpicklable", "rank 1"), ("rank0-commit", "rank 0")):
        for per_rank in results:
            message = per_rank[how]
            assert message.startswith("saving step 1") and culprit in message and "\n" not in message, message
        assert not CheckpointStore(f"file://{tmp_path}/{how}").entry(1).commits
