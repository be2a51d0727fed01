"""Absent, committed, damaged: a damaged manifest is never deleted, never skipped in silence.

The issue's table, tried with the public CheckpointManager API only: save steps 10 and 20 with
keep_last=2, damage step 20's manifest, then load_latest() and three more saves.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from elastic_rt.checkpoint import MANIFEST_NAME, CheckpointManager
from elastic_rt.checkpoint.retention import apply_retention
from elastic_rt.errors import CheckpointError


def state_at(step: int) -> dict:
    torch.manual_seed(step)
    return {"w": torch.randn(64), "extra": {"step": step}}


def empty_state() -> dict:
    return {"w": torch.zeros(64), "extra": {"step": -1}}


def step_path(root, step: int):
    return root / f"step_{step:08d}"


def save_10_and_20(url: str) -> None:
    with CheckpointManager(url, keep_last=2) as mgr:
        assert mgr.save(10, state_at(10)) is True
        assert mgr.save(20, state_at(20)) is True


def newer_format(manifest) -> None:
    body = json.loads(manifest.read_bytes())
    body["format_version"] = 99
    manifest.write_text(json.dumps(body))


def unreadable(manifest) -> None:
    """An I/O error other than 'not found': opening a directory fails with EISDIR."""
    manifest.unlink()
    manifest.mkdir()


def bit_flip(manifest) -> None:
    data = bytearray(manifest.read_bytes())
    at = data.index(b'"step"') + len(b'"step": ')  # a digit of the step number stays valid JSON
    data[at] ^= 0x01
    manifest.write_bytes(bytes(data))


def three_more_saves(url: str) -> None:
    with CheckpointManager(url, keep_last=2) as mgr:
        for step in (30, 40, 50):
            assert mgr.save(step, state_at(step)) is True
        mgr.list_checkpoints()  # waits for retention


@pytest.mark.parametrize("damage,says", [
    (newer_format, "upgrade elastic-rt"),
    (unreadable, "storage"),
], ids=["newer-format", "unreadable"])
def test_a_manifest_that_cannot_be_trusted_stops_the_load_with_one_line_naming_the_step(tmp_path, damage, says):
    url = f"file://{tmp_path}"
    save_10_and_20(url)
    damage(step_path(tmp_path, 20) / MANIFEST_NAME)
    target = empty_state()
    with CheckpointManager(url, keep_last=2) as mgr:
        with pytest.raises(CheckpointError) as exc_info:
            mgr.load_latest(target)
    text = str(exc_info.value)
    assert "\n" not in text and "step 20" in text and says in text
    assert torch.equal(target["w"], torch.zeros(64))  # nothing was loaded


def test_a_flipped_bit_in_the_manifest_falls_back_with_a_warning(tmp_path, caplog):
    url = f"file://{tmp_path}"
    save_10_and_20(url)
    bit_flip(step_path(tmp_path, 20) / MANIFEST_NAME)
    target = empty_state()
    with caplog.at_level(logging.WARNING, logger="elastic_rt.checkpoint"):
        with CheckpointManager(url, keep_last=2) as mgr:
            assert mgr.load_latest(target) == 10
    assert torch.equal(target["w"], state_at(10)["w"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 20" in w and "falling back to step 10" in w for w in warnings), warnings


@pytest.mark.parametrize("damage", [newer_format, unreadable, bit_flip], ids=["newer-format", "unreadable", "bit-flip"])
def test_retention_never_deletes_a_damaged_checkpoint(tmp_path, damage, caplog):
    url = f"file://{tmp_path}"
    save_10_and_20(url)
    manifest = step_path(tmp_path, 20) / MANIFEST_NAME
    damage(manifest)
    kept = sorted(os.listdir(step_path(tmp_path, 20)))
    with caplog.at_level(logging.WARNING, logger="elastic_rt.checkpoint"):
        three_more_saves(url)
    assert sorted(os.listdir(step_path(tmp_path, 20))) == kept
    assert step_path(tmp_path, 40).is_dir() and step_path(tmp_path, 50).is_dir()
    assert not step_path(tmp_path, 10).exists() and not step_path(tmp_path, 30).exists()
    assert any("step 20" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_an_unreadable_root_is_an_error_not_a_fresh_start(tmp_path):
    """A root whose listing fails with anything but 'not found' (here ELOOP) must not read as 'no checkpoints'."""
    root = tmp_path / "loop"
    os.symlink(root, root)
    with pytest.raises(CheckpointError) as exc_info:
        with CheckpointManager(f"file://{root}") as mgr:
            mgr.load_latest(empty_state())
    assert "\n" not in str(exc_info.value) and str(root) in str(exc_info.value)


def test_a_missing_root_is_a_fresh_start(tmp_path):
    with CheckpointManager(f"file://{tmp_path}/never-written") as mgr:
        assert mgr.load_latest(empty_state()) is None


def test_saving_a_step_again_commits_the_new_state_or_says_it_did_not(tmp_path):
    """save() returning True means this call's state is what that step now loads."""
    url = f"file://{tmp_path}"
    with CheckpointManager(url) as mgr:
        assert mgr.save(5, state_at(5)) is True
        assert mgr.save(5, state_at(6)) is True
        target = empty_state()
        assert mgr.load_latest(target) == 5
    assert torch.equal(target["w"], state_at(6)["w"])


@pytest.mark.parametrize("keep_last", [1, 2])
def test_after_a_fallback_retention_keeps_the_new_commit_and_the_verified_ones_below_it(tmp_path, keep_last):
    """Step 30's data is corrupt (a flipped byte: its sizes still match), so the job resumes from 20 and saves 25.
    Retention counts from the new commit down: 30, above it, is neither counted nor deleted, and 25 (the only
    checkpoint after 20 that verifies) is never deleted because a damaged one sits above it."""
    url = f"file://{tmp_path}"
    with CheckpointManager(url, keep_last=3) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state_at(step))
    shard = next(step_path(tmp_path, 30).glob("save-*/*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with CheckpointManager(url, keep_last=keep_last) as mgr:
        assert mgr.load_latest(empty_state()) == 20
        assert mgr.save(25, state_at(25)) is True
        remaining = [e.step for e in mgr.list_checkpoints()]
    assert remaining == ([20, 25, 30] if keep_last == 2 else [25, 30])
    target = empty_state()
    with CheckpointManager(url, keep_last=keep_last) as mgr:
        assert mgr.load_latest(target) == 25
    assert torch.equal(target["w"], state_at(25)["w"])


def test_retention_deletes_nothing_when_the_new_commit_does_not_match_its_manifest(tmp_path, caplog):
    """A new commit whose file is shorter than its manifest says (lost writeback, a truncating copy) is no reason
    to delete anything: every older checkpoint stays, and the log says why."""
    url = f"file://{tmp_path}"
    with CheckpointManager(url, keep_last=3) as mgr:
        for step in (10, 20, 30):
            assert mgr.save(step, state_at(step)) is True
        mgr.list_checkpoints()  # waits for retention
        shard = next(step_path(tmp_path, 30).glob("save-*/*.distcp"))
        shard.write_bytes(shard.read_bytes()[:-1])
        with caplog.at_level(logging.WARNING, logger="elastic_rt.checkpoint.retention"):
            assert apply_retention(mgr._store, mgr._guard, keep_last=1, newest_step=30) == []
        assert [e.step for e in mgr.list_checkpoints()] == [10, 20, 30]
    assert "does not match its manifest" in caplog.text
