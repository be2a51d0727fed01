"""A checkpoint file read front to back while its crc32 is computed: the load's own read verifies it.

DCP's data files (`*.distcp`) are the bulk of a checkpoint. Checking their crc32 in a pass of
its own before the load reads every byte twice and makes the restore wait for the checksum.
Instead the loader reads each data file once, in increasing offsets: the tensors' bytes go
straight into the state's tensors and everything between them (zip headers, pickles, records
left to DCP's own path) into a scratch buffer, every byte through crc32 (checkpoint/checksum.py);
the crc32 of a large piece runs in a helper thread (it releases the GIL) while the next piece is read.
After the last record the rest of the file is read and checked too, so the whole file is
covered. The other files (`.metadata`, per-rank files: small pickles) are still checked
before anything unpickles them.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from elastic_rt.checkpoint.manifest import FileEntry
from elastic_rt.checkpoint.storage import file_problem
from elastic_rt.checkpoint.tensor_read import read_fully
from elastic_rt.checkpoint import checksum

# Pieces at least this large get their crc32 computed in the helper thread while the next one is read.
OVERLAP_MIN_BYTES = 1 << 20
READ_PIECE_BYTES = 8 << 20
TAIL_PIECE_BYTES = 1 << 20


def verified_while_loading(name: str) -> bool:
    """True for the files whose crc32 the load's own read checks (DCP's data files)."""
    return name.endswith(".distcp")


class CheckedFile:
    """Reads one stream in increasing offsets and computes the crc32 of every byte of it."""

    def __init__(self, stream: Any, pool: ThreadPoolExecutor, *, sha: bool = False) -> None:
        self._stream, self._pool = stream, pool
        self.pos = 0
        self._crc = 0
        self._hasher = hashlib.sha256() if sha else None  # with a job secret: the signed manifest's sha256
        self._pending: Future | None = None

    def read_into(self, offset: int, view: memoryview) -> None:
        """Read [offset, offset + len(view)) into `view` (offset >= pos; the gap is read and checked)."""
        self._skip_to(offset)
        self._read_exactly(view)

    def finish(self, entry: FileEntry | None, name: str) -> str | None:
        """Read and check the rest of the file; the problem line, or None when it matches `entry`."""
        while True:
            piece = memoryview(bytearray(TAIL_PIECE_BYTES))  # the rest is mostly a record's zip directory
            got = self._readinto(piece)
            if not got:
                break
            self._feed(piece[:got])
        crc = self._settle()
        if entry is None:
            return f"{name}: not in the manifest"
        if self.pos != entry.size:
            return f"{name}: size {self.pos} bytes, manifest says {entry.size}"
        return file_problem(entry, (crc, self._hasher.hexdigest() if self._hasher is not None else None))

    def close(self) -> None:
        """Wait for the helper thread (it may still read memory the caller is about to free)."""
        self._settle()

    def _skip_to(self, offset: int) -> None:
        if offset < self.pos:
            raise ValueError(f"checked read at {offset}, already past {self.pos}")
        if offset > self.pos:
            self._read_exactly(memoryview(bytearray(offset - self.pos)))

    def _read_exactly(self, view: memoryview) -> None:
        view = view.cast("B") if view.format != "B" else view
        for start in range(0, view.nbytes, READ_PIECE_BYTES):
            piece = view[start:start + READ_PIECE_BYTES]
            self._stream.seek(self.pos)
            read_fully(self._stream, piece)
            self.pos += piece.nbytes
            self._feed(piece)

    def _readinto(self, view: memoryview) -> int:
        self._stream.seek(self.pos)  # others (locating records) move the stream between reads
        got = self._stream.readinto(view) or 0
        self.pos += got
        return got

    def _digest(self, piece: memoryview, crc: int) -> int:
        if self._hasher is not None:
            self._hasher.update(piece)
        return checksum.crc32(piece, crc)

    def _feed(self, piece: memoryview) -> None:
        crc = self._settle()
        if piece.nbytes < OVERLAP_MIN_BYTES:
            self._crc = self._digest(piece, crc)
        else:
            self._pending = self._pool.submit(self._digest, piece, crc)

    def _settle(self) -> int:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._crc = pending.result()
        return self._crc
