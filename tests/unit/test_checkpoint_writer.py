"""The shard stream under DCP's writer: checksums across chunks, and the early writeback hand-off."""

from __future__ import annotations

import io
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from elastic_rt.checkpoint import writer as writer_mod
from elastic_rt.checkpoint.backends import open_storage
from elastic_rt.checkpoint.writeback import start_writeback
from elastic_rt.checkpoint.writer import OVERLAP_CRC_MIN_BYTES, WRITE_CHUNK_BYTES, _ChecksumStream

CHUNK = WRITE_CHUNK_BYTES


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=1) as p:
        yield p


class Recorder:
    """A writeback callback that checks, at each call, that the range is already in the file."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.sizes: list[int] = []

    def __call__(self, fd: int, offset: int, nbytes: int) -> bool:
        size = os.fstat(fd).st_size
        assert size >= offset + nbytes, "writeback started before the bytes were written"
        self.calls.append((offset, nbytes))
        self.sizes.append(size)
        return True


@pytest.mark.parametrize("sizes", [
    [10, 3 * CHUNK + 5],                      # a header, then a tensor that is not a chunk multiple
    [2 * CHUNK, 7, CHUNK],                    # exact multiples around a small write
    [OVERLAP_CRC_MIN_BYTES - 1, OVERLAP_CRC_MIN_BYTES],
])
def test_size_crc_and_writeback_ranges(tmp_path, pool, sizes):
    data = [os.urandom(n) for n in sizes]
    rec = Recorder()
    path = tmp_path / "shard"
    with open(path, "wb") as raw:
        stream = _ChecksumStream(raw, pool, rec)
        for d in data:
            assert stream.write(d) == len(d)
        raw.flush()
    whole = b"".join(data)
    assert stream.size == len(whole) == path.stat().st_size
    assert stream.crc == zlib.crc32(whole)
    assert path.read_bytes() == whole
    # Every large write is handed over chunk by chunk, contiguously, and nothing else is.
    expected, offset = [], 0
    for d in data:
        if len(d) >= OVERLAP_CRC_MIN_BYTES:
            expected += [(offset + s, min(CHUNK, len(d) - s)) for s in range(0, len(d), CHUNK)]
        offset += len(d)
    assert rec.calls == expected


def test_stream_without_a_file_descriptor_skips_writeback(pool):
    rec = Recorder()
    raw = io.BytesIO()  # fileno() raises, like a remote fsspec file
    stream = _ChecksumStream(raw, pool, rec)
    payload = os.urandom(CHUNK + 1)
    stream.write(payload)
    assert rec.calls == [] and raw.getvalue() == payload and stream.crc == zlib.crc32(payload)


def test_platform_writeback_accepts_a_real_file(tmp_path):
    start = start_writeback()
    if start is None:
        pytest.skip("no sync_file_range on this platform")
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * 4096)
        f.flush()
        assert start(f.fileno(), 0, 4096) is True  # the kernel accepted it; fsync still gives durability
        assert start(f.fileno(), -1, 4096) is False  # and a refusal is reported, not raised
        os.fsync(f.fileno())


def test_writer_enables_writeback_only_with_fsync(tmp_path):
    fs = open_storage(f"file://{tmp_path}")
    on = writer_mod.ChecksumWriter(fs, str(tmp_path / "a"), rank=0, step=1, sync_files=True)
    off = writer_mod.ChecksumWriter(fs, str(tmp_path / "b"), rank=0, step=1, sync_files=False)
    assert (on.fs._writeback is not None) == (start_writeback() is not None)
    assert off.fs._writeback is None


class FailingRaw(io.RawIOBase):
    def __init__(self, crc_started: threading.Event) -> None:
        self.crc_started = crc_started

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.crc_started.wait(5)
        raise OSError(28, "No space left on device")


def test_failed_write_waits_for_the_checksum_of_its_chunk(pool, monkeypatch):
    """torch.save hands views of tensor memory that may be freed once write() returns or raises:
    the helper thread must be done reading the chunk by then."""
    started, finished = threading.Event(), threading.Event()
    real_crc = zlib.crc32

    def slow_crc(data, value=0):
        started.set()
        time.sleep(0.2)  # a long checksum: the failed write is reported while it still runs
        result = real_crc(data, value)
        finished.set()
        return result

    monkeypatch.setattr(writer_mod.checksum, "crc32", slow_crc)
    stream = _ChecksumStream(FailingRaw(started), pool)
    with pytest.raises(OSError, match="No space left"):
        stream.write(bytes(OVERLAP_CRC_MIN_BYTES))
    assert finished.is_set()


def test_dcp_save_through_the_writer_hands_chunks_to_writeback(tmp_path, monkeypatch):
    import torch
    import torch.distributed.checkpoint as dcp

    rec = Recorder()
    monkeypatch.setattr(writer_mod, "start_writeback", lambda: rec)
    state = {"big": torch.arange(CHUNK // 4 + 1000, dtype=torch.float32), "small": torch.ones(3)}
    path = str(tmp_path / "step")
    os.makedirs(path)
    w = writer_mod.ChecksumWriter(open_storage(f"file://{tmp_path}"), path, rank=0, step=1, sync_files=True)
    dcp.save(state, storage_writer=w, no_dist=True)
    w.close()
    (shard, (size, crc, _)), = [(p, v) for p, v in w.fs.written.items() if p.endswith(".distcp")]
    assert size == os.path.getsize(shard) and crc == zlib.crc32(open(shard, "rb").read())
    # the 1 MiB+ tensor went out in two chunks, each handed over as soon as it was in the file
    assert [n for _, n in rec.calls] == [CHUNK, 4000]
    assert all(offset + n <= size for offset, n in rec.calls)
