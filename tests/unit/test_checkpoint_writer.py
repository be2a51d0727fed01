"""The shard stream under DCP's writer: checksums across chunks, and the early writeback hand-off."""

from __future__ import annotations

import io
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from elastic_rt.checkpoint import writer as writer_mod
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

    def __call__(self, fd: int, offset: int, nbytes: int) -> None:
        assert os.fstat(fd).st_size >= offset + nbytes, "writeback started before the bytes were written"
        self.calls.append((offset, nbytes))


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
        start(f.fileno(), 0, 4096)  # must not raise; durability still comes from fsync
        os.fsync(f.fileno())


def test_writer_enables_writeback_only_with_fsync(tmp_path):
    import fsspec

    fs = fsspec.filesystem("file")
    on = writer_mod.ChecksumWriter(fs, str(tmp_path / "a"), rank=0, step=1, sync_files=True)
    off = writer_mod.ChecksumWriter(fs, str(tmp_path / "b"), rank=0, step=1, sync_files=False)
    assert (on.fs._writeback is not None) == (start_writeback() is not None)
    assert off.fs._writeback is None
