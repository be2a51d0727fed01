"""Sharded, atomic, async checkpoints on fsspec, restorable at another world size (DCP underneath).

The names below are loaded on first use: the agent and the `status`, `gc`, `doctor` and `checkpoint`
commands reach submodules of this package (storage, manifests, the host cache) without paying for
torch.distributed.checkpoint, which only `CheckpointManager` needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "CheckpointManager": "manager",
    "FORMAT_VERSION": "manifest", "MANIFEST_NAME": "manifest", "FileEntry": "manifest", "Manifest": "manifest",
    "ManifestError": "manifest",
    "CheckpointOptions": "options", "SaveStats": "options",
    "capture_rng_state": "user_state", "restore_rng_state": "user_state",
    "CheckpointEntry": "storage", "CheckpointStore": "storage",
}

__all__ = sorted(_WHERE)

if TYPE_CHECKING:
    from elastic_rt.checkpoint.manager import CheckpointManager
    from elastic_rt.checkpoint.manifest import FORMAT_VERSION, MANIFEST_NAME, FileEntry, Manifest, ManifestError
    from elastic_rt.checkpoint.options import CheckpointOptions, SaveStats
    from elastic_rt.checkpoint.storage import CheckpointEntry, CheckpointStore
    from elastic_rt.checkpoint.user_state import capture_rng_state, restore_rng_state


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
