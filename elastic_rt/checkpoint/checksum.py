"""The crc32 of checkpoint bytes: zlib's polynomial and values, computed by ISA-L's SIMD code.

Every file a save writes, a load reads, the host cache maps and the replica channel carries goes
through crc32 once. ISA-L's (python-isal) is about 5x zlib's on this project's machine (13.7 against
4.0 GB/s on one core; 2 GiB in 2.3 s against 11.4 s with a second thread busy) and releases the GIL
as zlib's does, so the checksum threads still overlap with the writes. The values are zlib's: a
manifest written with either verifies with the other.
"""

from __future__ import annotations

from isal.isal_zlib import crc32

__all__ = ["crc32"]
