"""checkpoint/checksum.crc32 gives zlib's values: manifests written with either verify with the other."""

from __future__ import annotations

import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_rt.checkpoint import checksum


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=1 << 14), split=st.integers(min_value=0, max_value=1 << 14),
       seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_crc32_is_zlibs_whole_chunked_and_seeded(data, split, seed):
    split = min(split, len(data))
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data, seed) == zlib.crc32(data, seed)
    running = checksum.crc32(memoryview(data)[split:], checksum.crc32(memoryview(data)[:split]))
    assert running == zlib.crc32(data)


def test_crc32_of_large_buffers_and_views():
    data = bytearray(range(256)) * (1 << 14)  # 4 MiB: the SIMD path
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(memoryview(data)[7:-3]) == zlib.crc32(memoryview(data)[7:-3])
