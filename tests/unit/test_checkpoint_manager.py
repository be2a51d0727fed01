"""CheckpointManager in one process (world size 1) on file:// and memory:// storage."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import fsspec
import pytest
import torch
from torch import nn

from elastic_rt.checkpoint import MANIFEST_NAME, CheckpointManager, capture_rng_state, restore_rng_state
from elastic_rt.checkpoint.storage import CheckpointStore
from elastic_rt.errors import CheckpointError
from tests.support.checkpoint import EventPauseHook, PausingCheckpointManager


@pytest.fixture(params=["file", "memory"])
def url(request, tmp_path):
    if request.param == "file":
        yield f"file://{tmp_path}/ckpt"
        return
    name = f"memory://ckpt-{uuid.uuid4().hex[:10]}"
    yield name
    fs = fsspec.filesystem("memory")
    if fs.exists(name):
        fs.rm(name, recursive=True)


def make_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    train_step(model, optim, 0)
    return model, optim


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    loss = model(torch.randn(6, 8, generator=gen)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def make_state(model, optim, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "sampler": {"epoch": step // 10, "consumed": step * 6, "seed": 0},
        "rng": capture_rng_state(),
        "extra": {"step": step, "note": "x"},
    }


def frozen_copy(state: dict) -> dict:
    """What the state holds now, immune to later training."""
    model = {k: v.clone() for k, v in state["model"].items()}
    optim = {
        p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        for p, s in state["optim"]["state"].items()
    }
    return {"model": model, "optim": optim, "sampler": dict(state["sampler"]), "extra": dict(state["extra"])}


def assert_state_equal(state: dict, expected: dict) -> None:
    assert state["model"].keys() == expected["model"].keys()
    for key, value in expected["model"].items():
        assert torch.equal(state["model"][key], value), key
    for param, per_param in expected["optim"].items():
        for key, value in per_param.items():
            got = state["optim"]["state"][param][key]
            assert torch.equal(got, value) if torch.is_tensor(value) else got == value, (param, key)
    assert state["sampler"] == expected["sampler"]
    assert state["extra"] == expected["extra"]


def fresh_state() -> dict:
    model, optim = make_model(seed=99)
    state = make_state(model, optim, 0)
    state["rng"] = {}
    return state


def step_dir(url: str, step: int) -> str:
    store = CheckpointStore(url)
    return store.step_dir(step)


@pytest.mark.parametrize("async_save", [False, True])
def test_save_then_load_latest_restores_everything(url, async_save):
    model, optim = make_model(seed=1)
    saved_rng = capture_rng_state()
    state = make_state(model, optim, 7)
    expected = frozen_copy(state)
    with CheckpointManager(url, async_save=async_save) as mgr:
        assert mgr.save(7, state) is True
        stats = mgr.wait()
        assert stats is not None and stats.step == 7 and stats.bytes_written > 0
    torch.rand(3)  # move the RNG on
    target = fresh_state()
    with CheckpointManager(url) as mgr:
        assert mgr.load_latest(target) == 7
    assert_state_equal(target, expected)
    restore_rng_state(target["rng"])
    assert torch.equal(torch.get_rng_state(), saved_rng["torch"])


def test_load_latest_without_checkpoints_returns_none(url):
    with CheckpointManager(url) as mgr:
        assert mgr.load_latest(fresh_state()) is None


@pytest.mark.parametrize("async_save", [False, True])
def test_retention_keeps_the_last_k_committed(url, async_save):
    model, optim = make_model(seed=1)
    with CheckpointManager(url, keep_last=2, async_save=async_save) as mgr:
        for step in (10, 20, 30, 40):
            train_step(model, optim, step)
            mgr.save(step, make_state(model, optim, step))
        mgr.wait()
        assert [e.step for e in mgr.list_checkpoints()] == [30, 40]
        assert all(e.committed for e in mgr.list_checkpoints())


def test_an_uncommitted_leftover_is_never_loaded_and_is_cleaned_after_the_next_commit(url):
    model, optim = make_model(seed=1)
    state = make_state(model, optim, 10)
    expected = frozen_copy(state)
    with CheckpointManager(url, keep_last=3) as mgr:
        mgr.save(10, state)
        assert [e.step for e in mgr.list_checkpoints()] == [10]  # also waits for retention
        fs = CheckpointStore(url).fs
        leftover = f"{step_dir(url, 20)}/save-00000000-deadbeef"  # an older writer's save that never committed
        fs.makedirs(leftover, exist_ok=True)
        fs.pipe_file(f"{leftover}/__0_0.distcp", b"half written")
        target = fresh_state()
        assert mgr.load_latest(target) == 10
        assert_state_equal(target, expected)
        mgr.save(11, state)
        assert [(e.step, e.committed) for e in mgr.list_checkpoints()] == [(10, True), (11, True)]


def test_a_crash_leftover_in_the_same_step_directory_is_cleaned_and_the_step_saved(url):
    fs = CheckpointStore(url).fs
    leftover = f"{step_dir(url, 5)}/save-00000000-deadbeef"
    fs.makedirs(leftover, exist_ok=True)
    fs.pipe_file(f"{leftover}/__7_0.distcp", b"from a dead rank")
    model, optim = make_model(seed=1)
    state = make_state(model, optim, 5)
    with CheckpointManager(url) as mgr:
        mgr.save(5, state)
        mgr.list_checkpoints()  # waits for the clean-up
        names = {os.path.basename(p.rstrip("/")) for p in fs.ls(step_dir(url, 5), detail=False)}
        assert "save-00000000-deadbeef" not in names and MANIFEST_NAME in names
        assert mgr.load_latest(fresh_state()) == 5


def test_saving_a_committed_step_again_commits_the_next_generation_and_keeps_the_first(url):
    model, optim = make_model(seed=1)
    with CheckpointManager(url) as mgr:
        mgr.save(3, make_state(model, optim, 3))
        first = CheckpointStore(url).entry(3).manifest
        train_step(model, optim, 4)
        state = make_state(model, optim, 3)
        expected = frozen_copy(state)
        assert mgr.save(3, state) is True
        entry = CheckpointStore(url).entry(3)
        assert [c.generation for c in entry.commits] == [1, 2]
        assert entry.commits[0].manifest == first and entry.manifest.data_dir != first.data_dir
        target = fresh_state()
        assert mgr.load_latest(target) == 3
    assert_state_equal(target, expected)


def _data_dir(url: str, step: int) -> str:
    entry = CheckpointStore(url).entry(step)
    return entry.data_dir(entry.manifest)


def _first_shard(url: str, step: int) -> str:
    fs = CheckpointStore(url).fs
    return next(p for p in fs.ls(_data_dir(url, step), detail=False) if p.endswith(".distcp"))


def _flip_byte(url: str, path: str, offset: int) -> None:
    fs = CheckpointStore(url).fs
    data = bytearray(fs.cat_file(path))
    data[offset] ^= 0xFF
    fs.pipe_file(path, bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_with_a_warning(url, damage, caplog):
    model, optim = make_model(seed=1)
    first = make_state(model, optim, 1)
    expected = frozen_copy(first)
    with CheckpointManager(url) as mgr:
        mgr.save(1, first)
        train_step(model, optim, 2)
        mgr.save(2, make_state(model, optim, 2))
    fs = CheckpointStore(url).fs
    shard = _first_shard(url, 2)
    if damage == "flip":
        _flip_byte(url, shard, fs.size(shard) // 2)
    elif damage == "truncate":
        fs.pipe_file(shard, fs.cat_file(shard)[:-100])
    elif damage == "delete":
        fs.rm(shard)
    else:
        fs.pipe_file(f"{step_dir(url, 2)}/{MANIFEST_NAME}", b'{"format": "elastic-rt-checkpoint", "step"')
    target = fresh_state()
    with caplog.at_level(logging.WARNING, logger="elastic_rt.checkpoint"):
        with CheckpointManager(url) as mgr:
            assert mgr.load_latest(target) == 1
    assert_state_equal(target, expected)
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "step 2" in warning and "falling back to step 1" in warning
    name = MANIFEST_NAME if damage == "manifest" else os.path.basename(shard)
    reason = {"flip": "crc32", "truncate": "size", "delete": "missing", "manifest": "JSON"}[damage]
    assert name in warning and reason in warning


def test_when_every_checkpoint_is_corrupt_load_raises_instead_of_starting_over(url):
    model, optim = make_model(seed=1)
    with CheckpointManager(url) as mgr:
        mgr.save(1, make_state(model, optim, 1))
    _flip_byte(url, _first_shard(url, 1), 10)
    with CheckpointManager(url) as mgr:
        with pytest.raises(CheckpointError, match="none of the 1 checkpoints"):
            mgr.load_latest(fresh_state())


def test_async_training_step_runs_before_the_upload_finishes(url):
    """The step after save() completes while the writer is provably still paused; the
    checkpoint committed afterwards holds the state as of save(), not the later step's."""
    model, optim = make_model(seed=1)
    hook = EventPauseHook("written")
    step_done = threading.Event()
    state = make_state(model, optim, 5)
    expected = frozen_copy(state)
    with PausingCheckpointManager(url, async_save=True, pause_hook=hook) as mgr:
        mgr.save(5, state)
        train_step(model, optim, 6)  # the next training step, while the upload is in flight
        step_done.set()
        # The writer cannot finish before `release` is set, so the step above completed
        # while the upload was still running; it is parked at its pause point now.
        assert hook.reached.wait(30), "writer never reached its pause point"
        assert step_done.is_set() and not hook.release.is_set()
        assert mgr.latest_committed_step() is None
        hook.release.set()
        stats = mgr.wait()
        assert stats.step == 5 and stats.async_save
        assert stats.blocked_s < stats.save_duration_s
        assert mgr.latest_committed_step() == 5
        target = fresh_state()
        assert mgr.load_latest(target) == 5
    assert_state_equal(target, expected)


def test_guarded_optimizer_step_waits_for_staging_and_buffers_are_snapshotted_at_save(url):
    model, optim = make_model(seed=1)
    hook = EventPauseHook("staging")
    state = make_state(model, optim, 5)
    expected = frozen_copy(state)
    with PausingCheckpointManager(url, async_save=True, pause_hook=hook) as mgr:
        mgr.guard_optimizer(optim)
        mgr.save(5, state)  # returns before staging has even started
        assert hook.reached.wait(30)
        gen = torch.Generator().manual_seed(6)
        loss = model(torch.randn(6, 8, generator=gen)).pow(2).mean()  # changes BatchNorm buffers
        loss.backward()
        stepped = threading.Event()
        stepper = threading.Thread(target=lambda: (optim.step(), stepped.set()))
        stepper.start()
        assert not stepped.wait(0.3), "optimizer.step() ran while parameters were being staged"
        hook.release.set()
        assert stepped.wait(30)
        stepper.join()
        mgr.wait()
        assert not torch.equal(model.state_dict()["1.running_mean"], expected["model"]["1.running_mean"])
        target = fresh_state()
        assert mgr.load_latest(target) == 5
    assert_state_equal(target, expected)


def test_a_failed_background_save_surfaces_on_the_next_call_and_commits_nothing(url):
    def failing_hook(*, rank: int, step: int, phase: str) -> None:
        if phase == "written" and step == 2:
            raise OSError("disk full (injected)")

    model, optim = make_model(seed=1)
    with PausingCheckpointManager(url, async_save=True, pause_hook=failing_hook) as mgr:
        mgr.save(1, make_state(model, optim, 1))
        mgr.save(2, make_state(model, optim, 2))
        with pytest.raises(CheckpointError, match="background checkpoint save failed: saving step 2 .*disk full"):
            mgr.save(3, make_state(model, optim, 3))
        mgr.save(3, make_state(model, optim, 3))  # the error was reported once; saving goes on
        mgr.wait()
        assert [(e.step, e.committed) for e in mgr.list_checkpoints()] == [(1, True), (3, True)]


def test_a_failed_sync_save_raises_and_the_previous_checkpoint_stays_latest(url):
    def failing_hook(*, rank: int, step: int, phase: str) -> None:
        if step == 2:
            raise OSError("injected")

    model, optim = make_model(seed=1)
    state = make_state(model, optim, 1)
    expected = frozen_copy(state)
    with PausingCheckpointManager(url, keep_last=1, pause_hook=failing_hook) as mgr:
        mgr.save(1, state)
        with pytest.raises(CheckpointError, match="previous checkpoint stays the latest"):
            mgr.save(2, make_state(model, optim, 2))
        target = fresh_state()
        assert mgr.load_latest(target) == 1
    assert_state_equal(target, expected)


def test_if_busy_skip_drops_a_save_while_one_is_in_flight(url):
    model, optim = make_model(seed=1)
    hook = EventPauseHook("written")
    with PausingCheckpointManager(url, async_save=True, if_busy="skip", pause_hook=hook) as mgr:
        assert mgr.save(1, make_state(model, optim, 1)) is True
        assert hook.reached.wait(30)
        assert mgr.save(2, make_state(model, optim, 2)) is False
        hook.release.set()
        mgr.wait()
        assert mgr.save(3, make_state(model, optim, 3)) is True
        mgr.wait()
        assert [e.step for e in mgr.list_checkpoints()] == [1, 3]


def test_if_busy_wait_counts_the_wait_as_blocked_time(url):
    model, optim = make_model(seed=1)
    hook = EventPauseHook("written")
    seen = []
    with PausingCheckpointManager(url, async_save=True, pause_hook=hook, on_saved=seen.append) as mgr:
        mgr.save(1, make_state(model, optim, 1))
        assert hook.reached.wait(30)
        second = make_state(model, optim, 2)
        released_at = []
        # released 1 s after save(2) is called: save(2) reaches its wait long before that even on a loaded
        # machine, so its blocked time covers at least the last half of that second
        releaser = threading.Timer(1.0, lambda: (released_at.append(time.monotonic()), hook.release.set()))
        entered = time.monotonic()
        releaser.start()
        mgr.save(2, second)  # cannot start before save 1 is released and committed
        releaser.join()
        mgr.wait()
    assert [s.step for s in seen] == [1, 2]
    assert seen[1].blocked_s >= released_at[0] - entered - 0.5


def test_on_saved_reports_durations_and_sizes(url):
    seen = []
    model, optim = make_model(seed=1)
    with CheckpointManager(url, on_saved=seen.append) as mgr:
        mgr.save(4, make_state(model, optim, 4))
    assert len(seen) == 1
    stats = seen[0]
    assert stats.step == 4 and stats.world_size == 1 and not stats.async_save
    assert 0 < stats.blocked_s <= stats.save_duration_s
    assert stats.bytes_written == CheckpointStore(url).read_manifest(step_dir(url, 4)).total_bytes


def test_a_closed_manager_refuses_work(url):
    mgr = CheckpointManager(url)
    mgr.close()
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(1, {"extra": {}})


def test_bad_step_is_rejected(url):
    with CheckpointManager(url) as mgr:
        with pytest.raises(CheckpointError, match="step"):
            mgr.save(-1, {"extra": {}})


def test_the_package_holds_no_test_hooks():
    """Pause points live in tests/support; nothing in elastic_rt waits on a test file or variable."""
    import inspect
    import pathlib

    import elastic_rt

    assert not any(name.startswith("test") for name in inspect.signature(CheckpointManager).parameters)
    root = pathlib.Path(elastic_rt.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if any(word in path.read_text() for word in ("TEST_PAUSE", "test_pause", "pause_hook"))
    ]
    assert offenders == []


def test_a_new_step_directory_is_made_durable_in_the_root(tmp_path, monkeypatch):
    """On a local disk the root (and, for a new root, its parent) is fsynced after the step
    directory is created: the directory entry is as durable as the files in it."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    model, optim = make_model(seed=1)
    root = tmp_path / "runs" / "ckpt"
    with CheckpointManager(f"file://{root}") as mgr:
        mgr.save(1, make_state(model, optim, 1))
    assert str(root) in synced and str(root.parent) in synced
    assert str(root / "step_00000001") in synced  # the manifest's rename, as before
    synced.clear()
    with CheckpointManager(f"file://{root}", sync_files=False) as mgr:
        mgr.save(2, make_state(model, optim, 2))
    assert str(root) not in synced
