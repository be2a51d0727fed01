"""`elastic-rt ckpt list|verify URL`: tables, exit codes, one-line errors."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys

import pytest
import torch

from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint.cli import add_subparser, run
from elastic_rt.checkpoint.storage import CheckpointStore


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="elastic-rt")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run(parse(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def root(tmp_path) -> str:
    url = f"file://{tmp_path}/ckpt"
    state = {"model": {"w": torch.arange(1000, dtype=torch.float32)}, "extra": {"note": "hi"}}
    with CheckpointManager(url, keep_last=5) as mgr:
        mgr.save(100, state)
        mgr.save(200, state)
    store = CheckpointStore(url)
    store.fs.makedirs(store.step_dir(300), exist_ok=True)  # a save that never committed
    store.fs.pipe_file(f"{store.step_dir(300)}/__0_0.distcp", b"x" * 10)
    return url


def _shard(url: str, step: int) -> str:
    store = CheckpointStore(url)
    entry = store.entry(step)
    return next(p for p in store.fs.ls(entry.data_dir(entry.manifest), detail=False) if p.endswith(".distcp"))


def test_list_shows_committed_and_uncommitted(root):
    code, out, err = cli(["ckpt", "list", root])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "WORLD", "SIZE", "CREATED", "STATE"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"100", "200", "300"}
    assert "committed" in rows["100"] and "uncommitted" not in rows["100"]
    assert rows["100"].split()[1] == "1"  # world size
    assert "uncommitted" in rows["300"] and "10 B" in rows["300"]


def test_verify_passes_on_intact_checkpoints(root):
    code, out, err = cli(["ckpt", "verify", root])
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert rows["100"].rstrip().endswith("ok") and rows["200"].rstrip().endswith("ok")
    assert rows["300"].rstrip().endswith("-")


def test_verify_fails_on_a_flipped_byte_and_names_the_file(root):
    shard = _shard(root, 200)
    store = CheckpointStore(root)
    data = bytearray(store.fs.cat_file(shard))
    data[len(data) // 2] ^= 0x01
    store.fs.pipe_file(shard, bytes(data))
    code, out, err = cli(["ckpt", "verify", root])
    assert code != 0
    assert f"step 200: {os.path.basename(shard)}: crc32" in out
    assert "1 of 2 committed checkpoints failed verification" in err
    assert cli(["ckpt", "verify", root, "--step", "100"])[0] == 0


def test_verify_fails_on_a_truncated_shard(root):
    shard = _shard(root, 100)
    store = CheckpointStore(root)
    store.fs.pipe_file(shard, store.fs.cat_file(shard)[:50])
    code, out, _ = cli(["ckpt", "verify", root])
    assert code != 0 and "step 100" in out and "size 50 bytes" in out


def test_verify_without_any_committed_checkpoint_fails(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.fs.makedirs(store.step_dir(1), exist_ok=True)
    code, _, err = cli(["ckpt", "verify", str(tmp_path)])
    assert code != 0 and "no committed checkpoint" in err


@pytest.mark.parametrize(
    "url, message",
    [
        ("foo://nowhere", "cannot open checkpoint URL"),
        ("/nonexistent/elastic-rt/ckpt", "no checkpoints under"),
    ],
)
def test_bad_urls_give_one_line_and_a_non_zero_exit(url, message):
    for command in ("list", "verify"):
        code, out, err = cli(["ckpt", command, url])
        assert code != 0 and out == ""
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unknown_step_is_reported(root):
    code, _, err = cli(["ckpt", "verify", root, "--step", "7"])
    assert code != 0 and "no checkpoint for step 7" in err


def test_module_entry_point_runs_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_rt.checkpoint.cli", "ckpt", "list", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "no checkpoints under" in proc.stderr and "Traceback" not in proc.stderr
