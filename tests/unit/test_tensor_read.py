"""Zero-copy tensor reads: torch.save records located inside a file and read straight into tensors."""

from __future__ import annotations

import io

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic_rt.checkpoint import tensor_read
from elastic_rt.checkpoint.host_cache import _ViewStream
from elastic_rt.checkpoint.backends import open_storage
from elastic_rt.checkpoint.writer import CheckpointReader, ChecksumWriter


def _file_with_record(t: torch.Tensor, pad: int = 37) -> tuple[bytes, int, int]:
    body = io.BytesIO()
    torch.save(t, body)
    data = b"x" * pad + body.getvalue() + b"y" * pad
    return data, pad, len(body.getvalue())


@pytest.mark.parametrize("tensor", [
    torch.randn(5, 7), torch.arange(12, dtype=torch.int64).reshape(3, 4), torch.randn(4, 3).to(torch.bfloat16),
    torch.tensor(3.5), torch.empty(0, 4), torch.arange(10.0)[3:],  # a view into a larger storage
], ids=["float32", "int64", "bfloat16", "scalar", "empty", "offset-view"])
def test_record_is_read_into_the_target_from_a_file_and_from_a_buffer(tensor):
    data, offset, length = _file_with_record(tensor)
    for stream in (io.BytesIO(data), _ViewStream(bytearray(data))):
        record = tensor_read.locate(stream, offset, length)
        assert record is not None and record.size == tuple(tensor.shape) and record.dtype == tensor.dtype
        target = torch.full_like(tensor, 9)
        assert tensor_read.fits(record, target)
        tensor_read.read_into(stream, record, target)
        assert torch.equal(target, tensor)


def test_records_it_cannot_read_directly_are_left_to_dcp():
    data, offset, length = _file_with_record(torch.randn(3, 4).t())  # not contiguous
    assert tensor_read.locate(io.BytesIO(data), offset, length) is None
    data, offset, length = _file_with_record({"not": "a tensor"})
    assert tensor_read.locate(io.BytesIO(data), offset, length) is None
    assert tensor_read.locate(io.BytesIO(b"garbage" * 20), 3, 100) is None
    data, offset, length = _file_with_record(torch.randn(2, 3))
    record = tensor_read.locate(io.BytesIO(data), offset, length)
    assert not tensor_read.fits(record, torch.empty(2, 3, dtype=torch.float64))  # DCP casts it
    assert not tensor_read.fits(record, torch.empty(3, 2))


def test_dcp_load_through_the_reader_reads_tensors_directly_and_the_rest_as_dcp(tmp_path):
    storage = open_storage(f"file://{tmp_path}")
    state = {"w": torch.randn(64, 32), "b": torch.randn(32).to(torch.bfloat16), "t": torch.randn(4, 5).t(),
             "meta": {"step": 7, "name": "x"}}
    writer = ChecksumWriter(storage, str(tmp_path), rank=0, step=1, sync_files=False)
    dcp.save(state, storage_writer=writer, no_dist=True)
    target = {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16), "t": torch.zeros(5, 4),
              "meta": {"step": 0, "name": ""}}
    reader = CheckpointReader(storage.open_read, str(tmp_path))
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert torch.equal(target["t"], state["t"]) and target["meta"] == {"step": 7, "name": "x"}
    assert reader.zero_copy_items >= 2  # w and b; t was saved as a copy DCP made contiguous, or read by DCP
    # the files are DCP's own: torch's reader loads them as before
    plain = {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16), "t": torch.zeros(5, 4),
             "meta": {"step": 0, "name": ""}}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(plain["w"], state["w"]) and torch.equal(plain["t"], state["t"])
