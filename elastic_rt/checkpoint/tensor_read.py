"""Zero-copy loads of DCP tensor records: each record's bytes go straight into the destination tensor.

DCP's FileSystemReader torch.load()s every tensor record (a small zip archive written by
torch.save: data.pkl plus the raw bytes of one storage) into a new tensor, then copies it
into the state's tensor: the bytes are copied twice after the read and the memory is
allocated once more. Here the record is parsed (the zip's central directory and data.pkl,
with an unpickler that only builds a description of the tensor), and the tensor's bytes
are read straight into the destination tensor's memory (readinto), or, from a buffer (a
memory copy mapped from /dev/shm), copied once with copy_. The on-disk format is DCP's,
unchanged. Anything this does not know (a transform, compression, a non-contiguous or
partial record, a dtype or device that differs, a narrowed request) is left to DCP's path.
"""

from __future__ import annotations

import io
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header (30 bytes)


@dataclass(frozen=True, kw_only=True)
class TensorRecord:
    """Where a tensor's bytes are within a checkpoint file, and what they are."""

    offset: int  # in the file
    nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]


class _Storage:
    def __init__(self, key: str, dtype: torch.dtype) -> None:
        self.key, self.dtype = key, dtype


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)


def _rebuild_tensor(storage, storage_offset, size, stride, *_rest) -> _Tensor:
    return _Tensor(storage, storage_offset, size, stride)


class _DescribingUnpickler(pickle.Unpickler):
    """Reads a torch.save data.pkl of one plain tensor into a _Tensor; refuses anything else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name.endswith("Storage") and isinstance(getattr(torch, name, None), type):
            return getattr(torch, name)
        if module == "collections" and name == "OrderedDict":
            return dict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unknown persistent id")
        storage_type, key = pid[1], str(pid[2])
        dtype = storage_type if isinstance(storage_type, torch.dtype) else getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("untyped storage")
        return _Storage(key, dtype)


class _Slice(io.RawIOBase):
    """[offset, offset + length) of a seekable stream, for zipfile."""

    def __init__(self, stream: Any, offset: int, length: int) -> None:
        self._s, self._base, self._len, self._pos = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence] + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._len - self._pos))
        self._s.seek(self._base + self._pos)
        got = self._s.readinto(memoryview(b)[:n]) if n else 0
        self._pos += got or 0
        return got or 0


def locate(stream: Any, offset: int, length: int) -> TensorRecord | None:
    """The tensor record at [offset, offset + length) of `stream`, or None when it is not a plain,
    uncompressed, contiguous, whole-storage tensor."""
    try:
        with zipfile.ZipFile(io.BufferedReader(_Slice(stream, offset, length))) as zf:
            pkl = next((i for i in zf.infolist() if i.filename.endswith("/data.pkl")), None)
            if pkl is None:
                return None
            # the entries' own zip crc32 is not checked (the writer leaves it out: the manifest's
            # whole-file crc32 covers these bytes)
            stream.seek(offset + _data_offset(stream, offset, pkl))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # TypedStorage.dtype is deprecated
                desc = _DescribingUnpickler(io.BytesIO(stream.read(pkl.compress_size))).load()
            if not isinstance(desc, _Tensor):
                return None
            info = zf.getinfo(f"{pkl.filename[:-len('data.pkl')]}data/{desc.storage.key}")
        data_at = _data_offset(stream, offset, info)
    except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, EOFError, ValueError, TypeError, struct.error):
        return None
    itemsize = torch.empty((), dtype=desc.storage.dtype).element_size()
    numel = 1
    for d in desc.size:
        numel *= d
    if desc.stride != _contiguous_stride(desc.size) or (desc.offset + numel) * itemsize > info.file_size:
        return None
    return TensorRecord(offset=offset + data_at + desc.offset * itemsize, nbytes=numel * itemsize,
                        dtype=desc.storage.dtype, size=desc.size)


def _data_offset(stream: Any, offset: int, info: zipfile.ZipInfo) -> int:
    """Where a stored (uncompressed) entry's bytes start, from the record's start."""
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        raise ValueError("compressed entry")
    stream.seek(offset + info.header_offset)
    header = _LOCAL_HEADER.unpack(stream.read(_LOCAL_HEADER.size))
    if header[0] != b"PK\x03\x04":
        raise ValueError("no local header")
    return info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]


def _contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(size):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def fits(record: TensorRecord, target: torch.Tensor) -> bool:
    return (target.device.type == "cpu" and target.dtype == record.dtype and tuple(target.shape) == record.size
            and target.is_contiguous() and not target.is_quantized and target.layout == torch.strided)


def byte_view(target: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, as bytes (no copy)."""
    return memoryview(target.view(-1).view(torch.uint8).numpy()).cast("B")


def read_into(stream: Any, record: TensorRecord, target: torch.Tensor) -> None:
    """Fill `target` (fits(record, target)) with the record's bytes: from a buffer-backed stream by one
    copy_ of a view over the buffer, else by readinto() into the tensor's memory."""
    if record.nbytes == 0:
        return
    dest = target.view(-1).view(torch.uint8)
    buffer = getattr(stream, "buffer_view", None)
    if buffer is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only mapping: only read here
            src = torch.frombuffer(buffer, dtype=torch.uint8, count=record.nbytes, offset=record.offset)
        dest.copy_(src)
        return
    stream.seek(record.offset)
    read_fully(stream, byte_view(target))


def read_fully(stream: Any, view: memoryview) -> None:
    """Fill `view` from the stream's position; EOFError when the stream ends first."""
    done = 0
    while done < view.nbytes:
        got = stream.readinto(view[done:])
        if not got:
            raise EOFError(f"checkpoint record ends after {done} of {view.nbytes} bytes")
        done += got
