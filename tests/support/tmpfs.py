"""A small tmpfs mounted by a test (a full log dir, a small /dev/shm): root only, skipped elsewhere."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's spelling: 256k, 1m) at `mnt`, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt.mkdir(exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
