"""elastic_rt.chaos.io_throttle: a cgroup whose processes' writes to one disk are limited to N a second (a slow disk
on demand: etcd's WAL fsyncs wait behind it). Real cgroups, a real process that really fsyncs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from elastic_rt.chaos import io_throttle

_FSYNCS = textwrap.dedent("""
    import os, sys
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
    for i in range(int(sys.argv[2])):
        os.pwrite(fd, os.urandom(4096), 4096 * i)
        os.fsync(fd)
    os.close(fd)
""")


@pytest.fixture
def throttle_dir(tmp_path):
    if (why := io_throttle.available(str(tmp_path))) is not None:
        pytest.skip(f"no write throttle here: {why}")
    return tmp_path


def test_a_throttled_process_makes_no_more_writes_a_second_than_allowed(throttle_dir):
    """30 fsynced 4 KiB writes at 20 writes a second take at least 1.45 s (the throttle's own floor, whatever the
    machine's speed), and the cgroup counts them."""
    with io_throttle.WriteThrottle(20, str(throttle_dir)) as throttle:
        started = time.monotonic()
        subprocess.run(throttle.wrap([sys.executable, "-c", _FSYNCS, str(throttle_dir / "f"), "30"]), check=True,
                       timeout=120)
        took = time.monotonic() - started
        assert throttle.writes() >= 30
        assert took >= 29 / 20, f"30 fsynced writes took {took:.2f} s: the throttle did not hold them"
        path = throttle.path
    assert not os.path.exists(path)


def test_the_disk_is_the_whole_device_that_holds_the_path(throttle_dir):
    disk = io_throttle.disk_of(str(throttle_dir))
    major, minor = (int(x) for x in disk.split(":"))
    assert os.path.exists(f"/sys/dev/block/{disk}") and not os.path.exists(f"/sys/dev/block/{disk}/partition")
    assert major > 0 and minor >= 0


def test_what_cannot_be_throttled_says_why():
    if os.path.isdir("/dev/shm"):
        with pytest.raises(ValueError, match="on no single block device"):
            io_throttle.disk_of("/dev/shm")
    with pytest.raises(ValueError, match=">= 1"):
        io_throttle.WriteThrottle(0, "/")
