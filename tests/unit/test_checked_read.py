"""The load's own read checks each data file's crc32: whole files covered, corruption falls back, never a bad state."""

from __future__ import annotations

import io
import logging
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint import checked_read
from elastic_rt.checkpoint.checked_read import CheckedFile
from elastic_rt.checkpoint.manifest import FileEntry
from elastic_rt.checkpoint.storage import CheckpointStore
from elastic_rt.errors import CheckpointError


@pytest.fixture
def pool():
    with ThreadPoolExecutor(1) as executor:
        yield executor


def _entry(data: bytes) -> FileEntry:
    return FileEntry(path="__0_0.distcp", size=len(data), crc32=zlib.crc32(data), rank=0)


def test_pieces_gaps_and_the_rest_are_all_checked(pool, monkeypatch):
    monkeypatch.setattr(checked_read, "READ_PIECE_BYTES", 1 << 20)  # several pieces, some through the pool
    data = os.urandom(5 * (1 << 20) + 123)
    checked = CheckedFile(io.BytesIO(data), pool)
    first = bytearray(3 * (1 << 20))
    checked.read_into(1000, memoryview(first))  # the gap [0, 1000) is read too
    second = bytearray(10)
    checked.read_into(len(data) - 500, memoryview(second))
    assert bytes(first) == data[1000:1000 + len(first)] and bytes(second) == data[-500:-490]
    assert checked.finish(_entry(data), "__0_0.distcp") is None
    assert checked.pos == len(data)


@pytest.mark.parametrize("damage", ["gap", "piece", "rest"])
def test_a_changed_byte_anywhere_is_reported(pool, damage):
    data = bytearray(os.urandom(3 * (1 << 20)))
    entry = _entry(bytes(data))
    data[{"gap": 10, "piece": 2 << 20, "rest": len(data) - 1}[damage]] ^= 0x01
    checked = CheckedFile(io.BytesIO(bytes(data)), pool)
    checked.read_into(100, memoryview(bytearray(2 * (1 << 20) + 100)))
    problem = checked.finish(entry, entry.path)
    assert problem is not None and problem.startswith(f"{entry.path}: crc32 ")


def test_a_short_file_and_a_read_backwards_are_refused(pool):
    data = os.urandom(1000)
    checked = CheckedFile(io.BytesIO(data), pool)
    with pytest.raises(EOFError):
        checked.read_into(900, memoryview(bytearray(200)))
    checked = CheckedFile(io.BytesIO(data), pool)
    checked.read_into(500, memoryview(bytearray(10)))
    with pytest.raises(ValueError):
        checked.read_into(100, memoryview(bytearray(10)))
    assert "size 1000 bytes, manifest says 1001" in CheckedFile(io.BytesIO(data), pool).finish(
        FileEntry(path="f.distcp", size=1001, crc32=zlib.crc32(data), rank=0), "f.distcp")


def _save_two_steps(url: str) -> None:
    with CheckpointManager(url) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": {"w": torch.full((256, 1024), float(step)), "b": torch.full((7,), float(step))},
                            "extra": {"step": step}})


def _shard(tmp_path, step: int):
    return next((tmp_path / "ckpt" / f"step_{step:08d}").glob("save-*/*.distcp"))


@pytest.mark.parametrize("where", ["tensor bytes", "record header", "end of file"])
def test_a_flipped_byte_in_a_shard_is_caught_by_the_load_and_the_previous_step_is_loaded_whole(
    tmp_path, monkeypatch, caplog, where
):
    url = f"file://{tmp_path}/ckpt"
    _save_two_steps(url)
    shard = _shard(tmp_path, 2)
    data = bytearray(shard.read_bytes())
    offset = {"tensor bytes": data.find(struct.pack("<f", 2.0) * 1024) + 4096 + 1, "record header": 10,
              "end of file": len(data) - 10}[where]
    data[offset] ^= 0x10
    shard.write_bytes(bytes(data))
    checksummed: list[str] = []
    whole_file_digest = CheckpointStore._digest
    monkeypatch.setattr(CheckpointStore, "_digest",
                        lambda self, path, sha: checksummed.append(path) or whole_file_digest(self, path, sha))
    state = {"model": {"w": torch.zeros(256, 1024), "b": torch.zeros(7)}, "extra": {"step": 0}}
    with caplog.at_level(logging.WARNING, logger="elastic_rt.checkpoint"):
        with CheckpointManager(url) as mgr:
            assert mgr.load_latest(state) == 1
    assert torch.equal(state["model"]["w"], torch.full((256, 1024), 1.0))
    assert torch.equal(state["model"]["b"], torch.full((7,), 1.0)) and state["extra"] == {"step": 1}
    assert not any(p.endswith(".distcp") for p in checksummed), checksummed  # no separate pass over the shards
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"{shard.name}: crc32" in warning and "falling back to step 1" in warning


def test_a_flipped_byte_in_the_only_step_is_an_error_not_a_state(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    with CheckpointManager(url) as mgr:
        mgr.save(1, {"model": {"w": torch.full((1024,), 1.0)}})
    shard = _shard(tmp_path, 1)
    data = bytearray(shard.read_bytes())
    data[data.find(struct.pack("<f", 1.0) * 64) + 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with CheckpointManager(url) as mgr:
        with pytest.raises(CheckpointError, match=f"{shard.name}: crc32"):
            mgr.load_latest({"model": {"w": torch.zeros(1024)}})
