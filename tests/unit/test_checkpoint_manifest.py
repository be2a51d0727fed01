"""Manifest encoding/validation and option validation (pure logic)."""

from __future__ import annotations

import json

import pytest

from elastic_rt.checkpoint.manifest import FORMAT_VERSION, FileEntry, Manifest, ManifestError
from elastic_rt.checkpoint.options import CheckpointOptions
from elastic_rt.errors import CheckpointError, ConfigError


def _manifest(**overrides) -> Manifest:
    fields = dict(
        step=120,
        world_size=4,
        files=(
            FileEntry(path="__0_0.distcp", size=1024, crc32=0xDEADBEEF, rank=0),
            FileEntry(path=".metadata", size=77, crc32=1, rank=0),
            FileEntry(path="rank_00003.pt", size=5, crc32=0, rank=3),
        ),
        created_unix_s=1_700_000_000.25,
        torch_version="2.13.0",
        per_rank_keys=("rng",),
    )
    fields.update(overrides)
    return Manifest(**fields)


def test_roundtrip_keeps_every_field():
    original = _manifest()
    parsed = Manifest.from_json(original.to_json())
    assert parsed.step == 120 and parsed.world_size == 4
    assert sorted(parsed.files, key=lambda f: f.path) == sorted(original.files, key=lambda f: f.path)
    assert parsed.total_bytes == 1024 + 77 + 5
    assert parsed.created_unix_s == original.created_unix_s
    assert parsed.per_rank_keys == ("rng",)
    assert parsed.format_version == FORMAT_VERSION


def test_a_changed_field_is_detected_by_the_manifest_checksum():
    body = json.loads(_manifest().to_json())
    body["files"][0]["size"] += 1
    with pytest.raises(ManifestError, match="checksum"):
        Manifest.from_json(json.dumps(body).encode())


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "JSON"),
        (b"\xff\xfe", "JSON"),
        (b"[1, 2]", "object"),
        (b'{"format": "something-else"}', "not an elastic-rt manifest"),
    ],
)
def test_garbage_is_rejected_with_a_reason(data, reason):
    with pytest.raises(ManifestError, match=reason):
        Manifest.from_json(data)


def test_a_truncated_manifest_is_rejected():
    data = _manifest().to_json()
    with pytest.raises(ManifestError):
        Manifest.from_json(data[: len(data) // 2])


def test_a_newer_format_version_asks_for_an_upgrade():
    body = json.loads(_manifest(format_version=FORMAT_VERSION + 1).to_json())
    with pytest.raises(ManifestError, match="upgrade elastic-rt"):
        Manifest.from_json(json.dumps(body).encode())


@pytest.mark.parametrize("name", ["../escape", "a/b", "", "..", "x\\y"])
def test_file_names_cannot_leave_the_step_directory(name):
    with pytest.raises(ManifestError, match="unsafe"):
        FileEntry(path=name, size=1, crc32=1, rank=0)


def test_negative_sizes_are_rejected():
    with pytest.raises(ManifestError, match="size"):
        FileEntry(path="f", size=-1, crc32=1, rank=0)


def test_manifest_error_is_a_checkpoint_error():
    assert issubclass(ManifestError, CheckpointError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": 0},
        {"keep_last": True},
        {"if_busy": "drop"},
        {"collective_timeout_s": 0.0},
        {"thread_count": 0},
        {"per_rank_keys": "rng"},
    ],
)
def test_bad_options_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        CheckpointOptions(**kwargs)


def test_options_are_frozen_and_keyword_only():
    options = CheckpointOptions(keep_last=2, storage_options={"anon": True})
    with pytest.raises(Exception):
        options.keep_last = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.storage_options["anon"] = False  # type: ignore[index]
    with pytest.raises(TypeError):
        CheckpointOptions(2)  # type: ignore[misc]
