"""Sharded, atomic, async checkpoints on fsspec, restorable at another world size (DCP underneath)."""

from __future__ import annotations

from elastic_rt.checkpoint.manager import CheckpointManager
from elastic_rt.checkpoint.manifest import FORMAT_VERSION, MANIFEST_NAME, FileEntry, Manifest, ManifestError
from elastic_rt.checkpoint.options import CheckpointOptions, SaveStats
from elastic_rt.checkpoint.user_state import capture_rng_state, restore_rng_state
from elastic_rt.checkpoint.storage import CheckpointEntry, CheckpointStore

__all__ = [
    "CheckpointEntry",
    "CheckpointManager",
    "CheckpointOptions",
    "CheckpointStore",
    "FORMAT_VERSION",
    "FileEntry",
    "MANIFEST_NAME",
    "Manifest",
    "ManifestError",
    "SaveStats",
    "capture_rng_state",
    "restore_rng_state",
]
