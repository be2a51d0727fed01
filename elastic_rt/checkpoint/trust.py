"""What a load trusts: unpicklers that build only known types (the job secret that signs manifests: secret.py).

Without a secret, checksums (crc32) catch damage, not forgery: whoever can write the checkpoint
URL can write a manifest. With `secret_file`, every manifest carries an HMAC-SHA256 of itself and
every file's sha256; a load verifies the manifest before reading any file and each file before
anything of it is unpickled. Independently of the secret, nothing read from storage is unpickled
with the full pickle machinery: DCP's `.metadata` goes through an allow-list of DCP's metadata
types, non-tensor values in the shards and per-rank files through torch's weights_only loader.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from elastic_rt.errors import CheckpointError

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata`: its metadata dataclasses, torch.Size, dtypes and layouts, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES and not name.startswith("__"):
            return super().find_class(module, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def load_metadata(data: bytes, where: str) -> Any:
    """DCP's Metadata from `.metadata` bytes; CheckpointError if it holds anything but DCP's types."""
    try:
        return MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as exc:
        raise CheckpointError(f"{where}: refused to unpickle ({exc})") from exc


_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def refused_type(what: str, exc: BaseException) -> CheckpointError:
    """One line for torch's weights_only refusal (its own message is a page): the type and the fix."""
    text = str(exc)
    found = _UNSUPPORTED_GLOBAL.search(text)
    named = found.group(1) if found else f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return CheckpointError(
        f"{what} holds a type the safe loader refuses ({named}); keep plain values (numbers, strings, lists, "
        "dicts, tensors) in checkpoint state, or allow the type before loading with "
        "torch.serialization.add_safe_globals([...]) if you trust whoever can write the checkpoint URL")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that non-tensor values are unpickled with torch's weights_only loader
    (DCP's own uses weights_only=False: any object, any code)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise refused_type(f"the value of {read_item.dest_index.fqn!r} in the checkpoint", exc) from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
